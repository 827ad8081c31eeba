"""The pure admission and eviction rules (DESIGN.md §4 rules 1, 2 and 4)."""

from __future__ import annotations

from dataclasses import replace

from residency.pool.decide import (
    Backoff,
    Evict,
    Forget,
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
    effective_limit,
    forgettable,
    lru_victims,
)
from residency.states import ModelState as S

W = {"box1": WorkerView("box1", ("cpu",))}


def mv(name: str, state: S = S.UNLOADED, **kw: object) -> ModelView:
    base: dict[str, object] = {"type": "llm", "token": f"t-{name}", "host": None, "device": None}
    if state in (S.LOADING, S.READY, S.DRAINING):
        base.update(host="box1", device="cpu")
    base.update(kw)
    return ModelView(name=name, state=state, **base)  # type: ignore[arg-type]


def snap(*models: ModelView, limit: int = 1, emb_limit: int = 1, **kw: object) -> Snapshot:
    return Snapshot(
        models={m.name: m for m in models},
        workers=kw.pop("workers", W),  # type: ignore[arg-type]
        limits={"llm": limit, "embedding": emb_limit},
        now=kw.pop("now", 1000.0),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def of(kind: type, actions: list) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


def test_load_when_pool_has_room() -> None:
    acts = decide(snap(mv("a", queued=1, demand_since=1.0)))
    assert acts == [Load("a", "box1", "cpu")]


def test_full_pool_evicts_lru_idle_unpinned() -> None:
    acts = decide(
        snap(
            mv("a", S.READY, last_used=50.0),
            mv("b", S.READY, last_used=10.0, pinned=True),
            mv("c", queued=1),
            limit=2,
        )
    )
    assert of(Evict, acts) == [Evict("a", "t-a", "lru")]
    assert of(Load, acts) == []
    assert Wait("c", "evicting") in acts


def test_lru_order_oldest_first() -> None:
    ms = [mv("x", S.READY, last_used=30.0), mv("y", S.READY, last_used=10.0)]
    assert [m.name for m in lru_victims(ms)] == ["y", "x"]


def test_busy_resident_is_never_a_victim() -> None:
    acts = decide(snap(mv("a", S.READY, in_flight=1), mv("b", queued=1)))
    assert of(Evict, acts) == []
    assert acts == [Wait("b", "all_busy")]


def test_queued_request_makes_a_resident_busy() -> None:
    acts = decide(snap(mv("a", S.READY, queued=2), mv("b", queued=1)))
    assert of(Evict, acts) == []


def test_all_pinned_rejects_with_slots_pinned() -> None:
    acts = decide(snap(mv("a", S.READY, pinned=True), mv("b", queued=1)))
    assert acts == [Reject("b", "slots_pinned")]


def test_pinned_and_busy_waits_instead_of_rejecting() -> None:
    acts = decide(
        snap(
            mv("a", S.READY, pinned=True), mv("b", S.READY, in_flight=1), mv("c", queued=1), limit=2
        )
    )
    assert acts == [Wait("c", "all_busy")]


def test_loading_model_is_not_loaded_twice() -> None:
    acts = decide(snap(mv("a", S.LOADING, queued=3, loading_since=999.0)))
    assert of(Load, acts) == []


def test_draining_slot_is_waited_for_not_doubled() -> None:
    acts = decide(snap(mv("a", S.DRAINING), mv("b", S.READY, last_used=1.0), mv("c", queued=1)))
    # the pool (limit 1) is over by one and a slot is already on its way out: b is evicted to
    # converge, c waits for the draining slot rather than evicting a second model for itself.
    assert Wait("c", "slot_draining") in acts
    assert of(Evict, acts) == [Evict("b", "t-b", "limit")]


def test_pools_are_per_type() -> None:
    acts = decide(snap(mv("chat", S.READY), mv("emb", type="embedding", queued=1)))
    assert of(Load, acts) == [Load("emb", "box1", "cpu")]
    assert of(Evict, acts) == []


def test_unlimited_pool_never_evicts() -> None:
    acts = decide(snap(mv("a", S.READY), mv("b", S.READY), mv("c", queued=1), limit=-1))
    assert of(Load, acts) == [Load("c", "box1", "cpu")]
    assert of(Evict, acts) == []


def test_limit_drop_shrinks_all_the_way_lru_first() -> None:
    acts = decide(
        snap(
            mv("a", S.READY, last_used=3.0),
            mv("b", S.READY, last_used=1.0),
            mv("c", S.READY, last_used=2.0),
        )
    )
    assert of(Evict, acts) == [Evict("b", "t-b", "limit"), Evict("c", "t-c", "limit")]


def test_demand_is_served_oldest_first() -> None:
    acts = decide(
        snap(mv("late", queued=1, demand_since=20.0), mv("early", queued=1, demand_since=5.0))
    )
    assert of(Load, acts) == [Load("early", "box1", "cpu")]


def test_no_worker_means_wait() -> None:
    acts = decide(snap(mv("a", queued=1), workers={}))
    assert acts == [Wait("a", "no_worker")]


def test_dead_host_is_reaped() -> None:
    dead = {"box1": WorkerView("box1", ("cpu",), alive=False)}
    acts = decide(snap(mv("a", S.READY), workers=dead))
    assert acts == [Reap("a", "t-a", "host_gone")]


def test_stuck_load_is_reaped_after_timeout() -> None:
    acts = decide(snap(mv("a", S.LOADING, loading_since=100.0), load_timeout_s=600.0))
    assert acts == [Reap("a", "t-a", "load_timeout")]


def reporting(children: dict[str, str], at: float) -> dict[str, WorkerView]:
    return {"box1": WorkerView("box1", ("cpu",), children=children, children_at=at)}


def test_ready_model_whose_agent_reports_no_process_is_reaped() -> None:
    """The agent forgot the process before releasing its state: the report, read after the
    load committed, lacks this load's token."""
    acts = decide(snap(mv("a", S.READY, loaded_at=500.0), workers=reporting({}, 510.0)))
    assert acts == [Reap("a", "t-a", "no_process")]
    # A process of another (older) load of the same model does not back this one either.
    old = reporting({"a": "t-older"}, 510.0)
    assert decide(snap(mv("a", S.READY, loaded_at=500.0), workers=old)) == [
        Reap("a", "t-a", "no_process")
    ]
    draining = mv("a", S.DRAINING, loaded_at=500.0, draining_since=990.0)
    assert decide(snap(draining, workers=reporting({}, 995.0))) == [Reap("a", "t-a", "no_process")]


def test_a_report_read_before_the_commit_or_showing_the_process_reaps_nothing() -> None:
    early = reporting({}, 499.0)  # read before the process committed: it proves nothing
    assert decide(snap(mv("a", S.READY, loaded_at=500.0), workers=early)) == []
    backed = reporting({"a": "t-a"}, 510.0)
    assert decide(snap(mv("a", S.READY, loaded_at=500.0), workers=backed)) == []
    # An agent that does not report its children is never taken at its silence.
    assert decide(snap(mv("a", S.READY, loaded_at=500.0))) == []
    # Loading models are left to the load timeout (the agent may not have taken the command).
    loading = mv("a", S.LOADING, loading_since=990.0)
    assert decide(snap(loading, workers=reporting({}, 995.0))) == []


def test_draining_too_long_without_a_reported_process_is_reaped() -> None:
    stuck = mv("a", S.DRAINING, draining_since=1000.0 - 61.0)
    assert decide(snap(stuck, drain_timeout_s=60.0)) == [Reap("a", "t-a", "drain_timeout")]
    recent = mv("a", S.DRAINING, draining_since=1000.0 - 59.0)
    assert decide(snap(recent, drain_timeout_s=60.0)) == []
    # Its process is still there (slow to exit): the agent, not the reaper, deals with it.
    backed = reporting({"a": "t-a"}, 990.0)
    assert decide(snap(stuck, drain_timeout_s=60.0, workers=backed)) == []


def test_three_failures_in_the_window_fail_fast_until_the_oldest_leaves_it() -> None:
    fails = (200.0, 400.0, 700.0)
    m = mv("x", S.FAILED, queued=2, failures=fails, last_error="bad magic")
    s = snap(m, failure_limit=3, failure_window_s=900.0)
    assert backoff_until(m, s) == 200.0 + 900.0
    assert decide(s) == [Backoff("x", 1100.0, 3, "bad magic")]
    # Once the oldest failure leaves the window the model may load again.
    later = snap(m, failure_limit=3, failure_window_s=900.0, now=1100.0)
    assert backoff_until(m, later) is None
    assert decide(later) == [Load("x", "box1", "cpu")]
    # Two failures are not a loop yet; nor are three spread over more than the window.
    two = mv("x", S.FAILED, queued=1, failures=(400.0, 700.0))
    assert decide(snap(two, failure_limit=3, failure_window_s=900.0)) == [Load("x", "box1", "cpu")]


def test_backoff_until_counts_from_the_limit_th_newest_failure() -> None:
    m = mv("x", failures=(200.0, 300.0, 600.0, 700.0), queued=1)
    # Four in the window: the count drops below three once two have left, i.e. when 300 does.
    assert backoff_until(m, snap(m, failure_limit=3, failure_window_s=900.0)) == 300.0 + 900.0


def test_a_model_in_backoff_takes_no_slot_and_evicts_nothing() -> None:
    acts = decide(
        snap(
            mv("x", S.FAILED, queued=1, failures=(800.0, 900.0, 950.0), last_error="boom"),
            mv("y", S.READY, last_used=1.0),
            mv("z", queued=1, demand_since=5.0),
            limit=2,
        )
    )
    assert of(Load, acts) == [Load("z", "box1", "cpu")]
    assert of(Evict, acts) == []
    assert of(Backoff, acts) == [Backoff("x", 1700.0, 3, "boom")]
    # Without waiting requests there is nothing to answer.
    idle = mv("x", S.FAILED, failures=(800.0, 900.0, 950.0))
    assert decide(snap(idle)) == []


def test_forgettable_hosts_and_models() -> None:
    workers = {
        "gone": WorkerView("gone", (), alive=False),
        "gone-busy": WorkerView("gone-busy", (), alive=False),
        "box1": WorkerView("box1", ("cpu",)),
    }
    s = snap(
        mv("held", S.READY, host="gone-busy", device="cpu"),
        mv("deleted", S.UNLOADED, registered=False),
        mv("deleted-failed", S.FAILED, registered=False),
        mv("deleted-queued", S.UNLOADED, registered=False, queued=1),
        mv("deleted-resident", S.READY, registered=False),
        mv("kept", S.UNLOADED),
        workers=workers,
    )
    assert forgettable(s) == Forget(("gone",), ("deleted", "deleted-failed"))


def test_deleted_model_is_evicted_when_idle() -> None:
    acts = decide(snap(mv("gone", S.READY, registered=False)))
    assert acts == [Evict("gone", "t-gone", "deleted")]


def test_placement_spreads_over_devices() -> None:
    two = {"box1": WorkerView("box1", ("cuda:0", "cuda:1"))}
    acts = decide(
        snap(
            mv("a", queued=1, demand_since=1.0),
            mv("b", queued=1, demand_since=2.0),
            limit=2,
            workers=two,
        )
    )
    assert of(Load, acts) == [Load("a", "box1", "cuda:0"), Load("b", "box1", "cuda:1")]


def test_explicit_load_and_unload() -> None:
    acts = decide(snap(mv("a", explicit="load")))
    assert of(Load, acts) == [Load("a", "box1", "cpu")]
    acts = decide(snap(mv("a", S.READY, explicit="unload", pinned=True)))
    assert acts == [Evict("a", "t-a", "admin")]


def test_effective_limit() -> None:
    assert effective_limit(1, True, 3) == 3
    assert effective_limit(1, False, 3) == 1
    assert effective_limit(-1, True, 3) == -1
    assert effective_limit(4, True, 3) == 4


def test_idle_events_are_wanted_only_while_something_waits_for_one() -> None:
    from residency.pool.decide import Blocked, waits_for_idle

    s = snap(mv("a", S.READY, in_flight=1), mv("b", queued=1))
    assert waits_for_idle(decide(s), s)
    s = snap(mv("a", S.READY, last_used=1.0), mv("b", queued=1))
    assert not waits_for_idle(decide(s), s)
    # over the limit with the only other resident busy: the shrink waits for it
    s = snap(mv("a", S.READY, in_flight=1), mv("b", S.READY, in_flight=1))
    acts = decide(s)
    assert Blocked("llm", 1) in acts and waits_for_idle(acts, s)
    # over the limit because of pins: idle events would not help
    s = snap(mv("a", S.READY, pinned=True), mv("b", S.READY, pinned=True))
    assert not waits_for_idle(decide(s), s)


def test_memory_backstop_evicts_the_best_scored_idle_unpinned_model() -> None:
    from residency.pool.decide import eviction_score

    hot = {"box1": WorkerView("box1", ("cpu",), memory={"cpu": 0.95})}
    ms = [
        # idle 900 s, reloads in 1 s -> score 900: evicted first
        mv("cheap", S.READY, last_used=100.0, load_seconds=1.0),
        # idle 990 s but reloads in 10 s -> 99
        mv("slow", S.READY, last_used=10.0, load_seconds=10.0),
        mv("busy", S.READY, last_used=0.0, load_seconds=0.1, in_flight=1),
        mv("pinned", S.READY, last_used=0.0, load_seconds=0.1, pinned=True),
    ]
    s = snap(*ms, limit=-1, workers=hot, auto_evict=True, auto_evict_threshold=0.9)
    assert eviction_score(ms[0], 1000.0) == 900.0
    assert of(Evict, decide(s)) == [Evict("cheap", "t-cheap", "memory")]


def test_memory_backstop_off_below_threshold_or_while_one_drains() -> None:
    hot = {"box1": WorkerView("box1", ("cpu",), memory={"cpu": 0.95})}
    idle = mv("a", S.READY, last_used=1.0, load_seconds=1.0)
    assert of(Evict, decide(snap(idle, limit=-1, workers=hot))) == []  # auto_evict off
    cool = {"box1": WorkerView("box1", ("cpu",), memory={"cpu": 0.5})}
    assert of(Evict, decide(snap(idle, limit=-1, workers=cool, auto_evict=True))) == []
    draining = mv("b", S.DRAINING)
    acts = decide(snap(idle, draining, limit=-1, workers=hot, auto_evict=True))
    assert of(Evict, acts) == []  # its memory is not given back yet: wait for it


# -- fairness between models: a busy model yields its slot after max_busy_s ---------------------

NOW = 1000.0


def fair(*models: ModelView, limit: int = 1, **kw: object) -> Snapshot:
    """A pool where waiting 30 s for a busy slot makes its holder yield, but never one loaded
    less than 10 s ago."""
    return snap(*models, limit=limit, max_busy_s=30.0, min_resident_s=10.0, **kw)


def busy(name: str, loaded_at: float = 0.0, **kw: object) -> ModelView:
    base: dict[str, object] = {"in_flight": 1, "queued": 1, "loaded_at": loaded_at}
    base.update(kw)
    return mv(name, S.READY, **base)


def test_a_busy_model_yields_once_a_waiter_waited_max_busy_s_and_not_before() -> None:
    early = decide(fair(busy("a"), mv("b", queued=1, demand_since=NOW - 29.9)))
    assert early == [Wait("b", "all_busy")]
    due = decide(fair(busy("a"), mv("b", queued=1, demand_since=NOW - 30.0)))
    assert due == [Yield("a", "t-a", "b"), Wait("b", "yielding")]
    # max_busy_s = 0: never.
    off = snap(busy("a"), mv("b", queued=1, demand_since=0.0), max_busy_s=0.0)
    assert decide(off) == [Wait("b", "all_busy")]


def test_a_model_loaded_less_than_min_resident_s_ago_is_not_made_to_yield() -> None:
    waiter = mv("b", queued=1, demand_since=0.0)
    assert decide(fair(busy("a", loaded_at=NOW - 9.9), waiter)) == [Wait("b", "all_busy")]
    assert of(Yield, decide(fair(busy("a", loaded_at=NOW - 10.0), waiter))) == [
        Yield("a", "t-a", "b")
    ]


def test_an_idle_model_in_its_turn_keeps_its_slot_a_moment_then_goes() -> None:
    """Within min_resident_s of its load an idle model whose last request ended less than
    turn_idle_s ago keeps its slot (its client sends again in that gap); used longer ago, or
    resident longer, or with min_resident_s = 0, it is an LRU victim as before."""
    waiter = mv("b", queued=1, demand_since=NOW - 0.2)

    def idle_a(loaded_ago: float, used_ago: float) -> ModelView:
        return mv("a", S.READY, loaded_at=NOW - loaded_ago, last_used=NOW - used_ago)

    assert decide(fair(idle_a(2.0, 0.1), waiter)) == [Wait("b", "in_turn")]
    assert of(Evict, decide(fair(idle_a(2.0, 0.5), waiter))) == [Evict("a", "t-a", "lru")]
    assert of(Evict, decide(fair(idle_a(10.0, 0.1), waiter))) == [Evict("a", "t-a", "lru")]
    off = snap(idle_a(2.0, 0.1), waiter, max_busy_s=30.0, min_resident_s=0.0)
    assert of(Evict, decide(off)) == [Evict("a", "t-a", "lru")]
    # A turn never shields a model from an older idle one's eviction order: the one out of its
    # turn goes first, even if used more recently.
    acts = decide(
        fair(
            idle_a(2.0, 0.1), mv("c", S.READY, loaded_at=0.0, last_used=NOW - 0.05), waiter, limit=2
        )
    )
    assert of(Evict, acts) == [Evict("c", "t-c", "lru")]
    # A limit that drops shrinks the pool whatever the turns.
    acts = decide(fair(idle_a(2.0, 0.1), mv("c", S.READY, loaded_at=0.0), limit=1))
    assert len(of(Evict, acts)) == 1


def test_a_pinned_model_never_yields_and_a_pinned_yielder_resumes() -> None:
    waiter = mv("c", queued=1, demand_since=0.0)
    acts = decide(fair(busy("a", pinned=True), busy("b", loaded_at=NOW - 5.0), waiter, limit=2))
    assert acts == [Wait("c", "all_busy")]
    # The other busy resident is old enough: it yields, never the pinned one.
    acts = decide(fair(busy("a", pinned=True), busy("b", loaded_at=500.0), waiter, limit=2))
    assert of(Yield, acts) == [Yield("b", "t-b", "c")]
    # Pinned while it yielded: it takes requests again, nothing evicts it.
    pinned = busy("a", pinned=True, in_flight=0, yielding="c", yielding_since=990.0)
    acts = decide(fair(pinned, busy("b", loaded_at=NOW - 5.0), waiter, limit=2))
    assert Resume("a", "t-a") in acts and of(Evict, acts) == []


def test_one_model_of_a_pool_yields_at_a_time_the_one_loaded_longest_ago() -> None:
    waiters = (mv("c", queued=1, demand_since=1.0), mv("d", queued=1, demand_since=2.0))
    acts = decide(fair(busy("a", loaded_at=300.0), busy("b", loaded_at=200.0), *waiters, limit=2))
    assert of(Yield, acts) == [Yield("b", "t-b", "c")]
    assert Wait("d", "all_busy") in acts
    # While b yields (or drains to give its slot), nobody else is made to yield.
    yielding = busy("b", loaded_at=200.0, yielding="c", yielding_since=990.0)
    acts = decide(fair(busy("a", loaded_at=300.0), yielding, *waiters, limit=2))
    assert of(Yield, acts) == [] and Wait("d", "all_busy") in acts
    draining = mv("b", S.DRAINING, yielding="c", yielding_since=990.0, queued=1)
    acts = decide(fair(busy("a", loaded_at=300.0), draining, *waiters, limit=2))
    assert of(Yield, acts) == []
    assert Wait("c", "slot_draining") in acts and Wait("d", "all_busy") in acts


def test_a_yielding_model_goes_once_nothing_is_in_flight_even_with_requests_queued() -> None:
    waiter = mv("b", queued=1, demand_since=0.0)
    running = busy("a", queued=3, yielding="b", yielding_since=990.0)
    assert decide(fair(running, waiter)) == [Wait("b", "yielding")]
    done = busy("a", in_flight=0, queued=3, yielding="b", yielding_since=990.0)
    assert decide(fair(done, waiter)) == [Evict("a", "t-a", "yield"), Wait("b", "evicting")]


def test_a_yield_nobody_waits_for_is_called_off() -> None:
    yielding = busy("a", yielding="b", yielding_since=990.0)
    # Its waiter's requests went (withdrawn, timed out).
    assert decide(fair(yielding, mv("b"))) == [Resume("a", "t-a")]
    # The limit was raised: the waiter loads into the new slot, the yielder carries on.
    acts = decide(fair(yielding, mv("b", queued=1, demand_since=0.0), limit=2))
    assert of(Load, acts) == [Load("b", "box1", "cpu")] and Resume("a", "t-a") in acts


def test_the_slot_given_up_goes_to_the_model_it_was_given_to() -> None:
    """a yielded to b and unloaded with requests queued that are older than b's: b loads first,
    and a waits its turn (it does not take the slot straight back)."""
    gave = mv("a", queued=2, demand_since=100.0, yielding="b", yielding_since=900.0)
    acts = decide(fair(gave, mv("b", queued=1, demand_since=500.0)))
    assert of(Load, acts) == [Load("b", "box1", "cpu")]
    # Once b is served, a's mark no longer counts: a waiter who came after the yield has no
    # precedence, and plain oldest-demand-first applies.
    acts = decide(fair(gave, mv("b", queued=1, demand_since=950.0)))
    assert of(Load, acts) == [Load("a", "box1", "cpu")]


def test_idle_events_are_wanted_while_a_model_yields() -> None:
    from residency.pool.decide import waits_for_idle

    s = fair(busy("a"), mv("b", queued=1, demand_since=0.0))
    assert waits_for_idle(decide(s), s)
    s = fair(busy("a", yielding="b", yielding_since=990.0), mv("b", queued=1, demand_since=0.0))
    assert waits_for_idle(decide(s), s)


def take_turns(max_busy_s: float, min_resident_s: float, steps: int = 600) -> dict[str, object]:
    """Two clients, each sending requests for its own model back to back (one outstanding
    request each, served in one step), share one slot: every step (one simulated second) the
    models serve, loads and drains finish, and the coordinator runs a pass. Returns per model
    the requests served and the longest wait of a request for a slot, and the loads."""
    models = {n: mv(n, queued=1, demand_since=0.0) for n in ("a", "b")}
    served = dict.fromkeys(models, 0)
    longest = dict.fromkeys(models, 0.0)
    loads = 0
    for now in range(1, steps + 1):
        t = float(now)
        for n, m in models.items():
            if m.state is S.LOADING:
                m = replace(m, state=S.READY, loaded_at=t, loading_since=None)
            elif m.state is S.DRAINING:  # its queued request stays queued for its next turn
                m = replace(m, state=S.UNLOADED, host=None, device=None, loaded_at=None)
            if m.state is S.READY and m.in_flight:  # the request ends; its client sends the next
                served[n] += 1
                m = replace(m, in_flight=0, queued=1, demand_since=t, last_used=t)
            if m.state is S.READY and m.queued and not m.yielding:
                longest[n] = max(longest[n], t - (m.demand_since or t))
                m = replace(m, queued=0, in_flight=1, demand_since=None)
            models[n] = m
        s = snap(*models.values(), now=t, max_busy_s=max_busy_s, min_resident_s=min_resident_s)
        for a in decide(s):
            m = models[a.model]  # type: ignore[union-attr]
            if isinstance(a, Load):
                loads += 1
                m = replace(m, state=S.LOADING, host=a.host, device=a.device, loading_since=t)
                m = replace(m, yielding=None, yielding_since=None)
            elif isinstance(a, Yield):
                m = replace(m, yielding=a.for_model, yielding_since=t)
            elif isinstance(a, Resume):
                m = replace(m, yielding=None, yielding_since=None)
            elif isinstance(a, Evict):
                assert not m.in_flight
                m = replace(m, state=S.DRAINING)
            models[m.name] = m
    return {"served": served, "longest": longest, "loads": loads}


def test_two_busy_models_sharing_one_slot_take_turns_and_neither_starves() -> None:
    steps = 600
    for max_busy_s, min_resident_s in ((30.0, 10.0), (1.0, 10.0), (5.0, 0.0)):
        r = take_turns(max_busy_s, min_resident_s, steps)
        turn = max(max_busy_s, min_resident_s)
        served, longest = r["served"], r["longest"]
        assert isinstance(served, dict) and isinstance(longest, dict)
        # Both are served, each wait bounded by a turn plus the steps of a yield, unload and load
        assert min(served.values()) > steps / 4, r
        assert max(longest.values()) <= turn + 6, r
        # ...and no thrash: at most one load per turn.
        assert isinstance(r["loads"], int) and r["loads"] <= steps / turn + 2, r
    # Without yielding the first model keeps the slot for as long as its client sends.
    r = take_turns(0.0, 10.0, steps)
    assert r["served"] == {"a": steps - 2, "b": 0} and r["loads"] == 1, r


def test_an_idle_yielding_model_is_evicted_like_any_idle_one_not_called_off() -> None:
    idle = mv("a", S.READY, loaded_at=0.0, yielding="b", yielding_since=990.0)
    acts = decide(fair(idle, mv("b", queued=1, demand_since=0.0)))
    assert acts == [Evict("a", "t-a", "lru"), Wait("b", "evicting")]
    # Idle, it may go for an older waiter first: it is evicted once, and its own waiter waits.
    acts = decide(
        fair(idle, mv("c", queued=1, demand_since=0.0), mv("b", queued=1, demand_since=1.0))
    )
    assert of(Evict, acts) == [Evict("a", "t-a", "lru")] and of(Resume, acts) == []
    assert Wait("c", "evicting") in acts and Wait("b", "all_busy") in acts
