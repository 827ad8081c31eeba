"""Retry-After arithmetic and the per-worker in-flight count (``web.admission``)."""

from __future__ import annotations

import pytest

from residency.errors import ApiError
from web.admission import (
    MAX_RETRY_S,
    MIN_RETRY_S,
    InFlight,
    busy_retry_after,
    queue_retry_after,
)


def test_a_queue_retry_after_is_the_work_ahead_over_the_slots() -> None:
    assert queue_retry_after(10, 2.0, 4) == 5
    assert queue_retry_after(3, 1.1, 1) == 4  # rounded up
    assert queue_retry_after(1, 0.01, 8) == MIN_RETRY_S
    assert queue_retry_after(100_000, 60.0, 1) == MAX_RETRY_S
    assert queue_retry_after(5, None, 2) == MIN_RETRY_S  # nothing observed yet


def test_a_busy_retry_after_is_the_time_until_one_request_ends() -> None:
    assert busy_retry_after(10, 100.0) == 10
    assert busy_retry_after(1000, 5.0) == MIN_RETRY_S
    assert busy_retry_after(0, 5.0) == MIN_RETRY_S
    assert busy_retry_after(4, None) == MIN_RETRY_S


def test_in_flight_admits_up_to_its_cap_and_learns_durations() -> None:
    f = InFlight()
    a = f.admit(2)
    f.admit(2)
    with pytest.raises(ApiError) as e:
        f.admit(2)
    assert e.value.status == 429 and e.value.code == "server_busy"
    f.release(a)
    assert f.count == 1 and f.duration_s is not None
    f.admit(2)
    assert f.count == 2


def test_a_client_connection_above_descriptor_1023_is_judged_open_or_closed() -> None:
    """A worker holding a thousand clients has descriptors past select()'s limit."""
    import resource
    import socket

    from web.openai_api import _peer_closed

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    filler = [socket.socket() for _ in range(1030)]
    try:
        a, b = socket.socketpair()
        assert a.fileno() > 1023
        assert not _peer_closed(a)
        b.close()
        assert _peer_closed(a)
        a.close()
    finally:
        for s in filler:
            s.close()
