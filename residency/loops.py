"""The background loop every role runs: one iteration at a time until stopped, surviving errors."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

REDIS_RETRY_S = 1.0
BUG_RETRY_S = 0.5


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
