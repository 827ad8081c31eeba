"""The memory ledger in decisions (pure): a load is placed only where its bytes fit beside what
is resident; otherwise idle residents are evicted by bytes, least valuable first, and the load
waits — it is never started to crash. Count limits stay an upper bound."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from residency import ledger
from residency.pool.decide import (
    Evict,
    Load,
    ModelView,
    Reject,
    Wait,
    WorkerView,
    decide,
    room_of,
)
from residency.states import ModelState as S
from tests.unit.test_decide import mv, of, snap

MB = 1 << 20
NOW = 1000.0


def dev(host: str = "box1", budget: int | None = 1000 * MB, *devices: str) -> WorkerView:
    devs = devices or ("cpu",)
    return WorkerView(host, devs, budgets={d: budget for d in devs})


def need(n_mb: int) -> tuple[tuple[str, int], ...]:
    return (("cpu", n_mb * MB), ("cuda", n_mb * MB))


def res(name: str, n_mb: int, host: str = "box1", device: str = "cpu", **kw: object) -> ModelView:
    base: dict[str, object] = {
        "host": host,
        "device": device,
        "held_bytes": n_mb * MB,
        "last_used": NOW - 100,
        "loaded_at": NOW - 500,
        "load_seconds": 1.0,
    }
    base.update(kw)
    return mv(name, S.READY, **base)


def want(name: str, n_mb: int, **kw: object) -> ModelView:
    base: dict[str, object] = {"queued": 1, "demand_since": NOW - 1, "need_bytes": need(n_mb)}
    base.update(kw)
    return mv(name, **base)


def test_a_load_goes_where_its_bytes_fit() -> None:
    workers = {"a": dev("a", 1000 * MB), "b": dev("b", 1000 * MB)}
    acts = decide(snap(res("x", 700, host="a"), want("y", 500), limit=-1, workers=workers))
    assert acts == [Load("y", "b", "cpu")]


def test_no_room_anywhere_evicts_idle_residents_by_bytes_and_waits() -> None:
    # 600 + 300 held of 1000: a 500 MB load needs 400 more; evicting the 300 MB one is not
    # enough, so the 600 MB one goes (one eviction rather than two).
    acts = decide(
        snap(res("big", 600), res("small", 300), want("y", 500), limit=-1, workers={"box1": dev()})
    )
    assert of(Load, acts) == []
    assert of(Evict, acts) == [Evict("big", "t-big", "room")]
    assert of(Wait, acts) == [Wait("y", "evicting")]


def test_room_is_made_least_valuable_first() -> None:
    # Both must not all go: 3 x 300 held of 1000, a 300 MB load needs 200 more: one goes, the
    # one idle longest per second of reload (cheap to reload, long idle).
    models = [
        res("recent", 300, last_used=NOW - 5, load_seconds=1.0),
        res("idle_cheap", 300, last_used=NOW - 200, load_seconds=0.5),
        res("idle_dear", 300, last_used=NOW - 300, load_seconds=30.0),
        want("y", 300),
    ]
    acts = decide(snap(*models, limit=-1, workers={"box1": dev()}))
    assert of(Evict, acts) == [Evict("idle_cheap", "t-idle_cheap", "room")]
    assert of(Load, acts) == []


def test_busy_or_pinned_residents_are_never_evicted_for_room() -> None:
    models = [res("busy", 600, in_flight=1), res("pin", 300, pinned=True), want("y", 500)]
    acts = decide(snap(*models, limit=-1, workers={"box1": dev()}))
    assert of(Evict, acts) == [] and of(Load, acts) == []
    assert of(Wait, acts) == [Wait("y", "no_room")]


def test_a_model_larger_than_every_budget_is_rejected_with_its_size() -> None:
    acts = decide(
        snap(want("huge", 2000), limit=-1, workers={"a": dev("a"), "b": dev("b", 1500 * MB)})
    )
    assert acts == [Reject("huge", "too_large", need=2000 * MB, largest=1500 * MB)]


def test_bytes_already_leaving_are_waited_for_not_doubled() -> None:
    # A draining 600 MB resident frees enough: nothing else is evicted.
    leaving = mv("leaving", S.DRAINING, held_bytes=600 * MB, host="box1", device="cpu")
    models = [leaving, res("stay", 300), want("y", 500)]
    acts = decide(snap(*models, limit=-1, workers={"box1": dev()}))
    assert of(Evict, acts) == [] and of(Load, acts) == []
    assert of(Wait, acts) == [Wait("y", "room_draining")]


def test_loads_planned_in_one_pass_count_against_the_budget() -> None:
    acts = decide(
        snap(want("p", 600), want("q", 600, demand_since=NOW), limit=-1, workers={"box1": dev()})
    )
    assert of(Load, acts) == [Load("p", "box1", "cpu")]
    assert of(Wait, acts) == [Wait("q", "no_room")]  # p is loading, not evictable


def test_a_reload_goes_back_to_its_last_device_when_it_fits() -> None:
    workers = {"a": dev("a"), "b": dev("b")}
    acts = decide(snap(want("y", 100, last_host="b", last_device="cpu"), limit=-1, workers=workers))
    assert acts == [Load("y", "b", "cpu")]
    # ... and elsewhere when it no longer fits there.
    acts = decide(
        snap(
            res("z", 950, host="b", in_flight=1),
            want("y", 100, last_host="b", last_device="cpu"),
            limit=-1,
            workers=workers,
        )
    )
    assert of(Load, acts) == [Load("y", "a", "cpu")]


def test_preload_takes_free_bytes_only() -> None:
    acts = decide(
        snap(
            res("x", 800),
            want("warm", 500, queued=0, demand_since=None, preload=True),
            limit=-1,
            workers={"box1": dev()},
        )
    )
    assert of(Load, acts) == [] and of(Evict, acts) == []


def test_the_count_limit_stays_an_upper_bound() -> None:
    # Bytes fit, but the pool holds its limit of one: the LRU resident goes first.
    acts = decide(snap(res("x", 100), want("y", 100), limit=1, workers={"box1": dev()}))
    assert of(Evict, acts) == [Evict("x", "t-x", "lru")]
    assert of(Load, acts) == []


def test_a_device_without_budget_takes_any_load() -> None:
    acts = decide(
        snap(res("x", 10**6), want("y", 10**6), limit=-1, workers={"box1": dev(budget=None)})
    )
    assert acts == [Load("y", "box1", "cpu")]


def test_a_loading_model_is_counted_for_its_expected_bytes() -> None:
    loading = mv("l", S.LOADING, loading_since=NOW - 1, need_bytes=need(700))
    rooms = room_of(snap(loading, workers={"box1": dev()})).report()
    assert rooms[0]["used_bytes"] == 700 * MB and rooms[0]["models"] == {"l": 700 * MB}


def test_budgets_default_to_the_total_less_the_reserve_split_between_cpu_devices() -> None:
    gib = 1 << 30
    assert ledger.budgets({"cpu:0-1": 10 * gib, "cpu:2-3": 10 * gib}, 0, 2048) == {
        "cpu:0-1": 4 * gib,
        "cpu:2-3": 4 * gib,
    }
    assert ledger.budgets({"cuda:0": 80 * gib, "cuda:1": None}, 0, 1024) == {
        "cuda:0": 79 * gib,
        "cuda:1": None,
    }
    assert ledger.budgets({"cuda:0": None, "cpu": 8 * gib}, 512, 1024) == {
        "cuda:0": 512 * MB,
        "cpu": 512 * MB,
    }


# --- the ledger never overcommits ---------------------------------------------------------

_resident = st.tuples(
    st.integers(1, 600),  # MB held
    st.sampled_from(["a", "b"]),  # host
    st.booleans(),  # busy
    st.booleans(),  # pinned
    st.integers(0, 500),  # idle seconds
)


@settings(max_examples=300, deadline=None)
@given(
    residents=st.lists(_resident, max_size=5),
    wanted=st.lists(st.integers(1, 1200), min_size=1, max_size=4),
    budget_a=st.integers(200, 1500),
    budget_b=st.integers(200, 1500),
)
def test_planned_loads_never_take_a_device_past_its_budget(
    residents: list[tuple[int, str, bool, bool, int]],
    wanted: list[int],
    budget_a: int,
    budget_b: int,
) -> None:
    workers = {"a": dev("a", budget_a * MB), "b": dev("b", budget_b * MB)}
    budget = {"a": budget_a * MB, "b": budget_b * MB}
    models = []
    held = {"a": 0, "b": 0}
    for i, (mb, host, busy, pinned, idle) in enumerate(residents):
        if held[host] + mb * MB > budget[host]:
            continue  # start from a ledger within its budgets
        held[host] += mb * MB
        models.append(
            res(f"r{i}", mb, host=host, in_flight=int(busy), pinned=pinned, last_used=NOW - idle)
        )
    for i, mb in enumerate(wanted):
        models.append(want(f"w{i}", mb, demand_since=NOW - 10 + i))
    acts = decide(snap(*models, limit=-1, workers=workers))
    by_name = {m.name: m for m in models}
    # Evicted bytes are still held until their process is gone: a load never counts on them.
    for host in ("a", "b"):
        loads = sum(by_name[a.model].need_on("cpu") for a in of(Load, acts) if a.host == host)
        assert held[host] + loads <= budget[host]
    evicted = {a.model for a in of(Evict, acts)}
    assert all(not by_name[n].busy and not by_name[n].pinned for n in evicted)


# --- the fit dry run ----------------------------------------------------------------------


def test_fit_places_a_model_that_fits_now() -> None:
    from residency.pool.fit import fit

    a = fit(snap(res("x", 300), want("y", 300, queued=0), limit=-1, workers={"box1": dev()}), "y")
    assert (a["fits"], a["now"], a["host"], a["device"], a["evict"]) == (
        True,
        True,
        "box1",
        "cpu",
        [],
    )
    assert a["bytes"] == 300 * MB and a["device_ledger"]["used_bytes"] == 300 * MB


def test_fit_plays_count_and_byte_evictions_forward() -> None:
    from residency.pool.fit import fit

    # The pool holds its count limit (2) and the device has 200 MB free: the LRU resident goes
    # for the count, and then another for the bytes.
    models = [
        res("old", 100, last_used=NOW - 900),
        res("mid", 700, last_used=NOW - 50),
        want("y", 800, queued=0, demand_since=None),
    ]
    a = fit(snap(*models, limit=2, workers={"box1": dev()}), "y")
    assert a["fits"] is True and a["now"] is False
    assert [(e["model"], e["reason"]) for e in a["evict"]] == [("old", "lru"), ("mid", "room")]


def test_fit_says_why_not() -> None:
    from residency.pool.fit import fit

    busy = [res("x", 900, in_flight=1), want("y", 300, queued=0, demand_since=None)]
    a = fit(snap(*busy, limit=-1, workers={"box1": dev()}), "y")
    assert (a["fits"], a["reason"], a["evict"]) == (False, "no_room", [])
    big = fit(snap(want("y", 5000, queued=0), limit=-1, workers={"box1": dev()}), "y")
    assert (big["fits"], big["reason"], big["largest_budget_bytes"]) == (
        False,
        "too_large",
        1000 * MB,
    )
    here = fit(snap(res("x", 900), limit=-1, workers={"box1": dev()}), "x")
    assert (here["fits"], here["resident"]) == (True, True)
    # Other models' waiting requests are left out of the question.
    other = [res("x", 500), want("z", 400), want("y", 400, queued=0, demand_since=None)]
    a = fit(snap(*other, limit=-1, workers={"box1": dev()}), "y")
    assert (a["fits"], a["now"]) == (True, True)


def test_fit_takes_a_residents_turn_as_over() -> None:
    from residency.pool.fit import fit

    # x was loaded a moment ago and its request just ended: the coordinator keeps its slot for
    # a moment (its turn), but the answer is what the pool can give: x would go.
    x = res("x", 900, loaded_at=NOW - 1, last_used=NOW - 0.1)
    y = want("y", 300, queued=0, demand_since=None)
    s = snap(x, y, limit=-1, min_resident_s=10.0, workers={"box1": dev()})
    a = fit(s, "y")
    assert (a["fits"], [e["model"] for e in a["evict"]]) == (True, ["x"])


def test_room_held_by_a_resident_in_its_turn_is_waited_for_not_taken() -> None:
    # x was loaded a moment ago and its client is about to send again: the waiter waits for
    # its turn to end (a timer pass), not for a busy -> idle edge.
    x = res("x", 900, loaded_at=NOW - 1, last_used=NOW - 0.1)
    acts = decide(snap(x, want("y", 300), limit=-1, min_resident_s=10.0, workers={"box1": dev()}))
    assert of(Evict, acts) == [] and of(Wait, acts) == [Wait("y", "in_turn")]
    later = decide(
        snap(x, want("y", 300), limit=-1, min_resident_s=10.0, now=NOW + 1, workers={"box1": dev()})
    )
    assert of(Evict, later) == [Evict("x", "t-x", "room")]


def test_busy_residents_holding_the_bytes_take_turns_with_a_waiter() -> None:
    from residency.pool.decide import Yield

    busy = res("busy", 900, in_flight=1, queued=3, demand_since=NOW - 100, loaded_at=NOW - 60)
    kw: dict[str, object] = {"limit": -1, "max_busy_s": 5.0, "workers": {"box1": dev()}}
    # Not yet waited max_busy_s: it waits for the bytes.
    acts = decide(snap(busy, want("y", 500, demand_since=NOW - 1), **kw))
    assert of(Yield, acts) == [] and of(Wait, acts) == [Wait("y", "no_room")]
    # Waited long enough: the busy resident yields (the count limit is off: bytes alone).
    acts = decide(snap(busy, want("y", 500, demand_since=NOW - 10), **kw))
    assert of(Yield, acts) == [Yield("busy", "t-busy", "y")]
    # Yielding, it goes once nothing is in flight, its queued requests kept for its next turn.
    yielding = replace(busy, yielding="y", yielding_since=NOW - 5)
    acts = decide(snap(yielding, want("y", 500, demand_since=NOW - 10), **kw))
    assert of(Wait, acts) == [Wait("y", "yielding")] and of(Evict, acts) == []
    acts = decide(snap(replace(yielding, in_flight=0), want("y", 500, demand_since=NOW - 10), **kw))
    assert of(Evict, acts) == [Evict("busy", "t-busy", "yield")]
    # A resident whose leaving would not make room is never asked to yield.
    small = res("small", 100, in_flight=1, loaded_at=NOW - 60)
    pinned = res("pin", 850, pinned=True)
    acts = decide(snap(small, pinned, want("y", 500, demand_since=NOW - 10), **kw))
    assert of(Yield, acts) == []


def test_bytes_held_by_pinned_residents_on_every_device_reject_the_load() -> None:
    # Nothing will ever free them: its requests are answered at once, as with pinned slots.
    pinned = res("pin", 850, pinned=True)
    acts = decide(snap(pinned, want("y", 500), limit=-1, workers={"box1": dev()}))
    assert acts == [Reject("y", "memory_pinned", need=500 * MB)]
    # A busy unpinned resident will go idle some day: then it waits.
    busy = res("busy", 850, in_flight=1)
    acts = decide(snap(busy, want("y", 500), limit=-1, workers={"box1": dev()}))
    assert of(Reject, acts) == [] and of(Wait, acts) == [Wait("y", "no_room")]
