"""Users, API keys, admin tokens and scopes against a real Redis and the real app: 401 without
a valid key where one is required, 403 outside a key's scopes, a revoke seen at once by every
web process, secrets stored only hashed, admin changes audited by token name, and a key that
may not load never loading or evicting anything in a real pool."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.serving import make_server

from residency import keys, policy_store, registry
from residency.box import Box
from residency.settings import ModelSpec
from tests.conftest import Pool
from tests.integration.test_pool import chat, client_for, loads
from web import create_app

ADMIN = "test-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def make_box(tmp_path: Path, redis_url: str, **env: str) -> Box:
    b = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url=redis_url,
        environ={"RESIDENCY_ADMIN_KEY": ADMIN, **env},
    )
    b.models_dir.mkdir(parents=True, exist_ok=True)
    return b


@pytest.fixture
def app_for(tmp_path: Path, redis_url: str, r: redis.Redis) -> Callable[..., Flask]:
    """An app over a registry of two chat models (``tiny``, ``tiny2``) and a policy ``auto``
    over both (no rules: it always picks its default, ``tiny2``). ``env``: settings."""

    def make(**env: str) -> Flask:
        box = make_box(tmp_path, redis_url, **env)
        for name in ("tiny", "tiny2"):
            (box.models_dir / f"{name}.gguf").write_bytes(b"GGUF")
            spec = ModelSpec(path=str(box.models_dir / f"{name}.gguf"))
            registry.put(r, registry.Entry(name, spec, "admin"), "test")
        spec = {"candidates": ["tiny", "tiny2"], "default": "tiny2"}
        policy_store.put(r, policy_store.PolicyEntry("auto", spec, "admin"), "test")
        return create_app(box)

    return make


def add_user(c: FlaskClient, name: str, **fields: Any) -> dict[str, Any]:
    resp = c.post("/admin/users", json={"name": name, **fields}, headers=AUTH)
    assert resp.status_code == 201, resp.get_json()
    return dict(resp.get_json()["user"])


def issue(c: FlaskClient, user: str, **scopes: Any) -> str:
    resp = c.post(f"/admin/users/{user}/keys", json=scopes, headers=AUTH)
    assert resp.status_code == 201, resp.get_json()
    return str(resp.get_json()["key"])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def err(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.get_data(as_text=True)
    e = resp.get_json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert e["code"] == code
    return dict(e)


def publish_health(r: redis.Redis) -> None:
    r.hset(keys.health(), mapping={"record": json.dumps({"models": []}), "generation": 1})


def every_value(r: redis.Redis) -> str:
    """Every key name and value in Redis, as one text to search."""
    out: list[str] = []
    for k in r.scan_iter():
        out.append(str(k))
        t = r.type(k)
        if t == "string":
            out.append(str(r.get(k)))
        elif t == "hash":
            out.append(json.dumps(r.hgetall(k)))
        elif t == "list":
            out.append(json.dumps(r.lrange(k, 0, -1)))
        elif t == "set":
            out.append(json.dumps(sorted(r.smembers(k))))  # type: ignore[arg-type]
        elif t == "zset":
            out.append(json.dumps(r.zrange(k, 0, -1)))
        elif t == "stream":
            out.append(str(r.xrange(k)))
    return "\n".join(out)


# --- keys: issue, store, use, revoke ----------------------------------------------------------


def test_key_is_shown_once_and_stored_hashed(app_for: Callable[..., Flask], r: redis.Redis) -> None:
    c = app_for().test_client()
    add_user(c, "alice")
    key = issue(c, "alice", label="laptop")
    assert key.startswith("rsk_")
    key_id, secret = key[len("rsk_") :].split("_")
    assert len(secret) == 64  # 32 random bytes, hex

    text = every_value(r)
    assert secret not in text and key not in text
    assert hashlib.sha256(secret.encode()).hexdigest() in text

    listed = c.get("/admin/keys", headers=AUTH).get_json()["keys"]
    assert [k["id"] for k in listed] == [key_id]
    assert set(listed[0]) == {
        "id", "user", "created", "label", "models", "policies", "may_load", "route_trace",
        "monitor", "quotas",
    }  # fmt: skip
    assert listed[0]["may_load"] is True and listed[0]["route_trace"] is False
    assert listed[0]["monitor"] is False
    shown = json.dumps(c.get("/admin/users/alice", headers=AUTH).get_json())
    assert secret not in shown and "hash" not in shown
    # The audit record of the issue holds no secret either (it is in Redis: checked above).
    actions = [a["action"] for a in c.get("/admin/audit", headers=AUTH).get_json()["audit"]]
    assert actions[:2] == ["key.issue", "user.add"]


def test_a_default_box_needs_a_valid_key(app_for: Callable[..., Flask], r: redis.Redis) -> None:
    c = app_for().test_client()  # keys are required by default, on loopback too
    publish_health(r)
    add_user(c, "alice")
    key = issue(c, "alice")

    for path in ("/v1/models", "/health", "/metrics"):
        resp = c.get(path)
        e = err(resp, 401, "invalid_api_key")
        assert e["type"] == "invalid_request_error"
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert c.get(path, headers=bearer("unused")).status_code == 401
        assert c.get(path, headers=AUTH).status_code == 200  # an admin token is a key too
    assert c.get("/v1/models", headers=bearer(key)).status_code == 200
    assert c.get("/v1/models", headers={"x-api-key": key}).status_code == 200
    err(c.post("/v1/chat/completions", json={"model": "tiny", **CHAT}), 401, "invalid_api_key")
    # The probes never need one (readyz: no coordinator here, so not ready, but not refused).
    assert c.get("/livez").status_code == 200
    assert c.get("/readyz").status_code == 503


def test_public_health(app_for: Callable[..., Flask], r: redis.Redis) -> None:
    c = app_for(RESIDENCY_AUTH_PUBLIC_HEALTH="true").test_client()
    publish_health(r)
    assert c.get("/health").status_code == 200
    assert c.get("/metrics").status_code == 200
    err(c.get("/v1/models"), 401, "invalid_api_key")
    # A key that is not valid is refused even where none is needed.
    err(
        c.get("/health", headers=bearer("rsk_" + "0" * 16 + "_" + "0" * 64)), 401, "invalid_api_key"
    )


def test_open_box_ignores_placeholders_but_refuses_bad_keys(
    app_for: Callable[..., Flask],
) -> None:
    c = app_for(RESIDENCY_AUTH_REQUIRED="false").test_client()
    assert c.get("/v1/models").status_code == 200
    assert c.get("/v1/models", headers=bearer("unused")).status_code == 200  # OpenAI clients
    add_user(c, "alice")
    key = issue(c, "alice")
    assert c.get("/v1/models", headers=bearer(key)).status_code == 200
    tampered = key[:-1] + ("0" if key[-1] != "0" else "1")
    for bad in (tampered, "rsk_" + "0" * 16 + "_" + "0" * 64, "rsk_garbage", "rsa_bob_00"):
        err(c.get("/v1/models", headers=bearer(bad)), 401, "invalid_api_key")


def test_revoke_is_seen_at_once_by_every_web_process(
    app_for: Callable[..., Flask],
) -> None:
    one = app_for().test_client()
    two = app_for().test_client()  # another web process
    add_user(one, "alice")
    key, other = issue(one, "alice"), issue(one, "alice")
    for c in (one, two):
        assert c.get("/v1/models", headers=bearer(key)).status_code == 200
    key_id = key.split("_")[1]
    resp = one.delete(f"/admin/keys/{key_id}", headers=AUTH)
    assert resp.get_json() == {"revoked": key_id, "user": "alice"}
    for c in (two, one):
        err(c.get("/v1/models", headers=bearer(key)), 401, "invalid_api_key")
        assert c.get("/v1/models", headers=bearer(other)).status_code == 200
    err(one.delete(f"/admin/keys/{key_id}", headers=AUTH), 404, "key_not_found")

    # Removing the user revokes its other keys, for every process, in the same step.
    resp = two.delete("/admin/users/alice", headers=AUTH)
    assert resp.get_json() == {"deleted": "alice", "revoked_keys": [other.split("_")[1]]}
    for c in (one, two):
        err(c.get("/v1/models", headers=bearer(other)), 401, "invalid_api_key")
    assert one.get("/admin/keys", headers=AUTH).get_json() == {"keys": []}


# --- scopes -----------------------------------------------------------------------------------


def test_key_limited_to_one_model(app_for: Callable[..., Flask], r: redis.Redis) -> None:
    c = app_for().test_client()
    add_user(c, "alice")
    key = issue(c, "alice", models=["tiny"], policies=[])
    h = bearer(key)
    e = err(c.post("/v1/chat/completions", json={"model": "tiny2", **CHAT}, headers=h), 403,
            "model_not_allowed")  # fmt: skip
    assert e["type"] == "permission_error" and e["param"] == "model" and "'tiny2'" in e["message"]
    err(c.post("/v1/completions", json={"model": "tiny2", "prompt": "x"}, headers=h), 403,
        "model_not_allowed")  # fmt: skip
    err(c.post("/v1/chat/completions", json={"model": "auto", **CHAT}, headers=h), 403,
        "model_not_allowed")  # fmt: skip
    assert [m["id"] for m in c.get("/v1/models", headers=h).get_json()["data"]] == ["tiny"]
    err(c.get("/v1/models/tiny2", headers=h), 403, "model_not_allowed")
    assert c.get("/v1/models/tiny", headers=h).status_code == 200
    # Unknown names stay 404; nothing was queued by any refusal.
    err(c.post("/v1/chat/completions", json={"model": "ghost", **CHAT}, headers=h), 404,
        "model_not_found")  # fmt: skip
    assert r.llen(keys.queue("tiny2")) == 0 and r.llen(keys.queue("tiny")) == 0


def test_policy_routing_to_a_model_outside_the_scopes(
    app_for: Callable[..., Flask], r: redis.Redis
) -> None:
    c = app_for().test_client()
    add_user(c, "alice")
    key = issue(c, "alice", models=["tiny"], policies=["auto"])
    resp = c.post("/v1/chat/completions", json={"model": "auto", **CHAT}, headers=bearer(key))
    e = err(resp, 403, "model_not_allowed")
    assert "policy 'auto'" in e["message"] and "'tiny2'" in e["message"]
    assert r.llen(keys.queue("tiny2")) == 0


def test_health_and_metrics_need_the_monitor_scope(
    app_for: Callable[..., Flask], r: redis.Redis
) -> None:
    """/health and /metrics show every model, host, device and error text (and per_user every
    user's counters): a key scoped to one model reads neither; a monitor key and the admin
    token do."""
    c = app_for().test_client()
    publish_health(r)
    add_user(c, "alice")
    scoped = bearer(issue(c, "alice", models=["tiny"]))
    unscoped = bearer(issue(c, "alice"))  # every model, still no monitor scope
    monitor = bearer(issue(c, "alice", monitor=True, models=[]))
    for path in ("/health", "/metrics"):
        for h in (scoped, unscoped):
            e = err(c.get(path, headers=h), 403, "monitor_not_allowed")
            assert e["type"] == "permission_error" and "--monitor" in e["message"]
        assert c.get(path, headers=monitor).status_code == 200
        assert c.get(path, headers=AUTH).status_code == 200
    # A monitor key with no models is no API key: a scrape key reads, never generates.
    err(c.post("/v1/chat/completions", json={"model": "tiny", **CHAT}, headers=monitor), 403,
        "model_not_allowed")  # fmt: skip
    # An open API (no keys required) does not open them: anonymous callers read neither.
    open_c = app_for(RESIDENCY_AUTH_REQUIRED="false").test_client()
    for path in ("/health", "/metrics"):
        err(open_c.get(path), 401, "invalid_api_key")
        err(open_c.get(path, headers=scoped), 403, "monitor_not_allowed")
        assert open_c.get(path, headers=monitor).status_code == 200


def test_model_scoped_keys_see_only_their_models(app_for: Callable[..., Flask]) -> None:
    """/v1/models (and /v1/models/{id}) list what a key may use: its models, and the policies
    it may use with only the candidates in its scope."""
    c = app_for().test_client()
    add_user(c, "alice")

    def listed(h: dict[str, str]) -> dict[str, Any]:
        resp = c.get("/v1/models", headers=h)
        assert resp.status_code == 200, resp.get_json()
        return {m["id"]: m for m in resp.get_json()["data"]}

    everything = listed(bearer(issue(c, "alice")))
    assert set(everything) == {"tiny", "tiny2", "auto"}
    assert (everything["auto"]["candidates"], everything["auto"]["default"]) == (
        ["tiny", "tiny2"],
        "tiny2",
    )
    h = bearer(issue(c, "alice", models=["tiny"]))  # every policy, one model
    mine = listed(h)
    assert set(mine) == {"tiny", "auto"}
    # The policy's other candidate (and its default) is outside the scope: not shown.
    assert (mine["auto"]["candidates"], mine["auto"]["default"]) == (["tiny"], None)
    assert c.get("/v1/models/auto", headers=h).get_json() == mine["auto"]
    err(c.get("/v1/models/tiny2", headers=h), 403, "model_not_allowed")
    # A key none of whose models a policy can route to does not see the policy at all.
    none = bearer(issue(c, "alice", models=["elsewhere"]))
    assert listed(none) == {}
    err(c.get("/v1/models/auto", headers=none), 403, "model_not_allowed")
    err(c.get("/v1/models/tiny", headers=none), 403, "model_not_allowed")


def test_reserved_user_names_are_refused(app_for: Callable[..., Flask], r: redis.Redis) -> None:
    c = app_for().test_client()
    for name in ("-", "admin:ops", "user:ops"):
        resp = c.post("/admin/users", json={"name": name}, headers=AUTH)
        e = err(resp, 400, "invalid_user")
        assert e["param"] == "name" and set(resp.get_json()["problems"]) == {"name"}
    assert not r.exists(keys.users())
    add_user(c, "anon")  # no reserved form: its subject is user:anon, not the anonymous one


def test_route_trace_needs_its_scope(app_for: Callable[..., Flask]) -> None:
    c = app_for().test_client()
    add_user(c, "alice")
    body = {"model": "tiny2", "route_trace": True, **CHAT}
    plain = bearer(issue(c, "alice", models=["tiny"]))
    e = err(c.post("/v1/chat/completions", json=body, headers=plain), 403,
            "route_trace_not_allowed")  # fmt: skip
    assert e["param"] == "route_trace" and "route_trace" in e["message"]
    # With the scope the trace passes, and the model scope is what refuses this request next.
    traced = bearer(issue(c, "alice", models=["tiny"], route_trace=True))
    err(c.post("/v1/chat/completions", json=body, headers=traced), 403, "model_not_allowed")


def test_key_without_may_load_never_loads_or_evicts(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200  # anonymous (this test's box needs no key): loads a
    pid_a = pool.pid("a")
    add_user(c, "bob")
    h = bearer(issue(c, "bob", may_load=False))

    resp = c.post("/v1/chat/completions", json={"model": "b", **CHAT}, headers=h)
    e = err(resp, 409, "model_not_resident")
    assert e["param"] == "model" and "'b'" in e["message"]
    assert pool.resident() == {"a"} and pool.pid("a") == pid_a
    assert pool.state("b") == "unloaded" and loads(pool, "b") == 0
    assert pool.r.llen(keys.queue("b")) == 0

    # A resident model serves it.
    resp = c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=h)
    assert resp.status_code == 200, resp.get_json()
    assert loads(pool, "a") == 1 and pool.pid("a") == pid_a
    assert pool.resident() == {"a"}


# --- admin tokens -----------------------------------------------------------------------------


def test_named_admin_tokens_are_audited_by_name(app_for: Callable[..., Flask]) -> None:
    c = app_for().test_client()
    tokens = {}
    for name in ("alice", "bob"):
        resp = c.post("/admin/tokens", json={"name": name}, headers=AUTH)
        assert resp.status_code == 201, resp.get_json()
        tokens[name] = resp.get_json()["token"]
    assert tokens["alice"].startswith("rsa_alice_")
    for name, token in tokens.items():
        resp = c.post("/admin/users", json={"name": f"u-{name}"}, headers=bearer(token))
        assert resp.status_code == 201
    c.post("/admin/users", json={"name": "u-default"}, headers=AUTH)
    audit = c.get("/admin/audit", headers=bearer(tokens["bob"])).get_json()["audit"]
    added = [(a["actor"], a["detail"]["name"]) for a in audit if a["action"] == "user.add"]
    assert added == [
        ("admin:default", "u-default"),
        ("admin:bob", "u-bob"),
        ("admin:alice", "u-alice"),
    ]
    listed = c.get("/admin/tokens", headers=AUTH).get_json()["tokens"]
    assert [(t["name"], t["builtin"]) for t in listed] == [
        ("default", True),
        ("alice", False),
        ("bob", False),
    ]
    assert "hash" not in json.dumps(listed)
    # An admin token is a key for the API too (every model).
    assert c.get("/v1/models", headers=bearer(tokens["alice"])).status_code == 200

    assert c.delete("/admin/tokens/alice", headers=bearer(tokens["bob"])).status_code == 200
    err(c.get("/admin/audit", headers=bearer(tokens["alice"])), 401, "invalid_admin_key")
    err(c.get("/v1/models", headers=bearer(tokens["alice"])), 401, "invalid_api_key")
    err(c.delete("/admin/tokens/default", headers=AUTH), 409, "builtin_token")
    err(c.post("/admin/tokens", json={"name": "default"}, headers=AUTH), 400, "invalid_token")
    err(c.post("/admin/tokens", json={"name": "bob"}, headers=AUTH), 409, "token_exists")
    # A user key is no admin token.
    c.post("/admin/users", json={"name": "carol"}, headers=AUTH)
    user_key = issue(c, "carol")
    err(c.get("/admin/users", headers=bearer(user_key)), 401, "invalid_admin_key")


# --- validation -------------------------------------------------------------------------------


def test_bad_bodies_change_nothing_and_name_the_field(
    app_for: Callable[..., Flask], r: redis.Redis
) -> None:
    c = app_for().test_client()
    resp = c.post("/admin/users", json={"name": "a b", "weight": 0, "color": 1}, headers=AUTH)
    e = err(resp, 400, "invalid_user")
    assert set(resp.get_json()["problems"]) == {"name", "weight", "color"}
    assert e["param"] in {"name", "weight", "color"}
    assert not r.exists(keys.users())

    add_user(c, "alice", weight=2, quotas={"requests_per_minute": 10})
    bad = {"models": ["ok", "no/slash"], "may_load": "yes", "quotas": {"tokens_per_day": -1}}
    resp = c.post("/admin/users/alice/keys", json=bad, headers=AUTH)
    err(resp, 400, "invalid_key")
    assert set(resp.get_json()["problems"]) == {
        "models[1]",
        "may_load",
        "quotas.tokens_per_day",
    }
    assert not r.exists(keys.api_keys())
    err(c.post("/admin/users/ghost/keys", json={}, headers=AUTH), 404, "user_not_found")
    err(c.post("/admin/users", json={"name": "alice"}, headers=AUTH), 409, "user_exists")

    # PATCH: quota fields not named are kept; null lifts one.
    resp = c.patch(
        "/admin/users/alice", json={"weight": 3, "quotas": {"concurrent": 2}}, headers=AUTH
    )
    assert resp.status_code == 200
    q = resp.get_json()["user"]["quotas"]
    assert (q["requests_per_minute"], q["concurrent"]) == (10, 2)
    resp = c.patch("/admin/users/alice", json={"quotas": {"requests_per_minute": None}},
                   headers=AUTH)  # fmt: skip
    assert resp.get_json()["user"]["quotas"]["requests_per_minute"] is None
    assert resp.get_json()["user"]["weight"] == 3
    err(c.patch("/admin/users/alice", json={"weight": -1}, headers=AUTH), 400, "invalid_user")
    err(c.patch("/admin/users/ghost", json={"weight": 1}, headers=AUTH), 404, "user_not_found")


def test_principal_carries_the_user_and_key(app_for: Callable[..., Flask], r: redis.Redis) -> None:
    """What other parts (quotas, fair queues, usage) read: ``flask.g.principal``."""
    from flask import g

    from web import auth

    app = app_for()
    c = app.test_client()
    add_user(c, "alice", weight=2.5, quotas={"concurrent": 3})
    key = issue(c, "alice", models=["tiny"], may_load=False, quotas={"tokens_per_day": 100})
    with app.test_request_context("/v1/models", headers=bearer(key)):
        assert auth.authenticate() is None
        p = g.principal
    assert (p.kind, p.name, p.key_id, p.weight) == ("user", "alice", key.split("_")[1], 2.5)
    assert p.subject == "user:alice"  # what usage, quotas and fair queues count it under
    assert p.models == frozenset({"tiny"}) and p.policies is None
    assert (p.may_load, p.route_trace) == (False, False)
    assert p.user_quotas.concurrent == 3 and p.key_quotas.tokens_per_day == 100


# --- the command line, over real HTTP ---------------------------------------------------------


@pytest.fixture
def served(app_for: Callable[..., Flask]) -> Iterator[str]:
    srv = make_server("127.0.0.1", 0, app_for(), threaded=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    t.join(10)


def cli(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
    env |= {"RESIDENCY_ADMIN_KEY": ADMIN, "RESIDENCY_DATA_DIR": str(tmp_path / "cli")}
    return subprocess.run(
        [sys.executable, "-m", "residency.cli", args[0], "--url", url, *args[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_cli_users_keys_tokens_round_trip(served: str, tmp_path: Path) -> None:
    ok = cli(served, tmp_path, "users", "add", "alice", "--weight", "2", "--quota",
             "requests_per_minute=60")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["user"]["quotas"]["requests_per_minute"] == 60
    res = cli(
        served, tmp_path, "keys", "issue", "alice", "--models", "tiny", "--policies", "",
        "--no-load",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    issued = json.loads(res.stdout)
    key, key_id = issued["key"], issued["api_key"]["id"]
    assert issued["api_key"]["models"] == ["tiny"] and issued["api_key"]["policies"] == []
    assert issued["api_key"]["may_load"] is False

    models = requests.get(served + "/v1/models", headers=bearer(key), timeout=10)
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    refused = requests.get(served + "/v1/models", timeout=10)
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"

    listed = json.loads(cli(served, tmp_path, "keys", "ls", "--user", "alice").stdout)
    assert [k["id"] for k in listed["keys"]] == [key_id] and key not in json.dumps(listed)
    assert cli(served, tmp_path, "keys", "revoke", key_id).returncode == 0
    assert requests.get(served + "/v1/models", headers=bearer(key), timeout=10).status_code == 401
    assert cli(served, tmp_path, "keys", "revoke", key_id).returncode == 1

    tok = json.loads(cli(served, tmp_path, "tokens", "add", "ops").stdout)["token"]
    assert requests.get(served + "/admin/users", headers=bearer(tok), timeout=10).ok
    names = [t["name"] for t in json.loads(cli(served, tmp_path, "tokens", "ls").stdout)["tokens"]]
    assert names == ["default", "ops"]
    assert cli(served, tmp_path, "tokens", "rm", "ops").returncode == 0

    users = json.loads(cli(served, tmp_path, "users", "ls").stdout)["users"]
    assert [u["name"] for u in users] == ["alice"] and users[0]["weight"] == 2.0
    assert cli(served, tmp_path, "users", "rm", "alice").returncode == 0
    assert json.loads(cli(served, tmp_path, "users", "ls").stdout) == {"users": []}
    assert cli(served, tmp_path, "users", "rm", "alice").returncode == 1


# --- keys, quotas and usage end to end ----------------------------------------------------------


def test_a_real_keys_quotas_are_enforced_and_its_usage_counted_under_its_user(
    start_pool: Callable[..., Pool],
) -> None:
    """Through the store, not a test hook: a user's quota and its key's quota both apply to
    requests carrying the key, the refusal names the quota, and what was served is counted
    under the user's name."""
    from tests.integration.test_usage import load_seconds_of, usage_of

    pool = start_pool()
    c = client_for(pool)
    add_user(c, "ann", quotas={"requests_per_minute": 3})
    h = bearer(issue(c, "ann", quotas={"requests_per_minute": 2}))
    answered = [c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=h)]
    answered.append(c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=h))
    assert [a.status_code for a in answered] == [200, 200]
    e = err(
        c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=h),
        429,
        "quota_exceeded",
    )
    assert "2 requests per minute" in e["message"], e
    # A second key of the same user: its own quota is fresh, the user's has one place left.
    h2 = bearer(issue(c, "ann"))
    third = c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=h2)
    assert third.status_code == 200
    answered.append(third)
    e = err(
        c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=h2),
        429,
        "quota_exceeded",
    )
    assert "user 'ann'" in e["message"] and "3 requests per minute" in e["message"], e

    usages = [a.get_json()["usage"] for a in answered]
    assert usage_of(pool.r, "user:ann", "a") == {
        "requests": 3,
        "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "completion_tokens": sum(u["completion_tokens"] for u in usages),
    }
    assert load_seconds_of(pool.r, "user:ann", "a") > 0  # her first request loaded the model


def test_an_admin_token_and_a_user_of_one_name_are_counted_apart(
    start_pool: Callable[..., Pool],
) -> None:
    """Usage, quotas and fair queues key by a namespaced subject: admin token ``ops`` used on
    /v1 is ``admin:ops``, user ``ops`` is ``user:ops``, so the token never spends the user's
    quota, and /admin/usage shows them apart (the user under its plain name)."""
    from tests.integration.test_usage import usage_of

    limit = 100  # tokens a day: a few of these requests, more than one
    pool = start_pool(auth={"required": True})
    c = client_for(pool)
    add_user(c, "ops", quotas={"tokens_per_day": limit})
    user = bearer(issue(c, "ops"))
    resp = c.post("/admin/tokens", json={"name": "ops"}, headers=AUTH)
    assert resp.status_code == 201, resp.get_json()
    admin = bearer(resp.get_json()["token"])

    def tokens(subject: str) -> int:
        u = usage_of(pool.r, subject, "a")
        return u.get("prompt_tokens", 0) + u.get("completion_tokens", 0)

    # The admin token spends more than the user's whole day (each request: tens of tokens)...
    spent = 0
    for _ in range(limit):
        resp = c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=admin)
        assert resp.status_code == 200, resp.get_json()
        spent += resp.get_json()["usage"]["total_tokens"]
        if spent >= limit:
            break
    # ...and the user still has all of it.
    first = c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=user)
    assert first.status_code == 200, first.get_json()
    assert tokens("admin:ops") == spent >= limit
    admin_requests = usage_of(pool.r, "admin:ops", "a")["requests"]
    assert usage_of(pool.r, "user:ops", "a")["requests"] == 1

    rep = c.get("/admin/usage", headers=AUTH).get_json()
    assert rep["users"]["ops"]["requests"] == 1
    assert rep["users"]["admin:ops"]["requests"] == admin_requests
    only = c.get("/admin/usage?user=ops", headers=AUTH).get_json()
    assert [x["user"] for x in only["rows"]] == ["ops"]
