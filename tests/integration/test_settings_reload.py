"""Web settings against a real Redis: reloaded on admin changes (the config generation) and file
edits, never on coordinator passes; a broken config file keeps the last good settings and is
named in /health; restart-only keys are neither patchable nor read from the admin overrides."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from residency import keys, registry
from residency.box import Box
from residency.settings import ModelSpec
from tests.conftest import OPEN_AUTH_ENV, write_config
from web import create_app
from web.state import EXTENSION, State

ADMIN = "test-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
GOOD = {"server": {"max_request_bytes": 4096}, "pool": {"max_queue_per_model": 7}}


@pytest.fixture
def box(tmp_path: Path, redis_url: str, r: redis.Redis) -> Box:
    b = Box(
        data_dir=tmp_path / "data",
        config_path=write_config(tmp_path / "config.toml", GOOD),
        redis_url=redis_url,
        # A short reply timeout, so that a request that reaches a queue fails fast.
        environ={
            **OPEN_AUTH_ENV,
            "RESIDENCY_ADMIN_KEY": ADMIN,
            "RESIDENCY_SERVER_REQUEST_TIMEOUT_S": "5",
        },
    )
    b.models_dir.mkdir(parents=True)
    (b.models_dir / "tiny.gguf").write_bytes(b"GGUF")
    registry.put(
        r, registry.Entry("tiny", ModelSpec(path=str(b.models_dir / "tiny.gguf")), "file"), "test"
    )
    # A published health record, as the coordinator leaves one.
    record = {"status": "ok", "models": []}
    r.hset(keys.health(), mapping={"generation": 1, "record": json.dumps(record)})
    return b


@pytest.fixture
def app(box: Box) -> Flask:
    return create_app(box)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def state_of(app: Flask) -> State:
    st = app.extensions[EXTENSION]
    assert isinstance(st, State)
    return st


def big_body() -> dict[str, Any]:
    """A chat body over GOOD's 4096-byte limit: 413 while GOOD is in force, else 400 (its
    ``n`` is invalid, so it never waits for a model)."""
    return {"model": "tiny", "n": "bad", "messages": [{"role": "user", "content": "x" * 5000}]}


UNKNOWN = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}


def admin_config(client: FlaskClient) -> dict[str, Any]:
    resp = client.get("/admin/config", headers=AUTH)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return dict(resp.get_json())


def test_coordinator_passes_cause_no_reload(
    app: Flask, client: FlaskClient, r: redis.Redis
) -> None:
    st = state_of(app)
    assert client.post("/v1/chat/completions", json=big_body()).status_code == 413
    loaded = st.reloads
    assert loaded == 1
    for _ in range(5):
        r.incr(keys.generation())  # what every coordinator pass does
        assert client.post("/v1/chat/completions", json=big_body()).status_code == 413
        # A request that looks its model up (the one round trip of every API request).
        assert client.post("/v1/chat/completions", json=UNKNOWN).status_code == 404
        assert admin_config(client)["config"]["server"]["max_request_bytes"] == 4096
    assert st.reloads == loaded
    # An admin change moves the config generation: exactly one reload, and it applies.
    resp = client.patch(
        "/admin/config", json={"server": {"max_request_bytes": 65536}}, headers=AUTH
    )
    assert resp.status_code == 200
    assert st.reloads == loaded + 1
    assert client.post("/v1/chat/completions", json=big_body()).status_code == 400
    assert st.reloads == loaded + 1


def test_every_admin_change_bumps_the_config_generation(
    client: FlaskClient, box: Box, r: redis.Redis
) -> None:
    def cgen() -> int:
        return int(r.get(keys.config_generation()) or 0)

    changes: list[Callable[[], Any]] = [
        lambda: client.patch("/admin/config", json={"pool": {"auto_evict": True}}, headers=AUTH),
        lambda: client.put("/admin/models/new", json={"path": "tiny.gguf"}, headers=AUTH),
        lambda: client.post("/admin/models/new/pin", json={"pinned": True}, headers=AUTH),
        lambda: client.put(
            "/admin/policies/auto", json={"candidates": ["tiny"], "default": "tiny"}, headers=AUTH
        ),
        lambda: client.delete("/admin/policies/auto", headers=AUTH),
        lambda: client.delete("/admin/models/new", headers=AUTH),
    ]
    for change in changes:
        before, pass_before = cgen(), int(r.get(keys.generation()) or 0)
        resp = change()
        assert resp.status_code in (200, 201), resp.get_data(as_text=True)
        assert cgen() == before + 1
        # The pass generation still moves with each change, as /health readers expect.
        assert resp.get_json()["generation"] == pass_before + 1


def test_a_broken_config_file_keeps_the_last_good_settings(
    app: Flask, client: FlaskClient, box: Box, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    assert client.get("/health").get_json()["config_error"] is None
    assert box.config_path is not None
    box.config_path.write_text(
        "[pool]\nmax_loaded_models = 0\n[server]\nmax_request_bytes = 4096\n"
    )
    # An admin change while the file is broken: accepted (checked against the last good
    # settings), and its reload fails without breaking anything.
    resp = client.patch("/admin/config", json={"pool": {"auto_evict": True}}, headers=AUTH)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    with caplog.at_level(logging.ERROR, logger="web.state"):
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=big_body()).status_code == 413
            cfg = admin_config(client)
            assert cfg["config"]["pool"]["max_queue_per_model"] == 7  # the good file's value
            assert "pool.max_loaded_models" in cfg["config_error"]
            health = client.get("/health")
            assert health.status_code == 200
            assert "pool.max_loaded_models" in health.get_json()["config_error"]
    logged = [x for x in caplog.records if "keeping the last good settings" in x.getMessage()]
    assert len(logged) == 1  # once per problem, not once per request

    # Malformed TOML is named too.
    box.config_path.write_text("[pool\n")
    assert "not valid TOML" in client.get("/health").get_json()["config_error"]

    # Fixed on disk: picked up without an admin change, and the problem is cleared.
    write_config(box.config_path, {**GOOD, "pool": {"max_queue_per_model": 9}})
    assert client.get("/health").get_json()["config_error"] is None
    cfg = admin_config(client)
    assert cfg["config"]["pool"]["max_queue_per_model"] == 9
    assert cfg["config"]["pool"]["auto_evict"] is True  # the admin change made meanwhile
    assert cfg["config_error"] is None


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("server", "model_dirs", ["/"]), ("debug", "fault_injection", True)],
)
def test_restart_only_keys_are_refused_and_stored_overrides_ignored(
    client: FlaskClient, r: redis.Redis, tmp_path: Path, section: str, key: str, value: Any
) -> None:
    dotted = f"{section}.{key}"
    resp = client.patch("/admin/config", json={section: {key: value}}, headers=AUTH)
    assert resp.status_code == 400
    err = resp.get_json()["error"]
    assert err["param"] == dotted and "restart-only" in err["message"]
    assert r.hgetall(keys.config_admin()) == {}

    # A value that got into the admin overrides anyway (an older version, or Redis access) is
    # not applied; a config change makes web reload and read the overrides again.
    r.hset(keys.config_admin(), dotted, json.dumps(value))
    assert (
        client.patch("/admin/config", json={"pool": {"auto_evict": True}}, headers=AUTH).status_code
        == 200
    )
    cfg = admin_config(client)
    assert cfg["config"][section][key] == ([] if key == "model_dirs" else False)
    assert cfg["sources"][dotted] == "default"
    if key == "model_dirs":
        outside = tmp_path / "outside.gguf"
        outside.write_bytes(b"GGUF")
        resp = client.put("/admin/models/x", json={"path": str(outside)}, headers=AUTH)
        assert resp.status_code == 400
        assert resp.get_json()["error"]["code"] == "path_not_allowed"
    else:
        resp = client.post("/admin/faults", json={"memory_pressure": 0.5}, headers=AUTH)
        assert resp.status_code == 404
        assert r.hgetall(keys.faults()) == {}
