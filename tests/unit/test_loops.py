"""A background loop survives a bug or a Redis outage in one iteration and stops when told."""

from __future__ import annotations

import logging
import threading

import redis

from residency.loops import run_until_stopped


def test_loop_goes_on_after_errors_and_stops_on_request(caplog: object) -> None:
    stop = threading.Event()
    calls: list[int] = []

    def iteration() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        if len(calls) == 2:
            raise redis.ConnectionError("redis went away")
        stop.set()

    run_until_stopped(stop, iteration, logging.getLogger("t"), "test loop")
    assert len(calls) == 3
