"""Retry-After arithmetic and the per-worker in-flight count (``web.admission``)."""

from __future__ import annotations

import pytest

from residency.errors import ApiError
from web.admission import (
    MAX_RETRY_S,
    MIN_RETRY_S,
    InFlight,
    Place,
    busy_retry_after,
    queue_retry_after,
    share_victim,
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


def places(*spec: tuple[str, float, bool]) -> list[Place]:
    """(user, weight, submitted) each, admitted in this order."""
    return [
        Place(u, w, 0.0, n, call=object() if sub else None) for n, (u, w, sub) in enumerate(spec)
    ]


def test_the_newest_submitted_request_of_the_user_furthest_above_its_share_is_first() -> None:
    held = places(("a", 1, True), ("a", 1, True), ("a", 1, False), ("b", 1, True))
    # cap 4 among a, b, c: 4/3 each. a (3) is furthest above; its newest submitted request
    # first (the third has no queued request yet: it cannot be pushed out), then b is not
    # above its share (1 < 4/3).
    assert share_victim(held, 4, "c", 1.0) == [held[1], held[0]]
    # b is within its share with one more (2 <= 2 of 4 between a and b)...
    assert share_victim(held, 4, "b", 1.0) == [held[1], held[0]]
    # ...a is not (4 > 4 alone), nor is b with a third (3 > 2).
    assert share_victim(held, 4, "a", 1.0) == []
    more = [*held, *places(("b", 1, True))]
    assert share_victim(more, 5, "b", 1.0) == []


def test_weights_set_the_in_flight_shares() -> None:
    # a (weight 1) 3 places, b (weight 3) 5, cap 8; c (weight 1) asks: shares 1.6, 4.8, 1.6.
    held = places(*[("a", 1, True)] * 3, *[("b", 3, True)] * 5)
    assert share_victim(held, 8, "c", 1.0)[:3] == [held[2], held[1], held[0]]
    assert share_victim(held, 8, "c", 1.0)[3:] == [held[7], held[6], held[5], held[4], held[3]]
    # With weight 6, c's share is 8 x 6/10 = 4.8 (its first request is within it, its fifth
    # is not), a's 0.8 and b's 2.4: b is furthest above now (2.6 to a's 2.2).
    assert share_victim(held, 8, "c", 6.0)[0] is held[7]
    mine = places(*[("c", 6, True)] * 4)
    assert share_victim([*held, *mine], 8, "c", 6.0) == []


def test_a_place_leaving_counts_for_nobody() -> None:
    held = places(("a", 1, True), ("a", 1, True))
    held[1].leaving = True
    # a holds 1 of 2 now: at its share, nothing to push out for b.
    assert share_victim(held, 2, "b", 1.0) == []


def test_a_full_worker_pushes_out_for_a_user_within_its_share() -> None:
    f = InFlight()
    a = [f.admit(2, "a") for _ in range(2)]
    for p in a:
        p.call = object()
    pushed: list[tuple[Place, ApiError]] = []
    taken = {id(a[1])}  # a model process took a's newest already: only Redis knows

    def push(p: Place, err: ApiError) -> bool:
        pushed.append((p, err))
        return id(p) not in taken

    b = f.admit(2, "b", push=push)
    assert [p for p, _ in pushed] == [a[1], a[0]]
    err = pushed[-1][1]
    assert err.status == 429 and err.code == "server_busy" and err.retry_after
    assert a[0].leaving and not a[1].leaving and f.count == 3
    assert a[1].call is None  # served: no later request tries it again
    # The one pushed out gives its place back when its thread has answered; b is within its
    # share now (1 of 1), so a third user's request finds nothing to push out.
    with pytest.raises(ApiError):
        f.admit(2, "c", push=push)
    f.release(a[0])
    assert f.count == 2 and f.leaving == 0
    with pytest.raises(ApiError) as e:
        f.admit(2, "b", push=push)  # b at its share: refused like anyone
    assert e.value.code == "server_busy"
    f.release(b)
    f.release(a[1])
    assert f.count == 0


def test_a_request_ending_while_it_is_pushed_out_leaves_the_worker_whole() -> None:
    # The push is a Redis round trip: other greenlets run meanwhile. The request being pushed
    # out may end then (its model process finished it).
    for pushed in (False, True):
        f = InFlight()
        a = [f.admit(2, "a") for _ in range(2)]
        for p in a:
            p.call = object()

        def push(p: Place, err: ApiError, f: InFlight = f, pushed: bool = pushed) -> bool:
            f.release(p)  # it ended during the round trip
            return pushed

        b = f.admit(2, "b", push=push)  # its place freed meanwhile: taken
        assert f.leaving == 0 and f.count == 2
        f.release(b)
        f.release(a[0])
        assert f.count == 0 and f.leaving == 0
        # The worker is whole: its cap is still its cap.
        held = [f.admit(2, "c"), f.admit(2, "c")]
        assert f.count == 2
        for p in held:
            f.release(p)


def test_no_request_gets_in_on_a_place_while_it_is_being_pushed_out() -> None:
    f = InFlight()
    a = [f.admit(2, "a") for _ in range(2)]
    for p in a:
        p.call = object()
    during: list[str] = []

    def push(p: Place, err: ApiError) -> bool:
        # Another request arrives during the round trip: the room is not made yet.
        try:
            f.admit(2, "a")
            during.append("admitted")
        except ApiError:
            during.append("refused")
        return False  # a model process took it: no room after all

    with pytest.raises(ApiError):
        f.admit(2, "b", push=push)
    assert during == ["refused", "refused"]
    assert f.count == 2 and f.leaving == 0


def test_a_client_connection_above_descriptor_1023_is_judged_open_or_closed() -> None:
    """A worker holding a thousand clients has descriptors past select()'s limit."""
    import resource
    import socket

    from web.pipeline import peer_closed as _peer_closed

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
