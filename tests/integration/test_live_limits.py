"""Live limits (DESIGN §4 rules 4 and 6) against real parts: a real Redis, the coordinator and
agent, model processes running llama.cpp on tiny GGUF models, the admin API through Flask.

Slow loads and busy models are made deterministic with the debug faults (``load_delay_s``,
``hold``); assertions are on states, counts and orders, never on durations.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from coordinator import retry
from coordinator.loop import Coordinator
from residency import keys, policy_store
from residency.box import connect
from residency.messages import Event, EventType
from tests.conftest import Pool
from tests.integration.test_failover import everything
from tests.integration.test_pool import ADMIN, chat, client_for, in_thread, loads


def counter(pool: Pool, metric: str, **labels: str) -> float:
    lab = json.dumps(labels, sort_keys=True, separators=(",", ":"))
    return float(str(pool.r.hget(keys.metric_counters(), f"{metric}|{lab}") or 0))


def hand_driven_leader(pool: Pool, redis_url: str) -> Coordinator:
    """Hand the lease to a coordinator whose passes the test runs (``step``, or its loop with
    ``run``), with an empty inbox: the running one finds its lease gone at its next renewal and
    stands by. Its lease is renewed by its own thread until ``co.stop`` is set."""
    co = Coordinator(pool.box, connect(redis_url))
    pool.r.set(keys.leader(), co.lease_token, px=keys.LEADER_TTL_MS)
    co.is_leader = True
    threading.Thread(target=co.keep_lease, daemon=True).start()
    pool.wait_for(lambda: not pool.coordinator.is_leader, what="the old leader standing by")
    while co.collect_events(0.01):
        pass
    return co


def hand_back_lease(co: Coordinator) -> None:
    co.stop.set()
    co.resign()


def health(pool: Pool) -> dict[str, object]:
    return dict(json.loads(str(pool.r.hget(keys.health(), "record"))))


def test_patch_returns_during_a_slow_load_and_the_late_commit_is_rechecked(
    start_pool: Callable[..., Pool], redis_url: str
) -> None:
    """The admin PATCH answers while a load is in flight (it never waits for enforcement), and
    the load that commits after the limit dropped — and only that one — asks for a re-check:
    its ready event says so, and the pass that handles it leaves the pool at the new limit.
    The passes are run by hand, so no timer pass can do the re-check's work unseen."""
    pool = start_pool(pool={"max_loaded_models": 2}, debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200  # decided and committed under unchanged limits
    faults = {"load_delay_s": {"b": 60}}
    assert c.post("/admin/faults", json=faults, headers=ADMIN).status_code == 200
    tb, rb = in_thread(lambda: chat(client_for(pool), "b"))
    pool.wait_for(lambda: pool.state("b") == "loading", what="b loading")
    co = hand_driven_leader(pool, redis_url)

    resp = c.patch("/admin/config", json={"pool": {"max_loaded_models": 1}}, headers=ADMIN)
    assert resp.status_code == 200
    assert pool.state("b") == "loading", "the PATCH returned only after the load"
    # The pass enforces at once what it can: `a` is idle and goes; `b` stays loading.
    co.step(co.collect_events(0.01))
    pool.wait_for(lambda: pool.state("a") == "unloaded", what="a evicted")
    assert pool.state("b") == "loading"

    # End the slow load now (the fault is re-read while the load waits).
    c.post("/admin/faults", json={"load_delay_s": {"b": 0}}, headers=ADMIN)
    tb.join(120)
    assert rb and rb[0].status_code == 200
    events = co.collect_events(0.01)
    ready = [e for e in events if e.type is EventType.READY]
    assert [(e.model, e.data.get("recheck")) for e in ready] == [("b", True)]
    co.step(events)
    assert pool.resident() == {"b"}
    hand_back_lease(co)
    assert counter(pool, "residency_load_commit_rechecks_total", model="b") == 1
    assert counter(pool, "residency_load_commit_rechecks_total", model="a") == 0
    assert loads(pool, "b") == 1 and loads(pool, "a") == 1


def test_all_busy_shrink_is_deferred_and_completes_when_they_go_idle(
    start_pool: Callable[..., Pool],
) -> None:
    """Every resident busy when the limit drops: nothing is killed, the shrink is deferred (a
    retry job on the rq queue, the blocked count in /health), and it completes as soon as a
    resident goes idle — with no other request arriving."""
    pool = start_pool(pool={"max_loaded_models": 2}, debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    assert chat(c, "b").status_code == 200
    pids = {m: pool.pid(m) for m in ("a", "b")}
    hold = {"hold": {"a": True, "b": True}}
    assert c.post("/admin/faults", json=hold, headers=ADMIN).status_code == 200
    ta, ra = in_thread(lambda: chat(client_for(pool), "a"))
    tb, rb = in_thread(lambda: chat(client_for(pool), "b"))
    pool.wait_for(
        lambda: pool.r.llen(keys.processing("a")) == 1 and pool.r.llen(keys.processing("b")) == 1,
        what="a and b in flight",
    )

    resp = c.patch("/admin/config", json={"pool": {"max_loaded_models": 1}}, headers=ADMIN)
    assert resp.status_code == 200
    gen = resp.get_json()["generation"]
    pool.wait_for(
        lambda: (
            health(pool)["generation"] > gen  # type: ignore[operator]
            and health(pool)["enforcement"]
            == {**health(pool)["enforcement"], "blocked": {"llm": 1}}
        ),  # type: ignore[dict-item]
        what="the shrink recorded as deferred",
    )
    assert retry.pending(retry.connection(pool.r)), "no retry job for the deferred shrink"
    passes = pool.coordinator.passes
    pool.wait_for(lambda: pool.coordinator.passes >= passes + 2, what="more passes")
    assert {m: pool.pid(m) for m in ("a", "b")} == pids, "a busy model was killed"
    assert pool.resident() == {"a", "b"}
    assert counter(pool, "residency_evictions_total", reason="limit") == 0

    # `a` finishes: the busy -> idle edge re-arms the shrink at once.
    idle_passes = counter(pool, "residency_enforcement_passes_total", trigger="idle")
    c.post("/admin/faults", json={"hold": {"a": False}}, headers=ADMIN)
    ta.join(30)
    assert ra and ra[0].status_code == 200
    pool.wait_for(lambda: pool.resident() == {"b"}, what="shrunk once a went idle")
    assert counter(pool, "residency_enforcement_passes_total", trigger="idle") > idle_passes
    assert pool.pid("b") == pids["b"]
    pool.wait_for(lambda: not retry.pending(retry.connection(pool.r)), what="the retry job dropped")
    pool.wait_for(lambda: health(pool)["enforcement"]["blocked"] == {}, what="not blocked")  # type: ignore[index]

    c.post("/admin/faults", json={"hold": {"b": False}}, headers=ADMIN)
    tb.join(30)
    assert rb and rb[0].status_code == 200
    assert counter(pool, "residency_evictions_total", reason="limit") == 1


def test_the_retry_job_wakes_the_leader_while_the_pool_stays_blocked(
    start_pool: Callable[..., Pool],
) -> None:
    """The deferred-shrink job runs on the rq queue with backoff: each attempt asks the leader
    for a pass (a ``retry`` trigger) and is retried while the pool is still blocked."""
    pool = start_pool(pool={"max_loaded_models": 2}, debug={"fault_injection": True})
    c = client_for(pool)
    for m in ("a", "b"):
        assert chat(c, m).status_code == 200
    c.post("/admin/faults", json={"hold": {"a": True, "b": True}}, headers=ADMIN)
    threads = [in_thread(lambda m=m: chat(client_for(pool), m)) for m in ("a", "b")]  # type: ignore[misc]
    pool.wait_for(
        lambda: pool.r.llen(keys.processing("a")) == 1 and pool.r.llen(keys.processing("b")) == 1,
        what="both in flight",
    )
    c.patch("/admin/config", json={"pool": {"max_loaded_models": 1}}, headers=ADMIN)
    pool.wait_for(lambda: retry.pending(retry.connection(pool.r)), what="retry job queued")
    # Two attempts (1 s then 2 s backoff) each wake a pass.
    pool.wait_for(
        lambda: counter(pool, "residency_enforcement_passes_total", trigger="retry") >= 2,
        timeout=60,
        what="retry-triggered passes",
    )
    assert pool.resident() == {"a", "b"}
    c.post("/admin/faults", json={"hold": {"a": False, "b": False}}, headers=ADMIN)
    for t, out in threads:
        t.join(30)
        assert out and out[0].status_code == 200
    pool.wait_for(lambda: len(pool.resident()) == 1, what="shrunk")
    pool.wait_for(lambda: not retry.pending(retry.connection(pool.r)), what="job dropped")


def test_a_burst_of_changes_costs_one_pass_and_ends_at_the_last_change(
    start_pool: Callable[..., Pool], redis_url: str
) -> None:
    """Rule 6: 20 config changes queued while the leader is between passes are handled by one
    pass of its own loop (counted by the passes metric, and by the pass that evicts), and its
    record shows the last change."""
    pool = start_pool(pool={"max_loaded_models": 3})
    c = client_for(pool)
    for m in ("a", "b", "c"):
        assert chat(c, m).status_code == 200
    co = hand_driven_leader(pool, redis_url)
    config_passes = counter(pool, "residency_enforcement_passes_total", trigger="config")
    gens = []
    for i in range(20):
        limit = 3 if i % 2 else 2
        if i == 19:
            limit = 1
        resp = c.patch("/admin/config", json={"pool": {"max_loaded_models": limit}}, headers=ADMIN)
        assert resp.status_code == 200
        gens.append(resp.get_json()["generation"])
    assert gens == sorted(gens) and len(set(gens)) == 20
    assert pool.r.llen(keys.events()) == 20

    loop = threading.Thread(target=co.run, daemon=True)
    loop.start()
    # Its first pass, then passes for what followed (the evicted processes' events, timers).
    pool.wait_for(lambda: co.passes >= 3, what="the leader's loop running on")
    hand_back_lease(co)
    loop.join(30)
    assert counter(pool, "residency_enforcement_passes_total", trigger="config") == (
        config_passes + 1
    )
    h = health(pool)
    assert h["generation"] > gens[-1]  # type: ignore[operator]
    assert h["max_models"]["llm"] == {"configured": 1, "effective": 1}  # type: ignore[index]
    evicted = [(n, m) for n, m, reason in co.effects.evictions if reason == "limit"]
    assert evicted == [(1, "a"), (1, "b")]


def test_a_deposed_leader_applies_and_publishes_nothing(
    start_pool: Callable[..., Pool], redis_url: str
) -> None:
    """A leader begins a pass that has work to do (the limit dropped below the residents); while
    it reads the pool it is paused past its lease and another coordinator takes over. The rest
    of the pass changes no key at all: no eviction, no limits, no record (the new leader's
    stays), the inbox untouched. The new leader's pass then does the work."""
    pool = start_pool(pool={"max_loaded_models": 2})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    assert chat(c, "b").status_code == 200
    newer = Coordinator(pool.box, connect(redis_url))
    before: dict[bytes, bytes | None] = {}

    def paused_then_deposed() -> float:
        # First read of the clock: the pass reads the pool. Meanwhile, the lease moves on.
        if not before:
            pool.r.set(keys.leader(), newer.lease_token, px=keys.LEADER_TTL_MS)
            newer.is_leader = True
            pool.r.rpush(keys.events(), json.dumps(Event(EventType.CONFIG).to_dict()))
            before.update(everything(redis_url, but=(keys.worker(pool.agent.host),)))
        return time.time()

    deposed = hand_driven_leader(pool, redis_url)
    deposed.clock = paused_then_deposed
    resp = c.patch("/admin/config", json={"pool": {"max_loaded_models": 1}}, headers=ADMIN)
    assert resp.status_code == 200
    assert deposed.step(deposed.collect_events(0.01)) == []
    assert before and not deposed.is_leader
    assert everything(redis_url, but=(keys.worker(pool.agent.host),)) == before
    assert pool.resident() == {"a", "b"}

    newer.step(newer.collect_events(0.01))
    pool.wait_for(lambda: len(pool.resident()) == 1, what="the newer leader's eviction")
    assert health(pool)["max_models"]["llm"]["configured"] == 1  # type: ignore[index]
    hand_back_lease(deposed)
    newer.resign()


def test_changes_that_follow_the_first_within_a_quiet_spell_join_its_pass(
    start_pool: Callable[..., Pool], redis_url: str
) -> None:
    """Rule 6, live: a pass woken by an admin change waits for a short quiet spell, so changes
    sent back to back after the coordinator already took the first one still share its pass."""
    pool = start_pool()
    co = hand_driven_leader(pool, redis_url)
    config = json.dumps(Event(EventType.CONFIG).to_dict())
    pool.r.rpush(keys.events(), config)
    t, batch = in_thread(lambda: co.collect_events(5.0))
    pool.wait_for(lambda: pool.r.llen(keys.events()) == 0, what="the first change taken")
    for _ in range(5):
        pool.r.rpush(keys.events(), config)
    t.join(10)
    assert [len(b) for b in batch] == [6]
    co.resign()


def test_the_floor_and_the_helper_set_come_from_one_snapshot(
    start_pool: Callable[..., Pool],
) -> None:
    """Rule 7: policies are swapped back and forth as fast as Redis takes them (two of them:
    ``p`` with candidates a, b and the LLM router c; ``q`` with candidate a and no helper) while
    the leader runs passes. Every record it publishes pairs the candidate floor, the per-policy
    breakdown and the routing-helper set of one and the same policy state."""
    pool = start_pool()
    router = {"type": "llm", "model": "c", "prompt": "Pick a model.", "max_tokens": 16}
    specs = {
        "p": {"candidates": ["a", "b"], "default": "a", "router": router},
        "q": {"candidates": ["a"], "default": "a", "rules": []},
    }
    candidates = {"p": {"a", "b"}, "q": {"a"}}
    stop = threading.Event()
    seen: dict[int, dict[str, object]] = {}

    def swap() -> None:
        r = connect(str(pool.box.redis_url))
        while not stop.is_set():
            for add, drop in (("p", "q"), ("q", "p")):
                policy_store.put(r, policy_store.PolicyEntry(add, specs[add], "admin"), "test")
                policy_store.delete(r, drop, "test")

    def record() -> None:
        r = connect(str(pool.box.redis_url))
        while not stop.is_set():
            h = json.loads(str(r.hget(keys.health(), "record")))
            seen[h["generation"]] = h

    threads = [threading.Thread(target=f, daemon=True) for f in (swap, record)]
    for t in threads:
        t.start()
    try:
        pool.wait_for(
            lambda: (
                len(seen) >= 30
                and {tuple(h["llm_pool_autosize"]["policies"]) for h in seen.values()}  # type: ignore[index]
                >= {("p",), ("q",)}
            ),
            timeout=120,
            what="records of both policy states",
        )
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    for gen, h in seen.items():
        autosize = h["llm_pool_autosize"]
        names = set(autosize["policies"])  # type: ignore[index]
        floor = len(set().union(*(candidates[n] for n in names)))
        helpers = ["c"] if "p" in names else []
        assert (autosize["candidate_floor"], h["routing_helpers"]) == (floor, helpers), (  # type: ignore[index]
            gen,
            names,
        )
        assert autosize["policies"] == {n: len(candidates[n]) for n in names}, gen  # type: ignore[index]
