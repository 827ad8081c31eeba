"""What one web worker lets in, and when a refused client should come back.

A worker holds every API request it admitted — waiting in a queue, waiting for a load,
streaming — until its response is closed. ``server.max_in_flight`` bounds that number per
worker: past it a request gets 429 at once instead of adding to a wait that can only grow, and
the greenlets (or threads) left keep ``/livez``, ``/readyz`` and ``/admin`` answering. The
places are shared between users: a user within its share of them (``share_victim``) who finds
the worker full is let in by pushing out the newest still-queued request of the user furthest
above its share, so one user's thousand waiting requests cannot shut another user out.

``Retry-After`` is computed, never a constant: for a full model queue, the time its slots need
to work through the requests ahead (depth x the model's observed time per request / slots); for
a full worker, the time until one of its requests ends at the pace they have been ending.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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


@dataclass(eq=False)
class Place:
    """One API request this worker holds. ``call``: its queued request (a ``bus.Call``) once
    it was submitted, which is what can be pushed out; ``pushing``: another request is pushing
    it out now (no other picks it meanwhile); ``leaving``: it was pushed out and gives its
    place back as soon as its thread has answered."""

    user: str
    weight: float
    started: float
    seq: int
    call: Any = None
    pushing: bool = False
    leaving: bool = False


def share_victim(places: Iterable[Place], cap: int, user: str, weight: float) -> list[Place]:
    """The places that could make room for a new request of ``user`` (of ``weight``) in a full
    worker, best first; empty when its requests would then be above its share. A user's share
    of ``cap`` is cap x its weight / the sum of the weights of the users holding places (the
    newcomer included). The candidates are the submitted requests of the users above their
    share, the furthest above first and, within one user, its newest first; whether one is
    still queued (not taken by a model process) only Redis can say."""
    held: dict[str, list[Place]] = {}
    weights: dict[str, float] = {}
    for p in places:
        if not p.leaving:
            held.setdefault(p.user, []).append(p)
            # A weight changed while requests were held: the largest of its requests' weights.
            weights[p.user] = max(weights.get(p.user, 0.0), p.weight)
    weights[user] = weight
    total = weight + sum(w for u, w in weights.items() if u != user and u in held)

    def share(u: str) -> float:
        return cap * weights[u] / total

    if len(held.get(user, [])) + 1 > share(user) + SHARE_EPS:
        return []
    over = [
        (len(ps) - share(u), u)
        for u, ps in held.items()
        if u != user and len(ps) - share(u) > SHARE_EPS
    ]
    out: list[Place] = []
    for _excess, u in sorted(over, key=lambda x: -x[0]):
        ready = (p for p in held[u] if p.call is not None and not p.pushing)
        out += sorted(ready, key=lambda p: -p.seq)
    return out


#: Tolerance of the comparisons of counts (integers) with shares (fractions).
SHARE_EPS = 1e-9
#: Candidates a new request tries to push out before it is refused like any other.
PUSH_TRIES = 4


class InFlight:
    """The API requests this worker holds, and how long they have been lasting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._places: set[Place] = set()
        self._seq = 0
        self.leaving = 0  # places pushed out and not yet given back
        self.duration_s: float | None = None  # moving average of a request's whole life

    @property
    def count(self) -> int:
        return len(self._places)

    def admit(
        self,
        cap: int,
        user: str = "",
        weight: float = 1.0,
        push: Callable[[Place, ApiError], bool] | None = None,
    ) -> Place:
        """Take a place for one more request of ``user``, or raise 429 when ``cap`` are held
        and none can make room. A full worker makes room for a user within its share of
        ``cap``: ``push`` takes a candidate's queued request out of its model's queue with
        the 429 it is given (its thread answers it), or returns False when a model process
        took it already. Redis work runs outside the lock (a greenlet may yield there); a
        candidate is marked ``pushing`` first, so no other request picks it meanwhile, and its
        room is made only once the push succeeded (until then it is held: no other request
        gets in on it)."""
        unpushable: set[Place] = set()
        for _ in range(PUSH_TRIES):
            with self._lock:
                if len(self._places) - self.leaving < cap:
                    return self._add(user, weight)
                victims = [
                    p for p in share_victim(self._places, cap, user, weight) if p not in unpushable
                ]
                held = len(self._places)
                retry = busy_retry_after(held, self.duration_s)
                if push is None or not victims:
                    raise worker_full(held, retry)
                victim = victims[0]
                victim.pushing = True
            pushed = push(victim, pushed_out(held, retry))
            with self._lock:
                victim.pushing = False
                if pushed:
                    # Released meanwhile (its request ended as it was pushed): its place is
                    # free already, and counting it leaving would shrink the worker for good.
                    if victim in self._places:
                        victim.leaving = True
                        self.leaving += 1
                    return self._add(user, weight)
                unpushable.add(victim)
                # A model process took it: it is served now, and no later request tries it.
                victim.call = None
        with self._lock:
            held = len(self._places)
            raise worker_full(held, busy_retry_after(held, self.duration_s))

    def _add(self, user: str, weight: float) -> Place:
        self._seq += 1
        place = Place(user, weight, time.monotonic(), self._seq)
        self._places.add(place)
        return place

    def release(self, place: Place) -> None:
        took = time.monotonic() - place.started
        with self._lock:
            if place not in self._places:
                return
            self._places.discard(place)
            if place.leaving:
                self.leaving -= 1
            prev = self.duration_s
            self.duration_s = took if prev is None else prev + EWMA * (took - prev)


def pushed_out(in_flight: int, retry_after: int) -> ApiError:
    """The 429 of a request that made room in a full worker for a user within its share."""
    return ApiError(
        429,
        f"this server holds {in_flight} requests already, and this one was among its user's "
        f"beyond its fair share of them: it made room for another user's; retry in "
        f"{retry_after}s",
        type="rate_limit_error",
        code="server_busy",
        retry_after=retry_after,
    )


#: This worker's requests (one per process: gunicorn forks a worker per process).
IN_FLIGHT = InFlight()
