"""The pool rules against real parts: a real Redis, the coordinator and agent running, real
model processes running llama.cpp on tiny GGUF models, requests through the Flask app.

Assertions are on states, counts and orders, never on wall-clock durations.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from flask.testing import FlaskClient

from residency import keys
from residency.pool import snapshot
from tests.conftest import Pool
from web.app import create_app

ADMIN = {"Authorization": "Bearer test-admin-key"}


# create_app compiles werkzeug's URL rules with ast.parse, which CPython 3.11 before 3.11.9 does
# not make thread-safe ("SystemError: AST constructor recursion depth mismatch" when two threads
# build apps at once): tests that make clients in threads build one app at a time.
_APP_LOCK = threading.Lock()


def client_for(pool: Pool) -> FlaskClient:
    with _APP_LOCK:
        return create_app(pool.box).test_client()


def chat(c: FlaskClient, model: str, **kw: Any) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    return c.post("/v1/chat/completions", json=body)


def loads(pool: Pool, model: str) -> int:
    labels = json.dumps({"model": model, "outcome": "ok"}, sort_keys=True, separators=(",", ":"))
    raw = pool.r.hget(keys.metric_counters(), f"residency_model_loads_total|{labels}")
    return int(float(str(raw or 0)))


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_load_serve_evict_reload(start_pool: Callable[..., Pool]) -> None:
    """DESIGN §4 rule 1 with max_loaded_models=1: the second model evicts the first, and asking
    for the first again reloads it (a new process)."""
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pid_a = pool.pid("a")
    assert pool.state("a") == "ready" and pid_a

    assert chat(c, "b").status_code == 200
    assert pool.state("b") == "ready"
    assert pool.state("a") == "unloaded"
    assert pool.resident() == {"b"}

    assert chat(c, "a").status_code == 200
    assert pool.state("a") == "ready"
    assert pool.pid("a") != pid_a
    assert pool.resident() == {"a"}
    assert loads(pool, "a") == 2 and loads(pool, "b") == 1


def test_busy_model_is_never_evicted(start_pool: Callable[..., Pool]) -> None:
    """A request in flight on `a` keeps `a` resident; the request for `b` waits (not fails) and
    is served once `a` goes idle — without any other request arriving."""
    pool = start_pool(pool={"max_loaded_models": 1}, debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pid_a = pool.pid("a")
    assert c.post("/admin/faults", json={"hold": {"a": True}}, headers=ADMIN).status_code == 200

    ta, ra = in_thread(lambda: chat(client_for(pool), "a"))
    pool.wait_for(lambda: pool.r.llen(keys.processing("a")) == 1, what="a in flight")
    tb, rb = in_thread(lambda: chat(client_for(pool), "b"))
    pool.wait_for(lambda: pool.r.llen(keys.queue("b")) == 1, what="b queued")
    passes = pool.coordinator.passes
    pool.wait_for(lambda: pool.coordinator.passes >= passes + 3, what="coordinator passes")
    assert pool.state("a") == "ready" and pool.pid("a") == pid_a
    assert pool.state("b") == "unloaded"
    assert not rb

    c.post("/admin/faults", json={"hold": {"a": False}}, headers=ADMIN)
    ta.join(30)
    tb.join(30)
    assert ra[0].status_code == 200
    assert rb[0].status_code == 200
    assert pool.state("b") == "ready" and pool.state("a") == "unloaded"


def test_pinned_model_is_never_evicted_and_all_pinned_is_409(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    assert c.post("/admin/models/a/pin", json={"pinned": True}, headers=ADMIN).status_code == 200
    assert chat(c, "a").status_code == 200
    resp = chat(c, "b")
    assert resp.status_code == 409
    assert resp.get_json()["error"]["code"] == "slots_pinned"
    assert pool.state("a") == "ready"
    assert pool.state("b") == "unloaded"
    # Unpinned, it is an ordinary LRU victim again.
    c.post("/admin/models/a/pin", json={"pinned": False}, headers=ADMIN)
    assert chat(c, "b").status_code == 200
    assert pool.state("a") == "unloaded"


def test_concurrent_requests_for_a_cold_model_share_one_load(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1}, debug={"fault_injection": True})
    c = client_for(pool)
    # A slow load (the fault hook waits on a stop-aware timer) so both requests arrive during it.
    c.post("/admin/faults", json={"load_delay_s": {"c": 1.0}}, headers=ADMIN)
    threads = [in_thread(lambda: chat(client_for(pool), "c")) for _ in range(4)]
    for t, _ in threads:
        t.join(60)
    assert [out[0].status_code for _, out in threads] == [200] * 4
    assert loads(pool, "c") == 1


def test_q8_0_model_decodes(start_pool: Callable[..., Pool]) -> None:
    """Guard for the AMX crash: a native llama.cpp build segfaults on the first quantized decode."""
    pool = start_pool()
    resp = chat(client_for(pool), "q8", max_tokens=16)
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["usage"]["completion_tokens"] == 16


def test_embeddings_one_vector_per_input(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool()
    resp = client_for(pool).post("/v1/embeddings", json={"model": "emb", "input": ["a", "bc", "d"]})
    assert resp.status_code == 200, resp.get_json()
    data = resp.get_json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    assert all(len(d["embedding"]) == 64 for d in data)


def test_embedding_and_llm_pools_are_separate(start_pool: Callable[..., Pool]) -> None:
    """Rule 2: limits are per type, so an embedding model never evicts a chat model."""
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    assert c.post("/v1/embeddings", json={"model": "emb", "input": "x"}).status_code == 200
    assert pool.resident() == {"a", "emb"}


def test_streaming_chat_sends_chunks_then_done(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool()
    resp = chat(client_for(pool), "a", stream=True, max_tokens=6)
    assert resp.status_code == 200
    assert resp.mimetype == "text/event-stream"
    events = [e for e in resp.get_data(as_text=True).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" and ch["model"] == "a" for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_failed_load_answers_the_waiting_request(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    c.post("/admin/faults", json={"fail_next_load": "b"}, headers=ADMIN)
    resp = chat(c, "b")
    assert resp.status_code == 500
    assert resp.get_json()["error"]["code"] == "model_load_failed"
    assert pool.state("b") == "failed"
    # The next request tries again, and the failure was one-shot.
    assert chat(c, "b").status_code == 200


@pytest.mark.parametrize("sig", ["SIGKILL"])
def test_killed_model_process_is_replaced(start_pool: Callable[..., Pool], sig: str) -> None:
    import os
    import signal

    pool = start_pool()
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    assert pid
    os.kill(pid, getattr(signal, sig))
    pool.wait_for(lambda: pool.state("a") == "unloaded", what="a reaped")
    assert chat(c, "a").status_code == 200
    assert pool.pid("a") not in (None, pid)


def test_admin_load_and_unload(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool(pool={"max_loaded_models": 2})
    c = client_for(pool)
    assert c.post("/admin/models/b/load", headers=ADMIN).status_code == 202
    pool.wait_for(lambda: pool.state("b") == "ready", what="b loaded by the admin")
    assert c.post("/admin/models/b/unload", headers=ADMIN).status_code == 202
    pool.wait_for(lambda: pool.state("b") == "unloaded", what="b unloaded by the admin")
    pool.wait_for(lambda: not pool.r.hexists(keys.explicit(), "b"), what="wish cleared")
    assert loads(pool, "b") == 1


def test_lowering_the_limit_shrinks_the_pool_without_a_new_load(
    start_pool: Callable[..., Pool],
) -> None:
    """Rule 4: a limit lowered from 3 to 1 with three idle residents shrinks the pool all the
    way, least recently used first, with no request and no load needed to trigger it."""
    pool = start_pool(pool={"max_loaded_models": 3})
    c = client_for(pool)
    for m in ("a", "b", "c"):
        assert chat(c, m).status_code == 200
    assert pool.resident() == {"a", "b", "c"}
    assert chat(c, "a").status_code == 200  # a is now the most recently used
    resp = c.patch("/admin/config", json={"pool": {"max_loaded_models": 1}}, headers=ADMIN)
    assert resp.status_code == 200
    pool.wait_for(lambda: pool.resident() == {"a"}, what="pool shrunk to the MRU model")
    assert loads(pool, "a") == 1
    evicted = pool.r.hget(keys.metric_counters(), 'residency_evictions_total|{"reason":"limit"}')
    assert float(str(evicted)) == 2
    # One pass did it all (3 -> 1, not 3 -> 2 -> ...), least recently used first.
    limit_evictions = [e for e in pool.coordinator.effects.evictions if e[2] == "limit"]
    assert [m for _, m, _ in limit_evictions] == ["b", "c"]
    assert len({n for n, _, _ in limit_evictions}) == 1


def test_health_is_one_record_and_a_stale_one_never_replaces_it(
    start_pool: Callable[..., Pool], redis_url: str
) -> None:
    """Rules 6 and 7: /health is one published record with its generation; a publish stamped
    with an older generation, or by a caller that lost the lease, is refused and leaves the
    record exactly as it was."""
    from coordinator.loop import Coordinator
    from residency.box import connect

    pool = start_pool()
    c = client_for(pool)
    h = c.get("/health").get_json()
    gen = h["generation"]
    assert gen >= 1 and h["max_models"]["llm"]["configured"] == 1
    # The lease goes to a coordinator that runs no passes, so the only publishes from here on
    # are the test's: the running one stands by at its next renewal.
    holder = Coordinator(pool.box, connect(redis_url))
    pool.r.set(keys.leader(), holder.lease_token, px=keys.LEADER_TTL_MS)
    pool.wait_for(lambda: not pool.coordinator.is_leader, what="the old leader standing by")
    before = pool.r.hgetall(keys.health())
    stored = int(before["generation"])
    assert stored >= gen
    record = {"status": "x"}
    assert holder.scripts.publish_health(stored - 1, record, lease=holder.lease_token) == "stale"
    old = pool.coordinator.lease_token
    assert pool.coordinator.scripts.publish_health(stored + 99, record, lease=old) == "not_leader"
    assert pool.r.hgetall(keys.health()) == before
    pool.r.delete(keys.leader())  # the running coordinator leads again
    resp = c.patch("/admin/config", json={"pool": {"max_loaded_models": 2}}, headers=ADMIN)
    newer = resp.get_json()["generation"]
    assert newer > gen
    pool.wait_for(
        lambda: c.get("/health").get_json()["max_models"]["llm"]["configured"] == 2,
        what="the change published",
    )
    assert c.get("/health").get_json()["generation"] > newer


def test_a_stale_pass_cannot_overwrite_health_or_the_floor(
    start_pool: Callable[..., Pool],
) -> None:
    """Rule 6: a pass that started before a change and publishes after it (a slow or paused
    reconcile) is dropped: /health keeps the newer floor and policy breakdown."""
    policy = {"candidates": ["a", "b"], "default": "a", "rules": []}
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    assert c.put("/admin/policies/p", json=policy, headers=ADMIN).status_code in (200, 201)
    pool.wait_for(
        lambda: c.get("/health").get_json()["llm_pool_autosize"]["candidate_floor"] == 2,
        what="the floor of policy p",
    )
    co = pool.coordinator
    # A pass begins: it takes its generation and reads the pool (policy p still there)...
    stale_gen = int(pool.r.incr(keys.generation()))
    stale = snapshot.read(pool.r, co.settings, time.time())
    assert stale.autosize.floor.floor == 2
    # ...meanwhile the policy is deleted and the leader publishes the newer state.
    assert c.delete("/admin/policies/p", headers=ADMIN).status_code == 200
    pool.wait_for(
        lambda: c.get("/health").get_json()["llm_pool_autosize"]["candidate_floor"] == 0,
        what="the floor without p",
    )
    # The stale pass finishes now: its record is refused.
    co.publish(stale_gen, snapshot.health_record(stale, co.settings), force=True)
    h = c.get("/health").get_json()
    assert h["generation"] > stale_gen
    assert h["llm_pool_autosize"]["candidate_floor"] == 0
    assert h["llm_pool_autosize"]["policies"] == {}
    assert h["max_models"]["llm"]["effective"] == 1


def test_a_load_goes_to_the_warm_standby_process(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    pool.wait_for(lambda: "cpu" in pool.agent.standbys, what="a warm process on cpu")
    warm_pid = pool.agent.standbys["cpu"].proc.pid
    assert chat(c, "a").status_code == 200
    assert pool.pid("a") == warm_pid
    # once the load is done, the next one gets a fresh warm process
    pool.wait_for(
        lambda: "cpu" in pool.agent.standbys and pool.agent.standbys["cpu"].proc.pid != warm_pid,
        what="a new warm process",
    )
    assert chat(c, "b").status_code == 200
    assert pool.pid("b") not in (None, warm_pid)
