"""What one web worker lets in, and when a refused client should come back.

A worker holds every API request it admitted — waiting in a queue, waiting for a load,
streaming — until its response is closed. ``server.max_in_flight`` bounds that number per
worker: past it a request gets 429 at once instead of adding to a wait that can only grow, and
the greenlets (or threads) left keep ``/livez``, ``/readyz`` and ``/admin`` answering.

``Retry-After`` is computed, never a constant: for a full model queue, the time its slots need
to work through the requests ahead (depth x the model's observed time per request / slots); for
a full worker, the time until one of its requests ends at the pace they have been ending.
"""

from __future__ import annotations

import math
import threading
import time

from residency.errors import ApiError

MIN_RETRY_S = 1
MAX_RETRY_S = 600
EWMA = 0.2  # weight of the newest request in a moving average


def _clamp(seconds: float) -> int:
    return max(MIN_RETRY_S, min(MAX_RETRY_S, math.ceil(seconds)))


def queue_retry_after(depth: int, service_s: float | None, slots: int) -> int:
    """Seconds until a model with ``depth`` requests waiting has served them: each takes
    ``service_s`` in one of ``slots`` slots (unknown: the minimum)."""
    if not service_s or service_s <= 0:
        return MIN_RETRY_S
    return _clamp(depth * service_s / max(slots, 1))


def busy_retry_after(in_flight: int, duration_s: float | None) -> int:
    """Seconds until one of ``in_flight`` requests, each lasting ``duration_s`` on average,
    ends (unknown: the minimum)."""
    if not duration_s or duration_s <= 0 or in_flight <= 0:
        return MIN_RETRY_S
    return _clamp(duration_s / in_flight)


def worker_full(in_flight: int, retry_after: int) -> ApiError:
    return ApiError(
        429,
        f"this server holds {in_flight} requests already; retry in {retry_after}s",
        type="rate_limit_error",
        code="server_busy",
        retry_after=retry_after,
    )


class InFlight:
    """The API requests this worker holds, and how long they have been lasting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.duration_s: float | None = None  # moving average of a request's whole life

    def admit(self, cap: int) -> float:
        """Count one more request, or raise 429 when ``cap`` are held; returns its start
        time, for ``release``."""
        with self._lock:
            if self.count >= cap:
                raise worker_full(self.count, busy_retry_after(self.count, self.duration_s))
            self.count += 1
        return time.monotonic()

    def release(self, started: float) -> None:
        took = time.monotonic() - started
        with self._lock:
            self.count -= 1
            prev = self.duration_s
            self.duration_s = took if prev is None else prev + EWMA * (took - prev)


#: This worker's requests (one per process: gunicorn forks a worker per process).
IN_FLIGHT = InFlight()
