"""The background loop every role runs: one iteration at a time until stopped, surviving errors."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import redis

from residency.redis_conn import pool_like

REDIS_RETRY_S = 1.0
BUG_RETRY_S = 0.5
# Errors that mean Redis is unreachable or restarting (BusyLoadingError, raised while a
# restarted server reads its AOF, is a ConnectionError): wait and try again.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


def run_until_stopped(
    stop: threading.Event, iteration: Callable[[], None], log: logging.Logger, what: str
) -> None:
    """Call ``iteration`` until ``stop`` is set. A Redis outage or a bug in one iteration is
    logged and the loop goes on (after a short pause that wakes at once on stop): a background
    role must never die silently and leave the pool unenforced."""
    while not stop.is_set():
        try:
            iteration()
        except redis.RedisError as e:
            log.error("redis error in %s: %s", what, e)
            stop.wait(REDIS_RETRY_S)
        except Exception:
            log.exception("%s iteration failed", what)
            stop.wait(BUG_RETRY_S)


class Waker:
    """Blocking reads (BLPOP, BLMOVE) on a connection of their own, which a stop unblocks at
    once (CLIENT UNBLOCK from another connection): a shutdown never waits out a read's timeout.

    ``r`` is the role's client; ``stop`` its stop event. Block inside ``with waker.reading() as
    client:``. The wake-up thread lives until ``stop`` is set (or ``close``)."""

    def __init__(self, r: redis.Redis, stop: threading.Event) -> None:
        self.r = r
        self.stop = stop
        # Same server (or Sentinel service) and options as ``r``: after a failover the read's
        # connection error is followed by a reconnect to the new primary.
        self.blocking = redis.Redis(connection_pool=pool_like(r), single_connection_client=True)
        self._id: int | None = None
        # A reconnect inside redis-py's own retry (no error reaches us) gives the connection a
        # new id too (on a promoted replica, another client may hold the old one): forget it.
        assert self.blocking.connection is not None
        self.blocking.connection.register_connect_callback(self._reconnected)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._wake_on_stop, name="waker", daemon=True)
        self._thread.start()

    def ready(self) -> redis.Redis:
        """The blocking client, with its connection id known (after a reconnect, re-read)."""
        if self._id is None:
            self._id = int(self.blocking.client_id())
        return self.blocking

    def client_id(self) -> int:
        """The blocking connection's id (CLIENT UNBLOCK wakes a read on it)."""
        self.ready()
        assert self._id is not None
        return self._id

    @contextlib.contextmanager
    def reading(self) -> Iterator[redis.Redis]:
        """The blocking client for a read; if the connection fails, its id is read again on the
        next use (a reconnect gives it a new one)."""
        try:
            yield self.ready()
        except redis.RedisError:
            self._id = None
            raise

    def _reconnected(self, _connection: object) -> None:
        self._id = None

    def _wake_on_stop(self) -> None:
        while not self._closed.is_set():
            if self.stop.wait(0.5):
                break
        if self._id is not None and not self._closed.is_set():
            # On an error the read simply times out by itself a moment later.
            with contextlib.suppress(redis.RedisError):
                self.r.client_unblock(self._id)

    def close(self) -> None:
        self._closed.set()
        self.blocking.close()


def blmove(
    r: redis.Redis, src: str, dst: str, timeout: float, src_end: str, dst_end: str
) -> str | None:
    """BLMOVE waiting up to ``timeout`` seconds, fractional (redis-py types it int; Redis takes
    a float); the moved item, or None when the wait ran out."""
    raw = r.blmove(src, dst, timeout, src_end, dst_end)  # type: ignore[arg-type]
    return None if raw is None else str(raw)
