"""The pure part of the coordinator: given one snapshot of the pool, what should happen.

No Redis, no clock (``Snapshot.now`` is given), no side effects: every rule of DESIGN.md §4 that
picks a victim or admits a load lives here and is unit-tested with plain values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from residency import footprint, keys
from residency.pool.room import Room, Where
from residency.states import OCCUPYING, ModelState

STANDARD = "standard"
HELPER = "helper"  # routing helpers (policy routers, classifiers): own pool, no cap
POOLS = (STANDARD, HELPER)
# A draining model commits its unload within a second or so of being told; one still draining
# after this long whose agent does not report its process is reaped (its state is unbacked).
DRAIN_TIMEOUT_S = 60.0
# How long a model in its first ``min_resident_s`` may sit idle and still keep its slot from a
# waiting model: longer than a looping client's gap between requests, short enough that a
# router switching from it to another model pays little for it.
TURN_IDLE_S = 0.5


@dataclass(frozen=True)
class ModelView:
    name: str
    type: str  # residency.settings.MODEL_TYPES: "llm" | "embedding" | "rerank"
    state: ModelState
    token: str = ""
    pinned: bool = False
    queued: int = 0
    in_flight: int = 0
    last_used: float = 0.0
    demand_since: float | None = None  # submit time of the oldest queued request
    host: str | None = None
    device: str | None = None
    registered: bool = True
    loading_since: float | None = None
    pool: str = STANDARD  # the pool the model belongs to now (HELPER while a policy uses it)
    loaded_pool: str | None = None  # the pool whose slot it took when it was loaded
    explicit: str | None = None  # "load" | "unload" asked through the admin API
    load_seconds: float | None = None
    loaded_at: float | None = None  # host clock of the model process's load commit
    draining_since: float | None = None
    # Times of its recent failures (failed loads), oldest first, and the last cause.
    failures: tuple[float, ...] = ()
    last_error: str | None = None
    # ``failed`` under a token whose failure the coordinator has not settled yet (counted, its
    # waiting requests answered): settled before anything is decided for it.
    failure_pending: bool = False
    # The waiting model this one gives its slot to, and since when (coordinator clock). While
    # it holds a slot it is *yielding*: it takes nothing new from its queue. The fields outlive
    # its unload until its next load, so the slot it gave goes to that model first.
    yielding: str | None = None
    yielding_since: float | None = None
    # Its spec's ``ttl_s`` (None or 0: never expires), and whether it is kept warm: ``preload``
    # in its spec, or a router policy's candidate under ``pool.preload_candidates``. Kept warm
    # wins: such a model never expires (its slot would only be taken back at the next pass).
    ttl_s: float | None = None
    preload: bool = False
    # Memory: the bytes it holds in its device's ledger while it holds a slot (measured after
    # its load; None before: then it is counted for ``need_on`` its device), and what a load of
    # it takes per device kind ("cpu", "cuda"): measured at its last load of the same spec
    # there, else estimated from its GGUF header. A kind it lacks is counted as 0 bytes.
    held_bytes: int | None = None
    need_bytes: tuple[tuple[str, int], ...] = ()
    # Where its last load ran (kept after its unload): a reload goes there when it fits.
    last_host: str | None = None
    last_device: str | None = None

    def need_on(self, device: str) -> int:
        return dict(self.need_bytes).get(footprint.device_kind(device), 0)

    @property
    def bytes_held(self) -> int:
        """Its bytes in the ledger of the device it occupies."""
        if self.held_bytes is not None:
            return self.held_bytes
        return self.need_on(self.device) if self.device else 0

    @property
    def busy(self) -> bool:
        return self.queued > 0 or self.in_flight > 0

    @property
    def occupying(self) -> bool:
        return self.state in OCCUPYING

    @property
    def slot_pool(self) -> str:
        """The pool a resident counts against: the one it was loaded into."""
        return (self.loaded_pool or self.pool) if self.occupying else self.pool

    @property
    def wants_load(self) -> bool:
        return self.queued > 0 or self.explicit == "load"

    @property
    def is_yielding(self) -> bool:
        """Holds a slot it has been asked to give up (admits nothing new)."""
        return self.yielding is not None and self.occupying


@dataclass(frozen=True)
class WorkerView:
    host: str
    devices: tuple[str, ...]
    alive: bool = True
    memory: dict[str, float] = field(default_factory=dict)  # device -> fraction of memory used
    # The agent's report of the model processes it runs: model name -> load token, read at
    # ``children_at`` (host clock). None: this agent does not report them.
    children: dict[str, str] | None = None
    children_at: float | None = None
    # Bytes each device may hold in loaded models (``[worker] device_budget_mb``, or its total
    # less a reserve); a device missing here, or None, has no byte limit.
    budgets: dict[str, int | None] = field(default_factory=dict)
    # Its agent's last heartbeat (host clock; ``keys.hosts_seen``, which outlives the record):
    # a gone host is forgotten ``worker.forget_after_s`` after it. None: never recorded.
    last_seen: float | None = None

    def runs(self, m: ModelView) -> bool:
        """Whether the report shows a process for this load of ``m``."""
        return self.children is not None and self.children.get(m.name) == m.token


@dataclass(frozen=True)
class Snapshot:
    models: dict[str, ModelView]
    workers: dict[str, WorkerView]
    limits: dict[str, int]  # effective limit per model type; -1 = unlimited
    now: float
    load_timeout_s: float = 600.0
    auto_evict: bool = False
    auto_evict_threshold: float = 0.9
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    failure_limit: int = keys.LOAD_FAILURE_LIMIT
    failure_window_s: float = keys.LOAD_FAILURE_WINDOW_S
    # Fairness between models (``pool.max_busy_s``, ``pool.min_resident_s``): a model that has
    # waited this long for a slot held by busy models makes one of them yield (0 = never), but
    # never one loaded less than ``min_resident_s`` ago. Within that time an idle resident is in
    # its *turn* while its last request ended less than ``turn_idle_s`` ago: a client sending
    # back to back leaves it idle between requests, and evicting it in that gap would swap the
    # models on every request.
    max_busy_s: float = 0.0
    min_resident_s: float = 0.0
    turn_idle_s: float = TURN_IDLE_S


@dataclass(frozen=True)
class Load:
    model: str
    host: str
    device: str


@dataclass(frozen=True)
class Evict:
    model: str
    token: str
    # "lru" (to admit a load) | "limit" (over the limit) | "deleted" | "admin" |
    # "helper_unused" (a routing helper no policy references any more) | "memory" (auto_evict)
    # | "room" (its bytes make room on its device for a load)
    # | "ttl" (idle for its ``ttl_s``) | "yield" (gave its slot to a waiting model)
    reason: str


@dataclass(frozen=True)
class Reject:
    """Answer the model's queued requests with an error (nothing can make room)."""

    model: str
    # "slots_pinned" | "too_large" (its bytes exceed every live device's budget: ``need`` and
    # the largest budget ``largest`` say by how much) | "memory_pinned" (pinned residents hold
    # the bytes it needs on every device)
    code: str
    need: int = 0
    largest: int = 0


@dataclass(frozen=True)
class Reap:
    """The model's process or host is gone or stuck: hand its work back and clear its state."""

    model: str
    token: str
    # "host_gone" | "load_timeout" | "no_process" (its agent reports no process for this load)
    # | "drain_timeout" (draining too long, and its agent does not report its process)
    reason: str


@dataclass(frozen=True)
class Backoff:
    """The model failed ``failures`` times within the window: answer its queued requests at once
    with the last cause instead of loading it again, until ``until``."""

    model: str
    until: float
    failures: int
    last_error: str


@dataclass(frozen=True)
class Yield:
    """A busy resident gives its slot to ``for_model``, which has waited ``max_busy_s`` for one:
    it takes nothing new from its queue, finishes what it runs, and is then evicted (reason
    "yield") with its queued requests kept for its next turn."""

    model: str
    token: str
    for_model: str


@dataclass(frozen=True)
class Resume:
    """A yielding model takes requests again: the model it yielded to no longer waits for its
    slot (it got another, or its requests went), or it was pinned meanwhile."""

    model: str
    token: str


@dataclass(frozen=True)
class Wait:
    """Nothing to do now for this model; recorded so the decision can be logged and tested."""

    model: str
    # "no_worker" | "slot_draining" | "evicting" | "all_busy" | "yielding" (a busy resident is
    # finishing its work to give this model its slot) | "in_turn" (an idle resident keeps its
    # slot a moment longer: see ``in_turn``) | "room_draining" (the bytes it needs free once
    # residents already leaving are gone) | "no_room" (no device has its bytes free, and the
    # residents that would make room are busy or pinned; "in_turn" when some are only in their
    # turn)
    reason: str


@dataclass(frozen=True)
class Blocked:
    """A pool is above its limit but every resident it could shrink is busy or pinned."""

    type: str
    over: int


Action = Load | Evict | Reject | Reap | Backoff | Yield | Resume | Wait | Blocked


def waits_for_idle(actions: Iterable[Action], snap: Snapshot) -> bool:
    """Whether some decision can only progress when a busy model goes idle: then the model
    processes must report their busy -> idle edges (else the periodic pass suffices)."""
    for a in actions:
        if isinstance(a, Blocked | Yield) or (
            isinstance(a, Wait) and a.reason in ("all_busy", "yielding", "no_room")
        ):
            return True
    return any(
        m.busy
        and m.occupying
        and (m.explicit == "unload" or (m.slot_pool == HELPER and m.pool != HELPER))
        for m in snap.models.values()
    )


def recent_failures(m: ModelView, snap: Snapshot) -> list[float]:
    """The times of the model's failures that lie within the failure window."""
    return [t for t in m.failures if snap.now - t < snap.failure_window_s]


def backoff_until(m: ModelView, snap: Snapshot) -> float | None:
    """When the model's crash-loop backoff ends, or None if it is not in one: it is while
    ``failure_limit`` of its failures lie within the window; it ends when the oldest of those
    leaves it (the count then drops below the limit)."""
    recent = recent_failures(m, snap)
    if snap.failure_limit <= 0 or len(recent) < snap.failure_limit:
        return None
    return sorted(recent)[-snap.failure_limit] + snap.failure_window_s


def unbacked(m: ModelView, snap: Snapshot) -> str | None:
    """Why a ``ready`` or ``draining`` model on a live host holds state that no process backs
    (the reap reason), or None. The agent's report is trusted only when it was read after the
    process committed its load (same host clock), so a process that has just started is never
    taken for a missing one."""
    w = snap.workers.get(m.host or "")
    if w is None or m.state not in (ModelState.READY, ModelState.DRAINING) or w.runs(m):
        return None
    if (
        w.children is not None
        and w.children_at is not None
        and m.loaded_at is not None
        and w.children_at > m.loaded_at
    ):
        return "no_process"
    if (
        m.state is ModelState.DRAINING
        and m.draining_since is not None
        and snap.now - m.draining_since > snap.drain_timeout_s
    ):
        return "drain_timeout"
    return None


def effective_limit(configured: int, autosize: bool, floor: int) -> int:
    """DESIGN §4 rule 3: autosize raises the LLM limit to the candidate floor; -1 stays -1."""
    if configured == -1:
        return -1
    return max(configured, floor) if autosize else configured


def in_turn(m: ModelView, snap: Snapshot) -> bool:
    """Whether idle ``m`` still keeps its slot from a waiting model: loaded less than
    ``min_resident_s`` ago and used less than ``turn_idle_s`` ago (its client is about to send
    again). A limit that drops, an admin unload or the memory backstop take it all the same."""
    return (
        snap.min_resident_s > 0
        and m.loaded_at is not None
        and snap.now - m.loaded_at < snap.min_resident_s
        and snap.now - m.last_used < min(snap.turn_idle_s, snap.min_resident_s)
    )


def expired(m: ModelView, snap: Snapshot) -> bool:
    """Whether ``m`` has sat unused for its ``ttl_s`` (a model kept warm never expires). Its
    last use is its last request's end, or its load commit when it has served none."""
    used = max(m.last_used, m.loaded_at or 0.0)
    return bool(m.ttl_s) and not m.preload and used > 0 and snap.now - used >= (m.ttl_s or 0)


def memory_pressed(snap: Snapshot) -> bool:
    """Whether the memory backstop is on and some live device is above its threshold: then
    nothing is preloaded (the backstop would evict it again, and the two would loop)."""
    return snap.auto_evict and any(
        used > snap.auto_evict_threshold
        for w in snap.workers.values()
        if w.alive
        for used in w.memory.values()
    )


def lru_victims(models: Iterable[ModelView]) -> list[ModelView]:
    """Evictable residents, least recently used first: ready, idle and unpinned only."""
    ok = [m for m in models if m.state is ModelState.READY and not m.busy and not m.pinned]
    return sorted(ok, key=lambda m: (m.last_used, m.name))


def room_of(snap: Snapshot) -> Room:
    """The ledger of the live devices, before this pass plans anything: each occupying model on
    a live host is counted on its device (a draining one as leaving)."""
    room = Room()
    for w in sorted(snap.workers.values(), key=lambda w: w.host):
        if w.alive:
            for d in w.devices:
                room.device(w.host, d, w.budgets.get(d))
    for m in snap.models.values():
        if not m.occupying or m.host is None or m.device is None:
            continue
        if (m.host, m.device) in room.budgets:  # on a live host (a gone one's is reaped)
            room.add(m.host, m.device, m.name, m.bytes_held)
            if m.state is ModelState.DRAINING:
                room.release(m.name)
    return room


def _place(snap: Snapshot, room: Room, m: ModelView) -> Where | None:
    prefer = (m.last_host, m.last_device) if m.last_host and m.last_device else None
    return room.choose(sorted(room.budgets), m.need_on, prefer)


def decide(snap: Snapshot) -> list[Action]:
    actions: list[Action] = []
    room = room_of(snap)
    alive_hosts = {h for h, w in snap.workers.items() if w.alive}
    live: dict[str, ModelView] = {}

    for m in snap.models.values():
        if not m.occupying:
            continue
        if m.host is not None and m.host not in alive_hosts:
            actions.append(Reap(m.name, m.token, "host_gone"))
            continue
        if (
            m.state is ModelState.LOADING
            and m.loading_since is not None
            and snap.now - m.loading_since > snap.load_timeout_s
        ):
            actions.append(Reap(m.name, m.token, "load_timeout"))
            continue
        if (why := unbacked(m, snap)) is not None:
            actions.append(Reap(m.name, m.token, why))
            continue
        live[m.name] = m
    for a in actions:  # a reaped model's memory is freed with its process
        if isinstance(a, Reap):
            room.release(a.model)

    for m in lru_victims(v for v in live.values() if not v.registered):
        actions.append(Evict(m.name, m.token, "deleted"))
    # A routing helper that no policy uses any more goes as soon as it is idle.
    for m in lru_victims(
        v for v in live.values() if v.slot_pool == HELPER and v.pool != HELPER and v.registered
    ):
        actions.append(Evict(m.name, m.token, "helper_unused"))
    # An explicit admin unload may take a pinned model too; a busy one waits until idle.
    for m in live.values():
        if m.explicit == "unload" and m.registered and m.state is ModelState.READY and not m.busy:
            actions.append(Evict(m.name, m.token, "admin"))
    evicting = {a.model for a in actions if isinstance(a, Evict)}
    # Idle TTL: ready, idle and unpinned only, like any victim.
    for m in lru_victims(v for v in live.values() if v.registered and v.name not in evicting):
        if expired(m, snap):
            actions.append(Evict(m.name, m.token, "ttl"))
    evicting = {a.model for a in actions if isinstance(a, Evict)}

    if snap.auto_evict:
        actions += _memory_backstop(snap, live, evicting)
        evicting = {a.model for a in actions if isinstance(a, Evict)}
    for name in evicting:
        room.release(name)

    # A model in a crash loop is not loaded again: its waiting requests get the cause at once,
    # and it never takes a slot (or evicts a resident) meanwhile.
    backing_off: set[str] = set()
    for m in snap.models.values():
        if m.occupying or not m.registered or (until := backoff_until(m, snap)) is None:
            continue
        backing_off.add(m.name)
        if m.wants_load:
            failures = len(recent_failures(m, snap))
            actions.append(Backoff(m.name, until, failures, m.last_error or "unknown error"))

    preloading = not memory_pressed(snap)
    types = sorted({m.type for m in snap.models.values()})
    for pool in POOLS:
        for typ in types:
            actions += _decide_pool(snap, typ, pool, live, evicting, room, backing_off, preloading)
    return actions


def _decide_pool(
    snap: Snapshot,
    typ: str,
    pool: str,
    live: dict[str, ModelView],
    evicting: set[str],
    room: Room,
    backing_off: set[str],
    preloading: bool = True,
) -> list[Action]:
    out: list[Action] = []
    # Rule 2: routing helpers never take a standard slot, and their own pool has no cap.
    limit = snap.limits.get(typ, 1) if pool == STANDARD else -1
    occupying = [m for m in live.values() if m.type == typ and m.slot_pool == pool]
    waiting = {
        m.name: m
        for m in snap.models.values()
        if m.type == typ
        and m.pool == pool
        and m.registered
        and m.wants_load
        and m.explicit != "unload"
        and m.state in (ModelState.UNLOADED, ModelState.FAILED)
        and m.name not in backing_off
    }
    # Oldest demand first — except that a model which gave its slot to a waiting model goes
    # after it (its own queued requests may be older: else the slot would come straight back).
    wanted = sorted(
        waiting.values(),
        key=lambda m: (
            _gave_way(m, waiting),
            m.demand_since if m.demand_since is not None else snap.now,
            m.name,
        ),
    )
    # Slots already on their way out (draining, or chosen above because deleted) are counted
    # as freeing: a wanted model waits for one rather than evicting another resident.
    freeing = sum(1 for m in occupying if m.name in room.going)
    free = len(wanted) if limit == -1 else limit - len(occupying)
    victims = [v for v in lru_victims(occupying) if v.name not in evicting]
    # Fairness: at most one resident of a pool yields at a time (a draining one included); a
    # ready one that was pinned meanwhile is about to be called off and does not count.
    yielding_for = {
        m.yielding: m
        for m in occupying
        if m.is_yielding and m.state is ModelState.READY and m.name not in evicting
    }
    yielders = [
        m
        for m in occupying
        if m.is_yielding
        and m.name not in evicting
        and not (m.state is ModelState.READY and m.pinned)
    ]
    kept: set[str] = set()  # yielders whose waiter still waits for them
    taken: set[str] = set()  # idle residents evicted for a waiter in this pass

    for w in wanted:
        if free > 0:
            where = _place(snap, room, w)
            if where is None:
                made = _make_room(snap, room, w, live)
                if made != [Wait(w.name, "no_room")]:
                    out += made
                # Fairness by bytes as by count: the busy residents holding the bytes it needs
                # take turns with it once it has waited max_busy_s.
                elif (y := yielding_for.get(w.name)) is not None and not y.pinned:
                    kept.add(y.name)
                    out += _yielded(y, w, taken, room, "no_room")
                elif (
                    not yielders
                    and (
                        y := _yield_candidate(
                            snap,
                            w,
                            [m for m in occupying if _frees_room(m, w, room, live)],
                            evicting,
                        )
                    )
                    is not None
                ):
                    out.append(Yield(y.name, y.token, w.name))
                    out.append(Wait(w.name, "yielding"))
                    yielders.append(y)
                else:
                    out += made
                continue
            out.append(Load(w.name, *where))
            room.add(*where, w.name, w.need_on(where[1]))
            free -= 1
        elif freeing > 0:
            freeing -= 1
            out.append(Wait(w.name, "slot_draining"))
        elif (
            v := next(
                (v for v in victims if not in_turn(v, snap) and v.name not in room.going), None
            )
        ) is not None:
            victims.remove(v)
            taken.add(v.name)
            room.release(v.name)
            out.append(Evict(v.name, v.token, "lru"))
            out.append(Wait(w.name, "evicting"))
        elif occupying and all(m.pinned for m in occupying):
            out.append(Reject(w.name, "slots_pinned"))
        elif victims:  # idle, but in its turn: its slot frees within turn_idle_s
            out.append(Wait(w.name, "in_turn"))
        elif (y := yielding_for.get(w.name)) is not None and not y.pinned:
            kept.add(y.name)
            out += _yielded(y, w, taken, room, "all_busy")
        elif not yielders and (y := _yield_candidate(snap, w, occupying, evicting)) is not None:
            out.append(Yield(y.name, y.token, w.name))
            out.append(Wait(w.name, "yielding"))
            yielders.append(y)
        else:
            out.append(Wait(w.name, "all_busy"))
    # A yield nobody waits for any more (its model got another slot, or left) is called off,
    # unless the yielding model goes anyway (idle: evicted above like any other).
    for y in yielding_for.values():
        if y.name not in kept and y.name not in taken:
            out.append(Resume(y.name, y.token))

    # Preload: a model kept warm takes a slot only when one is free once every real request
    # has been served — it never evicts, waits for a draining slot, or makes a model yield.
    # Evicted for a real request like any idle resident, it comes back when a slot frees.
    if preloading and (limit == -1 or free > 0):
        for m in sorted(snap.models.values(), key=lambda m: m.name):
            if not (
                m.preload
                and m.type == typ
                and m.pool == pool
                and m.registered
                and m.name not in waiting
                and m.explicit != "unload"
                and m.state in (ModelState.UNLOADED, ModelState.FAILED)
                and m.name not in backing_off
            ):
                continue
            if limit != -1 and free <= 0:
                break
            where = _place(snap, room, m)
            if where is None:
                continue  # no device has its bytes free: a preload never evicts
            out.append(Load(m.name, *where))
            room.add(*where, m.name, m.need_on(where[1]))
            free -= 1

    # Rule 4: a pool above its limit (the limit dropped) shrinks all the way, idle LRU first.
    if limit != -1:
        over = len(occupying) - freeing - limit
        victims = [v for v in victims if v.name not in room.going]
        while over > 0 and victims:
            v = victims.pop(0)
            room.release(v.name)
            out.append(Evict(v.name, v.token, "limit"))
            over -= 1
        if over > 0 and any(m.busy and not m.pinned for m in occupying):
            out.append(Blocked(typ, over))
    return out


def _yielded(y: ModelView, w: ModelView, taken: set[str], room: Room, busy: str) -> list[Action]:
    """``y`` yields to ``w``: it goes once nothing is in flight (its queued requests stay queued
    for its next turn); until then ``w`` waits. ``busy``: the wait when ``y`` was already taken
    for an older waiter in this pass."""
    if y.name in taken:
        return [Wait(w.name, busy)]
    if y.in_flight == 0:
        room.release(y.name)
        return [Evict(y.name, y.token, "yield"), Wait(w.name, "evicting")]
    return [Wait(w.name, "yielding")]


def _frees_room(m: ModelView, w: ModelView, room: Room, live: dict[str, ModelView]) -> bool:
    """Whether ``w`` fits on ``m``'s device once ``m`` and that device's idle residents leave."""
    where = (m.host or "", m.device or "")
    budget = room.budgets.get(where)
    if budget is None or m.name in room.going:
        return False
    idle = sum(
        v.bytes_held
        for v in lru_victims(live.values())
        if (v.host, v.device) == where and v.name not in room.going and v.name != m.name
    )
    free = budget - room.used(where) + room.freeing(where)
    return w.need_on(where[1]) <= free + m.bytes_held + idle


def _make_room(
    snap: Snapshot, room: Room, w: ModelView, live: dict[str, ModelView]
) -> list[Action]:
    """``w`` fits on no device as things stand: evict idle residents on the one device where the
    fewest of them make room for its bytes, least valuable first (``eviction_score``: idle
    longest per second of reload). A load is never started where it does not fit."""
    if not room.budgets:
        return [Wait(w.name, "no_worker")]
    if all(b is not None and w.need_on(d) > b for (_, d), b in room.budgets.items()):
        largest = max(b or 0 for b in room.budgets.values())
        need = max(dict(w.need_bytes).values(), default=0)
        return [Reject(w.name, "too_large", need=need, largest=largest)]
    plan = _room_plan(snap, room, w, live, turns=False)
    if plan is None and not any(
        b is not None and w.need_on(d) <= b - _pinned_bytes(room, live, (h, d))
        for (h, d), b in room.budgets.items()
    ):
        # Pinned residents hold the bytes it needs on every device: nothing will ever free them.
        return [Reject(w.name, "memory_pinned", need=max(dict(w.need_bytes).values(), default=0))]
    if plan is None:
        # Residents in their turn free their bytes within turn_idle_s: wait for that, not for a
        # busy -> idle edge.
        why = "in_turn" if _room_plan(snap, room, w, live, turns=True) else "no_room"
        return [Wait(w.name, why)]
    out: list[Action] = []
    for m in plan:
        room.release(m.name)
        out.append(Evict(m.name, m.token, "room"))
    out.append(Wait(w.name, "evicting" if plan else "room_draining"))
    return out


def _pinned_bytes(room: Room, live: dict[str, ModelView], where: Where) -> int:
    return sum(n for m, n in room.held.get(where, {}).items() if m in live and live[m].pinned)


def _room_plan(
    snap: Snapshot, room: Room, w: ModelView, live: dict[str, ModelView], *, turns: bool
) -> list[ModelView] | None:
    """The residents to evict so that ``w`` fits, on the device that needs the fewest (then the
    least valuable); [] when residents already leaving make the room; None when no device can.
    ``turns``: count residents in their turn as evictable too."""
    plans: list[tuple[int, float, Where, list[ModelView]]] = []
    for where, budget in sorted(room.budgets.items()):
        need = w.need_on(where[1])
        if budget is None or need > budget:
            continue
        short = need - (budget - room.used(where)) - room.freeing(where)
        chosen: list[ModelView] = []
        if short > 0:
            here = [
                m
                for m in lru_victims(live.values())
                if (m.host, m.device) == where
                and m.name not in room.going
                and (turns or not in_turn(m, snap))
            ]
            here.sort(key=lambda m: (-eviction_score(m, snap.now), m.name))
            for m in here:
                if short <= 0:
                    break
                chosen.append(m)
                short -= m.bytes_held
        if short <= 0:
            lost = sum(1.0 / max(eviction_score(m, snap.now), 1e-9) for m in chosen)
            plans.append((len(chosen), lost, where, chosen))
    if not plans:
        return None
    return min(plans, key=lambda p: (p[0], p[1], p[2]))[3]


def _gave_way(m: ModelView, waiting: dict[str, ModelView]) -> bool:
    """Whether ``m`` gave up its slot to a model that still waits, since before the yield."""
    w = waiting.get(m.yielding or "")
    return (
        not m.occupying
        and w is not None
        and w.demand_since is not None
        and m.yielding_since is not None
        and w.demand_since <= m.yielding_since
    )


def _yield_candidate(
    snap: Snapshot, w: ModelView, occupying: list[ModelView], evicting: set[str]
) -> ModelView | None:
    """The busy resident that should yield its slot to ``w``, or None: only once ``w``'s
    oldest request has waited ``max_busy_s``, and never a pinned model or one loaded less than
    ``min_resident_s`` ago (so two busy models take turns instead of thrashing). The one loaded
    longest ago goes first."""
    if (
        snap.max_busy_s <= 0
        or w.demand_since is None
        or snap.now - w.demand_since < snap.max_busy_s
    ):
        return None
    candidates = [
        m
        for m in occupying
        if m.state is ModelState.READY
        and m.busy
        and not m.pinned
        and not m.is_yielding
        and m.name not in evicting
        and m.loaded_at is not None
        and snap.now - m.loaded_at >= snap.min_resident_s
    ]
    return min(candidates, key=lambda m: (m.loaded_at or 0.0, m.name), default=None)


def eviction_score(m: ModelView, now: float) -> float:
    """Idle time per second of load time: a model that sat idle long and reloads fast is the
    cheapest to lose (Lemonade's rule)."""
    return max(now - m.last_used, 0.0) / max(m.load_seconds or 0.0, 0.01)


def _memory_backstop(
    snap: Snapshot, live: dict[str, ModelView], evicting: set[str]
) -> list[Action]:
    """Rule 5: on a device whose memory use is above the threshold, evict the idle, unpinned
    resident with the highest score — one per device per pass, and none while a model on that
    device is already on its way out (its memory is not given back yet)."""
    out: list[Action] = []
    for host, w in sorted(snap.workers.items()):
        if not w.alive:
            continue
        for device, used in sorted(w.memory.items()):
            if used <= snap.auto_evict_threshold:
                continue
            here = [m for m in live.values() if m.host == host and m.device == device]
            if any(m.state is ModelState.DRAINING or m.name in evicting for m in here):
                continue
            victims = lru_victims(here)
            if victims:
                v = max(victims, key=lambda m: (eviction_score(m, snap.now), m.name))
                out.append(Evict(v.name, v.token, "memory"))
    return out


@dataclass(frozen=True)
class Forget:
    """Keys nobody needs any more: hosts that are gone, hold no model any more and were last
    seen at or before ``seen_before`` (their worker record, command lists, last sighting and
    membership of the host set), and models deleted from the registry that hold no slot and
    have no work (their state hash, control list and failure window). ``seen_before`` None: a
    host goes whenever it was last seen (``forget_after_s`` = 0); its script re-checks it, so a
    host that beat again meanwhile is kept."""

    hosts: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    seen_before: float | None = None


def forgettable(snap: Snapshot, forget_after_s: float = 0.0) -> Forget:
    """What the pruning step may delete, judged from the snapshot; each deletion re-checks its
    condition in its own script (a host may come back, a model be registered again).

    A gone host (record expired) whose models were all reaped is listed as gone until it has
    been gone ``forget_after_s`` since its last heartbeat (``WorkerView.last_seen``), then
    forgotten; 0 forgets it at once. A host with no recorded sighting (registered by an agent
    that does not record one) has nothing to wait from and goes at once."""
    placed = {m.host for m in snap.models.values() if m.occupying and m.host is not None}
    seen_before = snap.now - forget_after_s if forget_after_s > 0 else None
    hosts = sorted(
        h
        for h, w in snap.workers.items()
        if not w.alive
        and h not in placed
        and (seen_before is None or w.last_seen is None or w.last_seen <= seen_before)
    )
    models = sorted(
        n
        for n, m in snap.models.items()
        if not m.registered and not m.occupying and not m.busy and m.explicit is None
    )
    return Forget(tuple(hosts), tuple(models), seen_before if hosts else None)
