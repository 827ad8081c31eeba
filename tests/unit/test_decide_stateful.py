"""DESIGN.md §4 under random event orders: a hypothesis state machine drives ``decide`` with a
simulated pool.

The simulation plays every other part of the box with the same rules the real parts follow:
requests arrive, queue, are served one at a time by a ready model and end; loads finish late (after
any number of other events, limit changes included) or fail; drains complete or are rescued by
work that arrived meanwhile; limits change (unlimited included), models are pinned and unpinned,
deleted and registered again, moved into and out of the routing-helper pool by policy changes,
loaded and unloaded explicitly; hosts die and come back; model processes die, or vanish while
their state stays (an agent that forgot a child before releasing it); loads fail often enough to
put a model in backoff; device memory passes the auto_evict threshold. After every coordinator
pass and every step it checks:

- no model with a request in flight is ever chosen as a victim, one with requests queued only when
  it yields its slot (they stay queued for its next load), and no pinned one for any reason but
  an admin unload;
- a model is made to yield only when a waiter waited ``max_busy_s`` for a slot that busy models
  hold, never when pinned, loaded less than ``min_resident_s`` ago or while another resident of
  its pool yields; a yielding model takes no new request, and the slot it gave up never goes
  back to it while the model it yielded to still waits and could take it (its bytes fit);
- a pass never admits a load into a full pool, never loads a model that already holds a slot,
  and never loads one model twice (single flight);
- every request that arrived is served, rejected with an answer, queued or in flight (none lost);
- a model is reaped for want of a process only when its agent's report lacks it, and never
  loaded while in backoff; a model in backoff has its waiting requests answered at once;
- once settled, no model is ``ready`` or ``draining`` without a process;
- once the traffic stops and the passes settle, every standard pool is within its effective limit
  unless every resident left above it is pinned.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from residency.pool.decide import (
    HELPER,
    STANDARD,
    Action,
    Backoff,
    Blocked,
    Evict,
    Load,
    ModelView,
    Reap,
    Reject,
    Resume,
    Snapshot,
    Wait,
    WorkerView,
    Yield,
    backoff_until,
    decide,
)
from residency.states import OCCUPYING
from residency.states import ModelState as S

TYPES = {"a": "llm", "b": "llm", "c": "llm", "d": "llm", "x": "embedding", "y": "embedding"}
NAMES = sorted(TYPES)
HOSTS = {"h1": ("cpu",), "h2": ("gpu0", "gpu1")}
# Memory: each model's bytes (MB) on any device, and the devices' budgets when they are on (a
# rule switches them): each model fits on every device alone, not every pair does.
SIZES = {"a": 400, "b": 300, "c": 500, "d": 200, "x": 100, "y": 150}
BUDGETS = {("h1", "cpu"): 600, ("h2", "gpu0"): 500, ("h2", "gpu1"): 550}
LOAD_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 30.0

names = st.sampled_from(NAMES)
hosts = st.sampled_from(sorted(HOSTS))
limits = st.sampled_from([-1, 1, 2, 3])


@dataclass
class Model:
    """One model as the rest of the box sees it (the registry, its state hash, its queue)."""

    name: str
    state: S = S.UNLOADED
    loads: int = 0  # bumps the token: a decision about an earlier load cannot touch this one
    pinned: bool = False
    registered: bool = True
    pool: str = STANDARD
    loaded_pool: str | None = None
    explicit: str | None = None
    queued: int = 0
    in_flight: int = 0
    demand_since: float | None = None
    last_used: float = 0.0
    host: str | None = None
    device: str | None = None
    loading_since: float | None = None
    load_seconds: float | None = None
    process: bool = False  # a model process of this load runs (its agent reports it)
    loaded_at: float | None = None
    draining_since: float | None = None
    failures: tuple[float, ...] = ()
    yielding: str | None = None  # kept after its unload until its next load, as in Redis
    yielding_since: float | None = None

    @property
    def token(self) -> str:
        return f"{self.name}-{self.loads}"

    @property
    def occupying(self) -> bool:
        return self.state in OCCUPYING

    def view(self) -> ModelView:
        return ModelView(
            name=self.name,
            type=TYPES[self.name],
            state=self.state,
            token=self.token,
            pinned=self.pinned,
            queued=self.queued,
            in_flight=self.in_flight,
            last_used=self.last_used,
            demand_since=self.demand_since,
            host=self.host,
            device=self.device,
            registered=self.registered,
            loading_since=self.loading_since,
            pool=self.pool,
            loaded_pool=self.loaded_pool,
            explicit=self.explicit,
            load_seconds=self.load_seconds,
            loaded_at=self.loaded_at,
            draining_since=self.draining_since,
            failures=self.failures,
            last_error="boom" if self.failures else None,
            yielding=self.yielding,
            yielding_since=self.yielding_since,
            held_bytes=SIZES[self.name] if self.occupying else None,
            need_bytes=tuple((k, SIZES[self.name]) for k in ("cpu", "gpu0", "gpu1")),
        )

    def free_slot(self) -> None:
        """The process is gone: its slot is free and its in-flight work goes back to the queue."""
        self.state = S.UNLOADED
        self.process = False
        self.draining_since = self.loaded_at = None
        self.host = self.device = self.loading_since = self.loaded_pool = None
        self.queued += self.in_flight
        self.in_flight = 0


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.models = {n: Model(n) for n in NAMES}
        self.alive = {h: True for h in HOSTS}
        self.memory: dict[tuple[str, str], float] = {}
        self.limits = {"llm": 3, "embedding": 2}
        self.auto_evict = False
        self.now = 1000.0
        self.arrived = self.served = self.rejected = 0
        self.max_busy_s, self.min_resident_s = 5.0, 1.0
        self.budgets: dict[tuple[str, str], int] = {}  # none: no byte limit

    # -- the coordinator ------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        workers = {
            h: WorkerView(
                h,
                devs,
                alive=self.alive[h],
                memory={d: self.memory.get((h, d), 0.3) for d in devs},
                children={
                    m.name: m.token for m in self.models.values() if m.process and m.host == h
                },
                children_at=self.now,
                budgets={d: self.budgets[(h, d)] for d in devs if (h, d) in self.budgets},
            )
            for h, devs in HOSTS.items()
        }
        return Snapshot(
            models={n: m.view() for n, m in self.models.items()},
            workers=workers,
            limits=dict(self.limits),
            now=self.now,
            load_timeout_s=LOAD_TIMEOUT_S,
            auto_evict=self.auto_evict,
            auto_evict_threshold=0.9,
            drain_timeout_s=DRAIN_TIMEOUT_S,
            max_busy_s=self.max_busy_s,
            min_resident_s=self.min_resident_s,
        )

    def coordinator_pass(self) -> list[Action]:
        snap = self.snapshot()
        actions = decide(snap)
        self.check(snap, actions)
        self.check_fairness(snap, actions)
        self.apply(actions)
        self.clear_stale_explicit()
        self.one_yield_per_pool()
        return actions

    def check(self, snap: Snapshot, actions: list[Action]) -> None:
        evicts = [a for a in actions if isinstance(a, Evict)]
        loads = [a for a in actions if isinstance(a, Load)]
        reaped = {a.model for a in actions if isinstance(a, Reap)}
        for a in evicts:
            m = snap.models[a.model]
            assert not m.in_flight, f"{a.model} chosen as a victim with work in flight ({a.reason})"
            assert not m.queued or (a.reason == "yield" and m.is_yielding), (
                f"{a.model} chosen as a victim with requests queued ({a.reason})"
            )
            assert m.state is S.READY, f"{a.model} evicted while {m.state}"
            assert a.token == m.token
            if a.reason == "admin":
                assert m.explicit == "unload"
            else:
                assert not m.pinned, f"pinned model {a.model} chosen as a victim ({a.reason})"
            if a.reason == "deleted":
                assert not m.registered
        assert len({a.model for a in evicts}) == len(evicts), "one model evicted twice"
        # Single flight: a model is loaded once, only when it holds no slot, only where it can run.
        assert len({a.model for a in loads}) == len(loads), "one model loaded twice in a pass"
        for a in loads:
            m = snap.models[a.model]
            assert not m.occupying, f"{a.model} loaded while {m.state}"
            assert m.registered and m.wants_load and m.explicit != "unload"
            assert snap.workers[a.host].alive and a.device in snap.workers[a.host].devices
            assert a.model not in {e.model for e in evicts}
            assert backoff_until(m, snap) is None, f"{a.model} loaded while in backoff"
        for a in actions:
            if isinstance(a, Backoff):
                m = snap.models[a.model]
                assert not m.occupying and m.registered and m.wants_load
                assert backoff_until(m, snap) == a.until > snap.now
        # Admission never overfills a pool: loads go only into free slots.
        admitted = Counter((snap.models[a.model].type, snap.models[a.model].pool) for a in loads)
        for (typ, pool), n in admitted.items():
            limit = snap.limits[typ] if pool == STANDARD else -1
            if limit == -1:
                continue
            held = sum(
                1
                for m in snap.models.values()
                if m.type == typ and m.occupying and m.slot_pool == pool and m.name not in reaped
            )
            assert held + n <= limit, f"{n} load(s) into a full {typ} pool ({held}/{limit})"
        # Rule 4: one pass shrinks a pool all the way; no idle, unpinned resident is left over.
        evicted = {a.model for a in evicts}
        # Residents evicted by bytes, and the waiter each makes room for (the Wait after them).
        room_for: dict[str, str] = {}
        making: list[str] = []
        for a in actions:
            if isinstance(a, Evict) and a.reason == "room":
                making.append(a.model)
            elif isinstance(a, Wait) and making:
                room_for.update(dict.fromkeys(making, a.model))
                making = []
        assert not making, f"room made for nobody: {making}"
        for typ, limit in snap.limits.items():
            held = [
                m
                for m in snap.models.values()
                if m.type == typ
                and m.occupying
                and m.slot_pool == STANDARD
                and m.name not in reaped
                and m.state is not S.DRAINING
                and m.name not in evicted
            ]
            spare = [m for m in held if m.state is S.READY and not m.busy and not m.pinned]
            assert limit == -1 or len(held) <= limit or not spare, (
                f"{typ} pool left at {len(held)} > {limit} with idle victims {spare}"
            )
            # ...and not below it: slots already draining count as freed.
            shrunk = [a for a in evicts if a.reason == "limit" and snap.models[a.model].type == typ]
            coming = [
                a
                for a in actions
                if isinstance(a, Wait)
                and a.reason in ("evicting", "slot_draining")
                and snap.models[a.model].type == typ
                and snap.models[a.model].pool == STANDARD
            ]
            # A resident evicted by bytes for a waiter of another pool on its device (reason
            # "room": the ledger is per device, not per pool) left for that waiter, not for the
            # shrink: it does not count as shrunk.
            lent = [
                v
                for v, w in room_for.items()
                if snap.models[v].type == typ
                and snap.models[v].slot_pool == STANDARD
                and (snap.models[w].type, snap.models[w].pool) != (typ, STANDARD)
            ]
            assert not shrunk or len(held) + len(lent) + len(coming) >= limit, (
                f"{typ} pool shrunk below {limit}: {shrunk}"
            )
        # The ledger: a device within its budget stays within it (loads planned only where their
        # bytes fit beside everything held, residents on their way out included).
        for (h, d), budget in self.budgets.items():
            held_bytes = sum(
                SIZES[m.name]
                for m in snap.models.values()
                if m.occupying and (m.host, m.device) == (h, d) and m.name not in reaped
            )
            planned = sum(SIZES[a.model] for a in loads if (a.host, a.device) == (h, d))
            assert held_bytes > budget or held_bytes + planned <= budget, (
                f"loads past the budget of {h}/{d}: {held_bytes} + {planned} > {budget}"
            )
        for a in actions:
            if isinstance(a, Reject) and a.code == "memory_pinned":
                m = snap.models[a.model]
                assert self.budgets, "memory_pinned without budgets"
                for (h, d), budget in self.budgets.items():
                    pinned = sum(
                        SIZES[v.name]
                        for v in snap.models.values()
                        if v.occupying and v.pinned and (v.host, v.device) == (h, d)
                    )
                    assert not self.alive[h] or SIZES[m.name] > budget - pinned
            elif isinstance(a, Reject):
                m = snap.models[a.model]
                held = [
                    v
                    for v in snap.models.values()
                    if v.type == m.type
                    and v.occupying
                    and v.slot_pool == m.pool
                    and v.name not in reaped
                ]
                assert held and all(v.pinned for v in held), "rejected while a slot could free"
            if isinstance(a, Reap):
                m = snap.models[a.model]
                assert m.occupying
                if a.reason == "host_gone":
                    assert not self.alive[m.host or ""]
                elif a.reason == "load_timeout":
                    assert m.state is S.LOADING
                    assert self.now - (m.loading_since or 0) > LOAD_TIMEOUT_S
                else:
                    assert a.reason in ("no_process", "drain_timeout"), a.reason
                    assert m.state in (S.READY, S.DRAINING)
                    assert not self.models[a.model].process, f"{a.model} reaped with a process"

    def check_fairness(self, snap: Snapshot, actions: list[Action]) -> None:
        yields = [a for a in actions if isinstance(a, Yield)]
        pools = Counter((snap.models[y.model].type, snap.models[y.model].slot_pool) for y in yields)
        assert all(n == 1 for n in pools.values()), f"several yields in one pool: {yields}"
        loads = {a.model for a in actions if isinstance(a, Load)}
        # A yielding model reaped in this pass (its host gone) holds no slot any more: another
        # resident may yield to a waiter in the same pass.
        reaped = {a.model for a in actions if isinstance(a, Reap)}
        for y in yields:
            m, w = snap.models[y.model], snap.models[y.for_model]
            assert m.state is S.READY and m.busy and not m.pinned and not m.is_yielding, m
            assert m.loaded_at is not None and snap.now - m.loaded_at >= snap.min_resident_s
            assert snap.max_busy_s > 0 and w.demand_since is not None
            assert snap.now - w.demand_since >= snap.max_busy_s, f"{w.name} did not wait long"
            assert (w.type, w.pool) == (m.type, m.slot_pool) and not w.occupying
            assert not any(
                v.is_yielding
                and v.slot_pool == m.slot_pool
                and v.type == m.type
                and not v.pinned
                and v.name not in reaped
                for v in snap.models.values()
            ), f"{y.model} made to yield while another model of its pool yields"
        for a in actions:
            if isinstance(a, Evict) and a.reason == "yield":
                assert snap.models[a.model].is_yielding and not snap.models[a.model].pinned
            if isinstance(a, Resume):
                assert snap.models[a.model].is_yielding
                assert not any(isinstance(e, Evict) and e.model == a.model for e in actions)
        # The slot a model gave up never goes straight back to it while its waiter still waits.
        for name in loads:
            m = snap.models[name]
            waiter = snap.models.get(m.yielding or "")
            if (
                waiter is None
                or m.yielding_since is None
                or waiter.demand_since is None
                or waiter.demand_since > m.yielding_since
                or waiter.occupying
                or not waiter.registered
                or waiter.explicit == "unload"
                or (waiter.type, waiter.pool) != (m.type, m.pool)
                or backoff_until(waiter, snap) is not None
                # The waiter keeps its place first in line, but a free slot it cannot take (its
                # bytes fit on no live device beside what is held and what was planned before
                # it) goes to the next model, the one that gave way included: a load never
                # starts where it does not fit, and the waiter's turn comes by room made or a
                # yield, which frees a slot of its pool as well as the bytes.
                or self.fits_nowhere(snap, waiter, actions)
            ):
                continue
            assert waiter.name in loads, f"{name} took back the slot it gave to {waiter.name}"

    @staticmethod
    def fits_nowhere(snap: Snapshot, w: ModelView, actions: list[Action]) -> bool:
        """Whether ``w``'s bytes fit on no live device when its turn in the pass came: beside
        what the devices hold and the loads planned before it (those of pools decided earlier,
        and of its own pool's older demand)."""
        order = [(pool, typ) for pool in (STANDARD, HELPER) for typ in sorted(set(TYPES.values()))]
        mine = order.index((w.pool, w.type))

        def before(v: ModelView) -> bool:
            at = order.index((v.pool, v.type))
            return at < mine or (
                at == mine
                and v.demand_since is not None
                and w.demand_since is not None
                and v.demand_since <= w.demand_since
                and not v.yielding
            )

        for h, worker in snap.workers.items():
            if not worker.alive:
                continue
            for d in worker.devices:
                budget = worker.budgets.get(d)
                if budget is None:
                    return False
                used = sum(
                    v.bytes_held
                    for v in snap.models.values()
                    if v.occupying and (v.host, v.device) == (h, d)
                ) + sum(
                    SIZES[a.model]
                    for a in actions
                    if isinstance(a, Load)
                    and (a.host, a.device) == (h, d)
                    and before(snap.models[a.model])
                )
                if w.need_on(d) <= budget - used:
                    return False
        return True

    def one_yield_per_pool(self) -> None:
        yielding = Counter(
            (TYPES[m.name], m.loaded_pool)
            for m in self.models.values()
            if m.occupying and m.yielding and not (m.state is S.READY and m.pinned)
        )
        assert all(n <= 1 for n in yielding.values()), f"several models yield: {self.models}"

    def apply(self, actions: list[Action]) -> None:
        """What Effects does, each write a compare-and-set on the model's state and token."""
        for a in actions:
            m = self.models[a.model] if not isinstance(a, Blocked) else None
            if isinstance(a, Reap) and m and m.token == a.token and m.occupying:
                m.free_slot()
                if m.queued and m.demand_since is None:
                    m.demand_since = self.now
            elif isinstance(a, Evict) and m and m.token == a.token and m.state is S.READY:
                m.state, m.draining_since = S.DRAINING, self.now
            elif isinstance(a, Yield) and m and m.token == a.token and m.state is S.READY:
                m.yielding, m.yielding_since = a.for_model, self.now
            elif isinstance(a, Resume) and m and m.token == a.token:
                m.yielding = m.yielding_since = None
            elif isinstance(a, Load) and m and m.state in (S.UNLOADED, S.FAILED):
                m.state, m.host, m.device = S.LOADING, a.host, a.device
                m.yielding = m.yielding_since = None  # a model loaded again starts not yielding
                m.process = True  # the agent spawns it (and reports it) at once
                m.loads += 1
                m.loading_since, m.loaded_pool = self.now, m.pool
                if m.explicit == "load":
                    m.explicit = None
            elif isinstance(a, Reject | Backoff) and m:
                self.rejected += m.queued
                m.queued, m.demand_since = 0, None
                if isinstance(a, Backoff):
                    m.explicit = None

    def clear_stale_explicit(self) -> None:
        for m in self.models.values():
            if (m.explicit == "load" and m.occupying) or (
                m.explicit == "unload" and not m.occupying
            ):
                m.explicit = None

    # -- rules: the world around the coordinator ------------------------------------------------

    @initialize(warm=st.lists(names, max_size=5))
    def some_models_are_already_in_use(self, warm: list[str]) -> None:
        for name in warm:
            self.a_request_is_served_end_to_end(name)

    @rule()
    def run_a_pass(self) -> None:
        self.coordinator_pass()

    @rule(fairness=st.sampled_from([(0.0, 0.0), (1.0, 0.0), (5.0, 1.0), (30.0, 10.0)]))
    def the_fairness_settings_change(self, fairness: tuple[float, float]) -> None:
        self.max_busy_s, self.min_resident_s = fairness

    @rule(dt=st.sampled_from([0.1, 1.0, 5.0, 90.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(name=names, n=st.integers(1, 3))
    def requests_arrive(self, name: str, n: int) -> None:
        m = self.models[name]
        if not m.registered:
            return  # answered 404 at the door: never queued
        self.arrived += n
        m.queued += n
        if m.demand_since is None:
            m.demand_since = self.now

    @rule(name=names)
    def a_request_is_served_end_to_end(self, name: str) -> None:
        """The common case in one step (so pools fill up often): a request arrives, a pass runs,
        the load (if one started) finishes, and the request is served."""
        self.requests_arrive(name, 1)
        self.coordinator_pass()
        self.a_load_finishes(name, True)
        m = self.models[name]
        while m.state is S.READY and m.queued and not m.yielding:
            queued = m.queued
            self.a_request_starts(name)
            if m.queued == queued:
                break  # it cannot start one (its process is gone): a later rule moves it on
            self.a_request_ends(name)
        self.now += 1.0

    @rule(typ=st.sampled_from(["llm", "embedding"]), pick=st.integers(0, 3))
    def clients_keep_the_residents_busy_while_another_model_waits(
        self, typ: str, pick: int
    ) -> None:
        """Back-to-back requests hold every resident of a pool busy, sized to what it holds,
        while requests for another model wait (where yielding happens); time passes."""
        held = [m for m in self.models.values() if TYPES[m.name] == typ and m.occupying]
        self.limits[typ] = max(1, len(held))
        for m in self.models.values():
            if TYPES[m.name] == typ and m.state is S.READY:
                self.requests_arrive(m.name, 2)
                self.a_request_starts(m.name)
        same = [n for n in NAMES if TYPES[n] == typ]
        waiter = same[pick % len(same)]
        if not self.models[waiter].occupying:
            self.requests_arrive(waiter, 1)
        self.coordinator_pass()
        self.now += self.max_busy_s

    @rule(name=names)
    def a_request_starts(self, name: str) -> None:
        m = self.models[name]
        if m.state is S.READY and m.process and m.queued and not m.in_flight and not m.yielding:
            m.queued -= 1
            m.in_flight = 1
            m.demand_since = self.now if m.queued else None

    @rule(name=names)
    def a_request_ends(self, name: str) -> None:
        m = self.models[name]
        if m.in_flight:
            m.in_flight -= 1
            self.served += 1
            m.last_used = self.now

    @rule(name=names, ok=st.booleans())
    def a_load_finishes(self, name: str, ok: bool) -> None:
        m = self.models[name]
        if m.state is not S.LOADING:
            return
        if ok:
            m.state = S.READY
            m.load_seconds = self.now - (m.loading_since or self.now)
            m.last_used, m.loading_since, m.loaded_at = self.now, None, self.now
        else:
            m.state, m.process = S.FAILED, False
            m.failures = (*m.failures, self.now)
            m.host = m.device = m.loading_since = m.loaded_pool = None
            self.rejected += m.queued  # answered model_load_failed
            m.queued, m.demand_since = 0, None

    @rule(name=names)
    def a_drain_completes(self, name: str) -> None:
        m = self.models[name]
        if m.state is not S.DRAINING:
            return
        if not m.process:
            return  # nobody left to commit the unload: only the reaper frees the slot
        if m.in_flight or (m.queued and not m.yielding):
            # Rescued: work arrived while it drained (a yielding model's queue waits its turn).
            m.state, m.draining_since = S.READY, None
        else:
            m.free_slot()

    @rule(name=names)
    def a_model_process_dies(self, name: str) -> None:
        m = self.models[name]
        if m.state in (S.READY, S.DRAINING):
            m.free_slot()
            if m.queued and m.demand_since is None:
                m.demand_since = self.now

    @rule(name=names)
    def an_agent_loses_a_process_but_not_its_state(self, name: str) -> None:
        """The process is gone and the agent forgot it, but the state was never released (a
        Redis error in between): the model stays ready or draining with nothing behind it."""
        m = self.models[name]
        if m.state in (S.READY, S.DRAINING):
            m.process = False

    @rule(host=hosts, alive=st.booleans())
    def a_host_goes_or_comes_back(self, host: str, alive: bool) -> None:
        self.alive[host] = alive

    @rule(typ=st.sampled_from(["llm", "embedding"]), limit=limits)
    def the_limit_changes(self, typ: str, limit: int) -> None:
        self.limits[typ] = limit

    @rule(typ=st.sampled_from(["llm", "embedding"]), by=st.integers(1, 3))
    def the_limit_drops_below_the_pool(self, typ: str, by: int) -> None:
        """An admin takes memory back: the limit falls below what is resident now."""
        held = sum(
            1
            for m in self.models.values()
            if TYPES[m.name] == typ and m.occupying and (m.loaded_pool or m.pool) == STANDARD
        )
        self.limits[typ] = max(1, held - by)

    @rule(name=names, pinned=st.booleans())
    def pin_or_unpin(self, name: str, pinned: bool) -> None:
        if self.models[name].registered:
            self.models[name].pinned = pinned

    @rule(name=names, what=st.sampled_from(["load", "unload", None]))
    def explicit_load_or_unload(self, name: str, what: str | None) -> None:
        m = self.models[name]
        if m.registered:
            m.explicit = what
            if what == "load":
                m.failures = ()  # the admin API clears the backoff with the wish

    @rule(name=names, helper=st.booleans())
    def a_policy_changes(self, name: str, helper: bool) -> None:
        """A policy starts or stops using the model as its routing helper."""
        if TYPES[name] == "llm":
            self.models[name].pool = HELPER if helper else STANDARD

    @rule(name=names)
    def the_model_is_deleted(self, name: str) -> None:
        m = self.models[name]
        if not m.registered:
            return
        m.registered, m.pinned, m.explicit = False, False, None
        self.rejected += m.queued  # queued requests are answered model_not_found
        m.queued, m.demand_since = 0, None

    @rule(name=names)
    def the_model_is_registered_again(self, name: str) -> None:
        self.models[name].registered = True

    @rule(on=st.booleans())
    def memory_budgets_switch(self, on: bool) -> None:
        self.budgets = dict(BUDGETS) if on else {}

    @rule(host=hosts, used=st.sampled_from([0.3, 0.95]), on=st.booleans())
    def memory_pressure(self, host: str, used: float, on: bool) -> None:
        self.memory[(host, HOSTS[host][0])] = used
        self.auto_evict = on

    @precondition(lambda self: any(m.occupying or m.queued for m in self.models.values()))
    @rule()
    def traffic_stops_and_the_pool_settles(self) -> None:
        """Hosts come back, every request is served or answered, loads and drains finish, and
        passes run until they have nothing left to do: the pool must then be within its limits."""
        self.alive = {h: True for h in HOSTS}
        for _ in range(60):
            for m in self.models.values():
                if m.state is S.LOADING:
                    m.state, m.last_used = S.READY, self.now
                    m.load_seconds, m.loading_since, m.loaded_at = 1.0, None, self.now
                if not m.registered and m.queued:
                    # Handed back to the queue of a model deleted meanwhile: nothing loads it
                    # again, its clients' requests time out (503, withdrawn).
                    self.rejected += m.queued
                    m.queued, m.demand_since = 0, None
                while m.state is S.READY and m.process and (m.queued or m.in_flight):
                    if not m.in_flight and m.yielding:
                        break  # it takes nothing new: its queue waits for its next load
                    if not m.in_flight:
                        m.queued -= 1
                        m.in_flight = 1
                    m.in_flight = 0
                    self.served += 1
                    m.last_used = self.now
                m.demand_since = self.now if m.queued else None
                if m.state is S.DRAINING and m.process:
                    m.free_slot()
            self.now += 1.0
            actions = self.coordinator_pass()
            moving = [a for a in actions if isinstance(a, Load | Evict | Reap)]
            if not moving and not any(m.queued or m.in_flight for m in self.models.values()):
                break
        else:
            raise AssertionError(f"the pool never settled: {self.models}")
        snap = self.snapshot()
        assert not any(isinstance(a, Blocked) for a in decide(snap)), "blocked with nothing busy"
        for typ, limit in self.limits.items():
            held = [
                m
                for m in snap.models.values()
                if m.type == typ and m.occupying and m.slot_pool == STANDARD
            ]
            if limit != -1 and len(held) > limit:
                assert all(m.pinned for m in held), (
                    f"{typ} pool settled at {len(held)} > {limit} with unpinned residents"
                )
        for m in snap.models.values():
            assert not (m.occupying and not m.registered and not m.pinned), f"{m.name} deleted"
            # A pinned one stays: no pinned model is a victim for any reason but an admin unload.
            assert not (
                m.occupying and m.slot_pool == HELPER and m.pool != HELPER and not m.pinned
            ), f"unused helper {m.name} kept"
            assert not (m.state in (S.READY, S.DRAINING) and not self.models[m.name].process), (
                f"{m.name} left {m.state} without a process"
            )

    # -- invariants after every step ------------------------------------------------------------

    @invariant()
    def no_request_is_lost(self) -> None:
        queued = sum(m.queued for m in self.models.values())
        in_flight = sum(m.in_flight for m in self.models.values())
        assert self.arrived == self.served + self.rejected + queued + in_flight

    @invariant()
    def only_a_ready_model_serves_and_a_slot_has_a_place(self) -> None:
        for m in self.models.values():
            assert m.in_flight <= 1
            assert not m.in_flight or m.state is S.READY
            assert not m.process or m.occupying, f"{m.name} has a process but no slot"
            assert (m.host is not None) == m.occupying, replace(m)


# Derandomized: CI runs the same examples every time, so a failure here is a finding (a rule of
# the decision or of this simulation broken), never noise; explore new seeds locally with a
# copy at more examples and derandomize off.
PoolMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    derandomize=True,
)
TestPool = PoolMachine.TestCase
