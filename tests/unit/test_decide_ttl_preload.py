"""Idle TTL and preload (pure): ``ttl_s`` evicts an idle resident unused that long; a preload
model takes a free slot and nothing else."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from residency.policies import candidate_floor
from residency.policies.schema import ModelInfo, Policy
from residency.pool.decide import Evict, Load, Wait, WorkerView, decide, expired
from residency.settings import ModelSpec
from residency.states import ModelState as S
from tests.unit.test_decide import mv, of, snap

NOW = 1000.0


# --- ttl_s ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("idle_for", "evicted"), [(9.99, False), (10.0, True), (10.01, True), (500.0, True)]
)
def test_ttl_evicts_exactly_at_and_after_ttl_not_before(idle_for: float, evicted: bool) -> None:
    m = mv("a", S.READY, ttl_s=10.0, last_used=NOW - idle_for, loaded_at=NOW - 600)
    acts = decide(snap(m, now=NOW))
    assert of(Evict, acts) == ([Evict("a", "t-a", "ttl")] if evicted else [])


@pytest.mark.parametrize("ttl", [None, 0.0])
def test_no_ttl_or_zero_never_expires(ttl: float | None) -> None:
    m = mv("a", S.READY, ttl_s=ttl, last_used=1.0, loaded_at=1.0)
    assert decide(snap(m, now=NOW)) == []


@pytest.mark.parametrize(
    "kw",
    [
        {"in_flight": 1},
        {"queued": 1, "demand_since": NOW - 1},
        {"pinned": True},
        {"state": S.LOADING, "loading_since": NOW - 1},
        {"state": S.DRAINING},
    ],
    ids=["in_flight", "queued", "pinned", "loading", "draining"],
)
def test_ttl_never_takes_a_busy_pinned_or_not_ready_model(kw: dict[str, object]) -> None:
    state = kw.pop("state", S.READY)
    m = mv("a", state, ttl_s=1.0, last_used=NOW - 100, loaded_at=NOW - 100, **kw)  # type: ignore[arg-type]
    assert of(Evict, decide(snap(m, now=NOW))) == []


def test_ttl_counts_from_the_load_when_the_model_served_nothing() -> None:
    # last_used is written at the load commit; an older or missing one never shortens the TTL.
    fresh = mv("a", S.READY, ttl_s=10.0, last_used=0.0, loaded_at=NOW - 5)
    assert not expired(fresh, snap(fresh, now=NOW))
    assert expired(replace(fresh, loaded_at=NOW - 10), snap(fresh, now=NOW))
    unknown = mv("b", S.READY, ttl_s=10.0, last_used=0.0, loaded_at=None)
    assert not expired(unknown, snap(unknown, now=NOW))


def test_ttl_is_per_model_and_a_kept_warm_model_never_expires() -> None:
    acts = decide(
        snap(
            mv("short", S.READY, ttl_s=5.0, last_used=NOW - 6),
            mv("long", S.READY, ttl_s=60.0, last_used=NOW - 6),
            mv("warm", S.READY, ttl_s=5.0, preload=True, last_used=NOW - 600),
            limit=3,
            now=NOW,
        )
    )
    assert of(Evict, acts) == [Evict("short", "t-short", "ttl")]


def test_an_expiring_slot_is_waited_for_not_doubled() -> None:
    # The TTL victim frees the slot a waiting model needs: it waits for that drain rather than
    # evicting another resident too.
    acts = decide(
        snap(
            mv("old", S.READY, ttl_s=5.0, last_used=NOW - 6),
            mv("other", S.READY, last_used=NOW - 100),
            mv("c", queued=1, demand_since=NOW - 1),
            limit=2,
            now=NOW,
        )
    )
    assert of(Evict, acts) == [Evict("old", "t-old", "ttl")]
    assert Wait("c", "slot_draining") in acts


def test_ttl_and_preload_are_exclusive_in_a_spec() -> None:
    with pytest.raises(ValidationError) as e:
        ModelSpec(path="/m.gguf", ttl_s=30, preload=True)
    assert "'ttl_s' and 'preload'" in str(e.value)
    assert ModelSpec(path="/m.gguf", ttl_s=0, preload=True).preload
    with pytest.raises(ValidationError, match="local models only"):
        ModelSpec(base_url="http://x/v1", ttl_s=30)


# --- preload -------------------------------------------------------------------------------


def test_preload_loads_into_a_free_slot() -> None:
    assert decide(snap(mv("p", preload=True), now=NOW)) == [Load("p", "box1", "cpu")]


def test_preload_never_evicts_nor_waits() -> None:
    # A full pool: its idle resident stays, and the preload model does not even wait.
    acts = decide(snap(mv("r", S.READY, last_used=1.0), mv("p", preload=True), now=NOW))
    assert acts == []
    # Nor does it take a slot that is draining.
    assert decide(snap(mv("r", S.DRAINING), mv("p", preload=True), now=NOW)) == []


def test_real_demand_gets_the_free_slot_before_a_preload() -> None:
    acts = decide(snap(mv("p", preload=True), mv("z", queued=1, demand_since=NOW - 1), now=NOW))
    assert of(Load, acts) == [Load("z", "box1", "cpu")]


def test_preload_fills_every_free_slot_and_no_more() -> None:
    ps = [mv(n, preload=True) for n in ("p1", "p2", "p3")]
    acts = decide(snap(mv("r", S.READY), *ps, limit=3, now=NOW))
    assert [a.model for a in of(Load, acts)] == ["p1", "p2"]
    unlimited = decide(snap(*ps, limit=-1, now=NOW))
    assert [a.model for a in of(Load, unlimited)] == ["p1", "p2", "p3"]


def test_a_preload_model_is_an_lru_victim_and_comes_back_when_the_slot_frees() -> None:
    p_ready = mv("p", S.READY, preload=True, last_used=NOW - 100, loaded_at=NOW - 100)
    # 1. A real request needs the slot: the idle preload model is the LRU victim.
    acts = decide(snap(p_ready, mv("r", queued=1, demand_since=NOW - 1), now=NOW))
    assert of(Evict, acts) == [Evict("p", "t-p", "lru")]
    # 2. It drains, then the real model loads into the freed slot first.
    p_gone = mv("p", preload=True)
    acts = decide(snap(p_gone, mv("r", queued=1, demand_since=NOW - 1), now=NOW))
    assert of(Load, acts) == [Load("r", "box1", "cpu")]
    # 3. While the real model holds the slot, the preload model stays out.
    r_ready = mv("r", S.READY, last_used=NOW - 1)
    assert decide(snap(p_gone, r_ready, now=NOW)) == []
    # 4. The real model expires: the slot is draining, the preload waits for nothing...
    r_old = replace(r_ready, ttl_s=5.0, last_used=NOW - 5)
    assert decide(snap(p_gone, r_old, now=NOW)) == [Evict("r", "t-r", "ttl")]
    # 5. ...and comes back once the slot is free.
    assert decide(snap(p_gone, mv("r"), now=NOW)) == [Load("p", "box1", "cpu")]


def test_preload_skips_admin_unload_backoff_other_types_and_deleted() -> None:
    failures = (NOW - 3, NOW - 2, NOW - 1)
    acts = decide(
        snap(
            mv("unloading", preload=True, explicit="unload"),
            mv("crashing", preload=True, failures=failures, last_error="boom"),
            mv("gone", preload=True, registered=False),
            limit=-1,
            now=NOW,
        )
    )
    assert acts == []
    emb = mv("e", preload=True, type="embedding")
    acts = decide(snap(mv("r", S.READY), emb, now=NOW))
    assert acts == [Load("e", "box1", "cpu")]  # its own pool has room


def test_no_preload_under_memory_pressure() -> None:
    # The backstop would evict it again: the two would loop.
    hot = {"box1": WorkerView("box1", ("cpu",), memory={"cpu": 0.95})}
    p = mv("p", preload=True)
    assert decide(snap(p, workers=hot, auto_evict=True, now=NOW)) == []
    assert decide(snap(p, workers=hot, auto_evict=False, now=NOW)) == [Load("p", "box1", "cpu")]


def test_preload_without_a_worker_waits_silently() -> None:
    assert decide(snap(mv("p", preload=True), workers={}, now=NOW)) == []


def test_preload_candidates_are_the_floors_union() -> None:
    # What snapshot.read marks kept warm under pool.preload_candidates.
    models = {
        "small": ModelInfo("llm", False),
        "big": ModelInfo("llm", False),
        "far": ModelInfo("llm", True),
        "emb": ModelInfo("embedding", False),
    }
    pols = {
        "p1": Policy.model_construct(candidates=["small", "far", "emb"], default="small"),
        "p2": Policy.model_construct(candidates=["small", "big"], default="big"),
    }
    assert candidate_floor(pols, models).candidates == {"small", "big"}
