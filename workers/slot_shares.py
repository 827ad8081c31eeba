"""Slot shares per user in one model process: who may take a free slot now.

Fair queueing puts a light user's request at the head of the queue, but without shares a heavy
user holding every slot still makes it wait for one of them to finish. So a user may take a
free slot only while its requests in flight on this process are below its share:
``parallel x weight / sum of the active users' weights``, where a user is active while it has
a request in flight here or its last one here ended less than ``grace_s`` ago (a user that
sends its next request right after its answer keeps its share through that gap). A user at its
share is refused only while another active user is below its share; otherwise the process is
work-conserving and any request takes a free slot. Pure: the clock is injected, and the model
process does the Redis side (peeking at the queue head, taking it).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable


def _weight(w: float) -> float:
    # A weight comes with the request's JSON: anything not a positive finite number counts
    # as the default 1, so a bad item cannot take every slot or none.
    return w if math.isfinite(w) and w > 0 else 1.0


class SlotShares:
    """In-flight counts and last finishes per user (thread-safe: slots finish on their own
    threads). ``grace_s`` 0 turns shares off: every request may take a free slot."""

    def __init__(self, parallel: int, grace_s: float, clock: Callable[[], float]) -> None:
        self.parallel = parallel
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._weight: dict[str, float] = {}
        self._last_end: dict[str, float] = {}  # users with nothing in flight: when theirs ended

    def started(self, user: str, weight: float = 1.0) -> None:
        with self._lock:
            self._in_flight[user] = self._in_flight.get(user, 0) + 1
            self._weight[user] = _weight(weight)
            self._last_end.pop(user, None)

    def finished(self, user: str) -> None:
        with self._lock:
            n = self._in_flight.get(user, 0) - 1
            if n > 0:
                self._in_flight[user] = n
                return
            self._in_flight.pop(user, None)
            if self.grace_s > 0:
                self._last_end[user] = self._clock()
            else:
                self._weight.pop(user, None)

    def in_flight(self, user: str) -> int:
        with self._lock:
            return self._in_flight.get(user, 0)

    def _active(self, now: float) -> dict[str, float]:
        """Active users and their weights (under the lock); forgets those whose grace ended."""
        for user, ended in list(self._last_end.items()):
            if now - ended >= self.grace_s:
                del self._last_end[user]
                self._weight.pop(user, None)
        return {u: self._weight.get(u, 1.0) for u in (*self._in_flight, *self._last_end)}

    def capped(self) -> frozenset[str]:
        """The users that may not take a free slot now: those at or above their share while
        another active user is below its share. Empty with fewer than 2 active users (the
        uncontended path needs no look at the queue head)."""
        if self.grace_s <= 0:
            return frozenset()
        with self._lock:
            active = self._active(self._clock())
            if len(active) < 2:
                return frozenset()
            total = sum(active.values())
            # in flight >= parallel x w / total, kept in products (no division's rounding)
            at_share = {
                u
                for u, w in active.items()
                if self._in_flight.get(u, 0) * total >= self.parallel * w
            }
            if len(at_share) == len(active):
                return frozenset()  # nobody below its share: take anything (work-conserving)
            return frozenset(at_share)

    def may_take(self, head_user: str) -> bool:
        """Whether the request at the queue head, ``head_user``'s, may take a free slot."""
        return head_user not in self.capped()

    def hold_until(self) -> float | None:
        """The clock time at which a held slot's decision changes by time alone (the first
        grace of an active user with nothing in flight ends), or None when none does."""
        with self._lock:
            now = self._clock()
            ends = [t + self.grace_s for t in self._last_end.values() if t + self.grace_s > now]
        return min(ends) if ends else None
