"""Rule 8: a stop wakes a blocking read at once instead of waiting out its timeout."""

from __future__ import annotations

import threading

import redis

from residency.box import connect
from residency.loops import Waker


def test_a_stop_unblocks_a_long_blocking_read(redis_url: str, r: redis.Redis) -> None:
    stop = threading.Event()
    waker = Waker(connect(redis_url), stop)
    got: list[object] = []
    blocked = threading.Event()

    def read() -> None:
        client = waker.ready()
        blocked.set()
        got.append(client.blpop(["rsd:test:never"], timeout=120))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert blocked.wait(10)
    # Wait until Redis reports the read as blocked, then stop.
    for _ in range(500):
        if int(r.info("clients")["blocked_clients"]) >= 1:
            break
        threading.Event().wait(0.01)
    stop.set()
    t.join(20)  # far below the read's 120 s timeout: only the wake-up can end it in time
    assert not t.is_alive()
    assert got == [None]
    waker.close()
