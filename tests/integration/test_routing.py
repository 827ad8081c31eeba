"""Router policies and the autosized LLM pool, against real parts (Redis, coordinator, agent,
llama.cpp model processes on tiny models), requests through the Flask app."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from werkzeug.serving import make_server

from residency import keys
from tests.conftest import Pool, tiny_models
from tests.integration.test_pool import ADMIN, client_for, loads

CODE = {"id": "code", "match": {"keywords_any": ["def ", "class "]}, "route_to": "b"}
AUTO = {"candidates": ["a", "b"], "default": "a", "rules": [CODE]}


def ask(c: FlaskClient, model: str, text: str, **kw: Any) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return c.post("/v1/chat/completions", json={**body, **kw})


def alternate(c: FlaskClient, n: int) -> list[str]:
    routes = []
    for i in range(n):
        resp = ask(c, "auto", "def f(): pass" if i % 2 else "hello there")
        assert resp.status_code == 200, resp.get_json()
        routes.append(resp.headers["x-residency-route"])
    return routes


def health(c: FlaskClient) -> dict[str, Any]:
    return dict(c.get("/health").get_json())


def switches(c: FlaskClient) -> float:
    text = c.get("/metrics").get_data(as_text=True)
    for line in text.splitlines():
        if line.startswith('residency_routing_switches_total{policy="auto"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def put_policy(c: FlaskClient, name: str, spec: dict[str, Any]) -> Any:
    return c.put(f"/admin/policies/{name}", json=spec, headers=ADMIN)


def patch(c: FlaskClient, pool: dict[str, Any]) -> None:
    resp = c.patch("/admin/config", json={"pool": pool}, headers=ADMIN)
    assert resp.status_code == 200, resp.get_json()


def test_alternating_policy_keeps_both_candidates_resident_with_autosize(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    assert put_policy(c, "auto", AUTO).status_code == 201
    routes = alternate(c, 2)
    assert routes == ["auto:default:a", "auto:code:b"]
    pids = {"a": pool.pid("a"), "b": pool.pid("b")}
    alternate(c, 10)
    assert {"a": pool.pid("a"), "b": pool.pid("b")} == pids
    assert loads(pool, "a") == 1 and loads(pool, "b") == 1
    h = health(c)
    assert h["max_models"]["llm"] == {"configured": 1, "effective": 2}
    assert h["llm_pool_autosize"]["candidate_floor"] == 2
    assert h["llm_pool_autosize"]["exceeds_max_loaded_models"] is True
    advisory = h["llm_pool_autosize"]["advisory"]
    assert "llm_pool_autosize=false" in advisory and "auto_evict=true" in advisory


def test_without_autosize_alternation_reloads_on_every_switch(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1, "llm_pool_autosize": False})
    c = client_for(pool)
    put_policy(c, "auto", AUTO)
    alternate(c, 10)
    assert loads(pool, "a") == 5 and loads(pool, "b") == 5
    assert health(c)["max_models"]["llm"] == {"configured": 1, "effective": 1}


def test_turning_autosize_off_shrinks_a_full_pool_without_a_new_load(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    put_policy(c, "auto", AUTO)
    alternate(c, 2)
    assert pool.resident() == {"a", "b"}
    patch(c, {"llm_pool_autosize": False})
    pool.wait_for(lambda: len(pool.resident()) == 1, what="the pool shrunk to 1")
    assert pool.resident() == {"b"}  # b was used last: a, the LRU, was evicted
    assert loads(pool, "a") == 1 and loads(pool, "b") == 1
    alternate(c, 4)  # a, b, a, b: every switch reloads again
    assert loads(pool, "a") == 3 and loads(pool, "b") == 3


def test_floor_is_a_union_and_remote_candidates_do_not_count(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    models = tiny_models(models_dir)
    models["far"] = {"base_url": "http://127.0.0.1:9/v1"}
    pool = start_pool(models=models, pool={"max_loaded_models": 1})
    c = client_for(pool)
    put_policy(c, "auto", {"candidates": ["a", "b", "far"], "default": "a"})
    put_policy(c, "coding", {"candidates": ["b", "c"], "default": "b"})
    pool.wait_for(
        lambda: health(c)["llm_pool_autosize"]["candidate_floor"] == 3, what="floor 3 published"
    )
    h = health(c)["llm_pool_autosize"]
    assert h["policies"] == {"auto": 2, "coding": 2}
    assert health(c)["max_models"]["llm"]["effective"] == 3


def test_unresolvable_candidate_is_logged_and_still_counted(
    start_pool: Callable[..., Pool], models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    path = str(models_dir / "tiny2.gguf")
    assert c.put("/admin/models/extra", json={"path": path}, headers=ADMIN).status_code == 201
    put_policy(c, "auto", {"candidates": ["a", "extra"], "default": "a"})
    pool.wait_for(lambda: health(c)["llm_pool_autosize"]["candidate_floor"] == 2, what="floor 2")
    with caplog.at_level(logging.WARNING, logger="residency.coordinator"):
        assert c.delete("/admin/models/extra", headers=ADMIN).status_code == 200
        pool.wait_for(
            lambda: any("policy auto: candidate extra" in r.getMessage() for r in caplog.records),
            what="the unresolved candidate logged",
        )
    assert health(c)["llm_pool_autosize"]["candidate_floor"] == 2


def test_routing_helper_and_candidate_stay_resident_together(
    start_pool: Callable[..., Pool],
) -> None:
    """Rule 2: a routing helper has its own pool and never takes a standard slot."""
    pool = start_pool(pool={"max_loaded_models": 1, "llm_pool_autosize": False})
    c = client_for(pool)
    router = {"type": "llm", "model": "c", "prompt": "Pick a model.", "max_tokens": 16}
    judge = {"candidates": ["a", "b"], "default": "a", "router": router}
    assert put_policy(c, "judge", judge).status_code == 201
    resp = ask(c, "judge", "hello", route_trace=True)
    assert resp.status_code == 200, resp.get_json()
    # A random tiny model cannot answer the router contract: the default is used, and says so.
    assert resp.headers["x-residency-route"] == "judge:default:a"
    assert resp.get_json()["route_trace"]["used_default"] is True
    assert pool.resident() == {"a", "c"}
    h = {m["name"]: m for m in health(c)["models"]}
    assert h["c"]["pool"] == "helper" and h["a"]["pool"] == "standard"
    # No policy uses the helper any more: it is unloaded (it is idle).
    assert c.delete("/admin/policies/judge", headers=ADMIN).status_code == 200
    pool.wait_for(lambda: pool.state("c") == "unloaded", what="the unused helper unloaded")
    assert pool.state("a") == "ready"


def test_route_header_trace_and_stream_first_event(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool(pool={"max_loaded_models": 2})
    c = client_for(pool)
    put_policy(c, "auto", AUTO)
    resp = ask(c, "auto", "class X: pass", route_trace=True)
    assert resp.headers["x-residency-route"] == "auto:code:b"
    body = resp.get_json()
    assert body["model"] == "b"
    assert body["route_trace"]["rule"] == "code"
    resp = ask(c, "auto", "hi", stream=True, route_trace=True)
    assert resp.headers["x-residency-route"] == "auto:default:a"
    events = [e for e in resp.get_data(as_text=True).split("\n\n") if e]
    first = json.loads(events[0].removeprefix("data: "))
    assert first["route_trace"]["used_default"] is True
    assert "route_trace" not in json.loads(events[1].removeprefix("data: "))
    assert events[-1] == "data: [DONE]"
    ids = {m["id"]: m for m in c.get("/v1/models").get_json()["data"]}
    assert ids["auto"]["type"] == "policy" and ids["auto"]["candidates"] == ["a", "b"]
    v = c.post(
        "/admin/policies/validate",
        json={"policy": "auto", "request": {"messages": [{"role": "user", "content": "def g"}]}},
        headers=ADMIN,
    ).get_json()
    assert (v["candidate"], v["rule"]) == ("b", "code")
    # A conversation whose next turn goes to another candidate counts one switch.
    before = switches(c)
    turn = [{"role": "user", "content": "hello"}]
    c.post("/v1/chat/completions", json={"model": "auto", "messages": turn, "max_tokens": 2})
    turn += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "def f(): 1"}]
    c.post("/v1/chat/completions", json={"model": "auto", "messages": turn, "max_tokens": 2})
    metrics = c.get("/metrics").get_data(as_text=True)
    assert 'residency_routing_decisions_total{policy="auto",rule="code"}' in metrics
    assert switches(c) == before + 1


def test_bad_policy_is_rejected_naming_the_field(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool()
    c = client_for(pool)
    resp = put_policy(c, "auto", {"candidates": ["a", "a"], "default": "z"})
    assert resp.status_code == 400
    assert resp.get_json()["error"]["code"] == "invalid_policy"
    assert resp.get_json()["error"]["param"]
    assert put_policy(c, "a", {"candidates": ["a"], "default": "a"}).status_code == 400


@pytest.fixture
def remote_server(start_pool: Callable[..., Pool]) -> Iterator[tuple[Pool, str]]:
    """A second OpenAI-compatible server: this box's own web app on a real socket, so a remote
    model entry can point at it."""
    pool = start_pool(pool={"max_loaded_models": 2}, server={"allow_local_remotes": True})
    server = make_server("127.0.0.1", 0, create_remote_app(pool), threaded=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield pool, f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()
    t.join(10)


def create_remote_app(pool: Pool) -> Any:
    from web.app import create_app

    return create_app(pool.box)


def test_remote_candidate_is_forwarded_streaming_too(remote_server: tuple[Pool, str]) -> None:
    pool, url = remote_server
    c = client_for(pool)
    assert (
        c.put(
            "/admin/models/far", json={"base_url": url, "remote_model": "b"}, headers=ADMIN
        ).status_code
        == 201
    )
    put_policy(c, "mixed", {"candidates": ["a", "far"], "default": "far"})
    resp = ask(c, "mixed", "hello")
    assert resp.status_code == 200, resp.get_json()
    assert resp.headers["x-residency-route"] == "mixed:default:far"
    assert resp.get_json()["model"] == "far"
    assert pool.state("b") == "ready"  # served by the "remote" box
    resp = ask(c, "far", "hello", stream=True)
    events = [e for e in resp.get_data(as_text=True).split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert health(c)["llm_pool_autosize"]["candidate_floor"] == 1


def test_risky_state_warning_fires_once_per_entry(
    start_pool: Callable[..., Pool], caplog: pytest.LogCaptureFixture
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)

    def warnings() -> int:
        return sum(
            1
            for r in caplog.records
            if r.levelno == logging.WARNING and "llm_pool_autosize=false" in r.getMessage()
        )

    def settle() -> None:
        gen = int(pool.r.get(keys.generation()) or 0)
        passes = pool.coordinator.passes
        pool.wait_for(
            lambda: pool.coordinator.passes >= passes + 2 and int(health(c)["generation"]) > gen,
            what="the change seen by the coordinator",
        )

    with caplog.at_level(logging.INFO, logger="residency.coordinator"):
        settle()
        assert warnings() == 0
        put_policy(c, "auto", AUTO)  # floor 2 > max_loaded_models 1, auto_evict off: entered
        settle()
        assert warnings() == 1
        patch(c, {"max_queue_per_model": 10})  # unrelated
        put_policy(c, "other", {"candidates": ["a"], "default": "a"})  # floor unchanged
        settle()
        assert warnings() == 1
        patch(c, {"auto_evict": True})  # left: a memory backstop exists
        settle()
        assert warnings() == 1
        patch(c, {"auto_evict": False})  # entered again
        settle()
        assert warnings() == 2


def test_file_policy_and_one_time_upgrade_notice(
    start_pool: Callable[..., Pool], r: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A data dir that ran before autosize existed (a generation, no config-version marker)
    gets one notice on its first start in the risky state, and never again."""
    r.set(keys.generation(), 41)  # an existing data dir from before the marker
    with caplog.at_level(logging.INFO, logger="residency.coordinator"):
        pool = start_pool(pool={"max_loaded_models": 1}, policies={"auto": AUTO})
        c = client_for(pool)
        pool.wait_for(lambda: health(c)["max_models"]["llm"]["effective"] == 2, what="floor")
        notices = [m for m in caplog.messages if m.startswith("upgrade notice")]
        assert len(notices) == 1 and "llm_pool_autosize=false" in notices[0]
        assert any(m.startswith("LLM limit is 2") for m in caplog.messages)
    assert r.hget(keys.autosize_state(), "config_version") == "2"
    assert c.get("/admin/policies/auto", headers=ADMIN).get_json()["source"] == "file"


def test_memory_pressure_evicts_idle_models_by_score_never_busy_or_pinned(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(pool={"max_loaded_models": -1}, debug={"fault_injection": True})
    c = client_for(pool)
    for m in ("a", "b", "c"):
        assert ask(c, m, "x").status_code == 200
    c.post("/admin/models/b/pin", json={"pinned": True}, headers=ADMIN)
    c.post("/admin/faults", json={"hold": {"c": True}}, headers=ADMIN)
    t = threading.Thread(target=lambda: ask(client_for(pool), "c", "busy"), daemon=True)
    t.start()
    pool.wait_for(lambda: pool.r.llen(keys.processing("c")) == 1, what="c busy")
    patch(c, {"auto_evict": True})  # threshold 0.9: real memory use here stays below it
    c.post("/admin/faults", json={"memory_pressure": 0.99}, headers=ADMIN)
    pool.wait_for(lambda: pool.state("a") == "unloaded", what="a evicted under pressure")
    passes = pool.coordinator.passes
    pool.wait_for(lambda: pool.coordinator.passes >= passes + 4, what="more passes")
    assert pool.state("b") == "ready" and pool.state("c") == "ready"  # pinned, busy
    c.post("/admin/faults", json={"hold": {"c": False}, "memory_pressure": 0}, headers=ADMIN)
    t.join(30)
    evicted = pool.r.hget(keys.metric_counters(), 'residency_evictions_total|{"reason":"memory"}')
    assert float(str(evicted)) == 1
