"""How long a routed request would wait on each of its listed candidates, and which one it takes.

Pure (no Redis, no clock): ``web.routing`` builds a ``View`` of each candidate from one read of
the pool (``residency.route_view``), and the same views always give the same choice, so the
prediction is testable over generated pools like ``residency.pool.decide``.

The wait predicted is the request's time to its first token, in four terms:

- **queue**: the requests that start before it on that model. With fair queues these are the
  ones ahead of the caller's own turn (``View.ahead``: what ``submit.lua`` would place before
  it), not the whole queue, so one user's flood lengthens its own predictions, not everyone's.
  Slots free at ``parallel / service_s`` a second: the ``n``-th free slot comes after about
  ``(n - 1/2) * service_s / parallel`` (half a service time is left, on average, of the
  requests in flight);
- **load**: nothing when it is resident; its measured load time for the same spec when it is
  cold (``View.load_s``, else an estimate from its bytes), less what a load under way has done;
- **room**: the residents a load would evict must go first. An idle one goes at once, one in
  its turn when its turn ends, a busy one when its work is done, or, with ``pool.max_busy_s``,
  once the load has waited that long and the resident finished what it runs; then each takes
  its measured unload time;
- **prefill**: the prompt's uncached bytes at the model's measured pace to a first token (a
  line fitted to its recent requests: the prompt is never tokenized before routing); a prefix
  this caller's conversation left in a slot or the slot cache of that candidate is not counted.

``choose`` then takes the first listed (``first``, what routing always did), or the one with the
least predicted wait plus a penalty when its load would evict a model in use (``fastest``),
the order breaking ties. Past ``max_wait_s`` on every local candidate it takes
the first listed remote one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["first", "fastest"]
State = Literal["ready", "loading", "cold", "unavailable"]

#: A model with no measured service time yet is taken to hold a slot this long.
DEFAULT_SERVICE_S = 2.0
#: What a load costs before its bytes are read (a process start, the runtime's import), and the
#: pace of reading them, when no load of the model's spec was measured.
LOAD_BASE_S = 1.0
LOAD_BYTES_PER_S = 1.0e9
#: The prefill line's slope is at most this many times the average pace through zero.
SLOPE_CAP = 2.0
#: A load under way is taken to need at least this share of its time more (it is late).
LOADING_LEFT_MIN = 0.1


@dataclass(frozen=True)
class Service:
    """A model's measured pace (``keys.service``): seconds a request holds its slot, and, over
    recent generations, moving averages of the seconds from being taken to the first token
    (``first_s``), of the uncached prompt bytes (``new_bytes``, in ``residency.prompt_size``'s
    measure: the router never tokenizes), of their square and of their product with the
    seconds: a least-squares line through them is the prefill pace."""

    service_s: float | None = None
    first_s: float | None = None
    new_bytes: float | None = None
    bytes_sq: float | None = None
    bytes_first: float | None = None

    @classmethod
    def parse(cls, raw: str | bytes | None) -> Service:
        """``"<service> [<first> <bytes> <bytes^2> <bytes*first>]"``; anything unreadable is
        unknown (an older record of another shape keeps only its service time)."""
        if not raw:
            return cls()
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        vals: list[float | None] = []
        for part in text.split()[:5]:
            try:
                v = float(part)
            except ValueError:
                v = None
            vals.append(v if v is not None and math.isfinite(v) and v >= 0 else None)
        if len(vals) < 5:
            return cls(vals[0] if vals else None)
        return cls(*vals)

    def dumps(self) -> str:
        if self.service_s is None:
            return ""
        fit = (self.first_s, self.new_bytes, self.bytes_sq, self.bytes_first)
        if any(v is None for v in fit):
            return f"{self.service_s:.6g}"
        # The fit's averages to 12 digits: its spread is a difference of two of them (the
        # square's average less the average's square), which at 6 digits is rounding noise
        # when the sizes barely vary, and a slope out of that noise.
        return f"{self.service_s:.6g} " + " ".join(f"{v:.12g}" for v in fit)

    def prefill_s(self, new_bytes: int) -> float:
        """Seconds from being taken to the first token for a prompt of ``new_bytes`` uncached
        bytes: the line fitted to the recent requests (a fixed part, the first decode step,
        and a part per byte), or their average pace through zero while they were all of one
        size; 0 when not measured."""
        y, x, xx, xy = self.first_s, self.new_bytes, self.bytes_sq, self.bytes_first
        if y is None or x is None or xx is None or xy is None:
            return 0.0
        # Under one byte on average (prompts cached whole) there is no pace per byte to read:
        # a division by next to nothing would give inf, and inf x 0 a NaN wait.
        through_zero = y / x if x >= 1.0 else 0.0
        var = xx - x * x
        if var > max(1.0, 1e-6 * xx):
            # A line with a fixed part >= 0 has a slope of at most the average pace through
            # zero; a prefill that grows faster than linearly (attention) somewhat more. Moving
            # averages of a shifting mix can make the fitted slope far steeper (measured: 4 s
            # predicted for a 30 ms first token), so it is held to twice that pace.
            slope = min(SLOPE_CAP * through_zero, max(0.0, (xy - x * y) / var))
            base = max(0.0, y - slope * x)
        else:
            slope, base = through_zero, 0.0
        return base + slope * max(0, new_bytes)


@dataclass(frozen=True)
class Occupant:
    """A resident that a load of the candidate would evict, as it is now."""

    name: str
    in_flight: int = 0
    queued: int = 0
    parallel: int = 1
    service_s: float | None = None
    turn_left_s: float = 0.0  # idle but in its turn: its slot frees this much later
    unload_s: float = 0.0  # how long its last unload took (its drain to its unload)

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.queued > 0

    @property
    def in_use(self) -> bool:
        """Someone is using it: evicting it takes it from them."""
        return self.busy or self.turn_left_s > 0


@dataclass(frozen=True)
class View:
    """One listed candidate as the router sees it."""

    name: str
    remote: bool = False
    state: State = "ready"
    # Why it cannot take the request ("" when it can): outside the caller's key, cold for a
    # caller that may not load, failing its loads, too large for any device...
    excluded: str = ""
    parallel: int = 1
    in_flight: int = 0
    ahead: int = 0  # queued requests that start before this caller's next one
    service: Service = field(default_factory=Service)
    load_s: float | None = None  # its spec's measured load time (cold or loading)
    load_bytes: int | None = None  # what it loads, for an estimate when none was measured
    loading_for_s: float = 0.0  # how long its load under way has run
    victims: tuple[Occupant, ...] = ()  # what its load would evict (cold)
    max_busy_s: float = 0.0  # pool.max_busy_s: a busy resident yields after a load waited this
    cached_bytes: int = 0  # its prefix this caller's conversation left there


@dataclass(frozen=True)
class Prediction:
    name: str
    wait_s: float | None  # None: not predicted (a remote, or excluded)
    queue_s: float = 0.0
    load_s: float = 0.0
    room_s: float = 0.0
    prefill_s: float = 0.0
    penalty_s: float = 0.0
    evicts: tuple[str, ...] = ()
    load_measured: bool = False
    excluded: str = ""

    @property
    def score(self) -> float:
        return math.inf if self.wait_s is None else self.wait_s + self.penalty_s

    def terms(self) -> dict[str, float]:
        return {
            "wait": round(self.wait_s or 0.0, 4),
            "queue": round(self.queue_s, 4),
            "load": round(self.load_s, 4),
            "room": round(self.room_s, 4),
            "prefill": round(self.prefill_s, 4),
        }

    def trace(self) -> dict[str, Any]:
        out: dict[str, Any] = {"candidate": self.name}
        if self.excluded:
            out["excluded"] = self.excluded
        if self.wait_s is None:
            if not self.excluded:
                out["remote"] = True
            return out
        out.update(self.terms())
        if self.penalty_s:
            out["penalty"] = round(self.penalty_s, 4)
        if self.evicts:
            out["evicts"] = list(self.evicts)
        if self.load_s:
            out["load_measured"] = self.load_measured
        return out


@dataclass(frozen=True)
class Choice:
    candidate: str
    # "first" | "fastest" | "only" (one usable) | "none_usable" (the first listed: its own
    # error answers) | "over_max_wait" (to a remote) | "over_max_wait_no_remote"
    reason: str
    predictions: tuple[Prediction, ...]

    def chosen(self) -> Prediction | None:
        return next((p for p in self.predictions if p.name == self.candidate), None)


def estimated_load_s(v: View) -> tuple[float, bool]:
    """(its load's seconds, whether measured)."""
    if v.load_s is not None:
        return v.load_s, True
    return LOAD_BASE_S + (v.load_bytes or 0) / LOAD_BYTES_PER_S, False


def slot_wait(n: int, service_s: float, parallel: int) -> float:
    """Seconds until the ``n``-th slot frees on a model running ``parallel`` at a time (0 for
    ``n <= 0``: a slot is free)."""
    if n <= 0:
        return 0.0
    return (n - 0.5) * service_s / max(1, parallel)


def drain_s(o: Occupant, max_busy_s: float) -> float:
    """Seconds until a resident a load would evict is gone: until it is idle (``idle_s``),
    then its unload."""
    return idle_s(o, max_busy_s) + o.unload_s


def idle_s(o: Occupant, max_busy_s: float) -> float:
    """Seconds until a resident a load would evict may go."""
    if not o.busy:
        return o.turn_left_s
    service = o.service_s if o.service_s is not None else DEFAULT_SERVICE_S
    parallel = max(1, o.parallel)
    # Idle once what it runs (half done, on average) and its queue are done: its last queued
    # request starts when the slot before it frees, and then runs a whole service time.
    if o.queued == 0:
        whole = service / 2
    else:
        whole = slot_wait(o.in_flight + o.queued - parallel, service, parallel) + service
    if max_busy_s > 0:
        # It yields once the load waited max_busy_s: it then finishes only what it runs.
        return min(whole, max_busy_s + service / 2)
    return whole


def predict(v: View, prompt_bytes: int, evict_penalty_s: float = 0.0) -> Prediction:
    """The predicted wait on ``v`` of a request whose prompt is ``prompt_bytes`` long
    (``residency.prompt_size``)."""
    if v.excluded:
        return Prediction(v.name, None, excluded=v.excluded)
    if v.remote:
        return Prediction(v.name, None)
    if v.state == "unavailable":
        return Prediction(v.name, None, excluded="unavailable")
    service = v.service.service_s if v.service.service_s is not None else DEFAULT_SERVICE_S
    parallel = max(1, v.parallel)
    in_flight = v.in_flight if v.state == "ready" else 0
    queue = slot_wait(in_flight + v.ahead - parallel + 1, service, parallel)
    load, measured = (0.0, False)
    room = 0.0
    evicts: tuple[str, ...] = ()
    penalty = 0.0
    if v.state in ("cold", "loading"):
        load, measured = estimated_load_s(v)
        if v.state == "loading":
            load = max(load * LOADING_LEFT_MIN, load - v.loading_for_s)
        else:
            evicts = tuple(o.name for o in v.victims)
            room = max((drain_s(o, v.max_busy_s) for o in v.victims), default=0.0)
            if any(o.in_use for o in v.victims):
                penalty = evict_penalty_s
    new_bytes = max(0, prompt_bytes - min(v.cached_bytes, prompt_bytes))
    prefill = v.service.prefill_s(new_bytes)
    wait = queue + load + room + prefill
    return Prediction(
        v.name,
        wait,
        queue_s=queue,
        load_s=load,
        room_s=room,
        prefill_s=prefill,
        penalty_s=penalty,
        evicts=evicts,
        load_measured=measured,
    )


def choose(
    mode: Mode,
    views: Sequence[View],
    prompt_bytes: int,
    *,
    evict_penalty_s: float = 0.0,
    max_wait_s: float = 0.0,
) -> Choice:
    """The candidate among ``views`` (the listed ones, in preference order)."""
    if not views:
        raise ValueError("no candidates listed")
    preds = tuple(predict(v, prompt_bytes, evict_penalty_s) for v in views)
    usable = [(v, p) for v, p in zip(views, preds, strict=True) if not p.excluded]
    if mode == "first":
        return Choice(views[0].name, "first", preds)
    if not usable:
        return Choice(views[0].name, "none_usable", preds)
    local = [(v, p) for v, p in usable if not v.remote]
    remote = [v for v, _ in usable if v.remote]
    if not local:
        return Choice(remote[0].name, "only", preds)
    # The first of equal scores: the list's order breaks ties.
    best_score = min(p.score for _, p in local)
    best = next(p for _, p in local if p.score <= best_score)
    assert best.wait_s is not None
    if max_wait_s > 0 and all((p.wait_s or 0.0) > max_wait_s for _, p in local):
        if remote:
            return Choice(remote[0].name, "over_max_wait", preds)
        return Choice(best.name, "over_max_wait_no_remote", preds)
    if len(usable) == 1:
        return Choice(best.name, "only", preds)
    return Choice(best.name, "fastest", preds)
