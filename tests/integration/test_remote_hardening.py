"""The remote forwarder against a real HTTP server on loopback: redirects are not followed,
local targets are refused unless allowed, error bodies that are not the envelope are a 502,
and only ``RESIDENCY_REMOTE_*`` variables are ever sent as an API key."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask, Response, jsonify, request
from flask.testing import FlaskClient
from werkzeug.serving import make_server

from residency import registry
from residency.box import Box
from residency.settings import STORED, ModelSpec
from tests.conftest import OPEN_AUTH_ENV
from web import create_app

ADMIN = "test-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PATH = "/v1/chat/completions"


class Remote:
    """An OpenAI-compatible server whose first path segment picks its behaviour."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.auth: list[str | None] = []
        app = Flask("remote")

        @app.post("/<kind>" + PATH)
        def chat(kind: str) -> Any:
            self.hits.append(kind)
            self.auth.append(request.headers.get("Authorization"))
            if kind == "redirect":
                return Response(status=307, headers={"Location": f"/ok{PATH}"})
            if kind == "text500":
                return Response("upstream meltdown", status=500, mimetype="text/plain")
            if kind == "text400":
                return Response("bad thing", status=400, mimetype="text/plain")
            if kind == "json400":
                err = {"message": "prompt too long", "type": "x", "code": "context_length"}
                return jsonify({"error": err}), 400
            return jsonify(
                {
                    "id": "r",
                    "object": "chat.completion",
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hi"},
                            "finish_reason": "stop",
                        }
                    ],
                }
            )

        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, kind: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server.server_port}/{kind}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join(10)


@pytest.fixture
def remote() -> Iterator[Remote]:
    srv = Remote()
    yield srv
    srv.close()


def make_client(tmp_path: Path, redis_url: str, *, allow_local: bool) -> FlaskClient:
    env = {
        **OPEN_AUTH_ENV,
        "RESIDENCY_ADMIN_KEY": ADMIN,
        "RESIDENCY_SERVER_REQUEST_TIMEOUT_S": "10",
    }
    if allow_local:
        env["RESIDENCY_SERVER_ALLOW_LOCAL_REMOTES"] = "true"
    box = Box(data_dir=tmp_path, config_path=None, redis_url=redis_url, environ=env)
    return create_app(box).test_client()


def register(r: redis.Redis, name: str, base_url: str, **extra: Any) -> None:
    spec = ModelSpec.model_validate({"base_url": base_url, **extra}, context={STORED: True})
    registry.put(r, registry.Entry(name, spec, "admin"), "test")


def ask(client: FlaskClient, model: str) -> Any:
    return client.post(PATH, json={"model": model, "messages": [{"role": "user", "content": "x"}]})


def error_of(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


def test_local_targets_are_refused_unless_allowed(
    tmp_path: Path, redis_url: str, r: redis.Redis, remote: Remote
) -> None:
    register(r, "loop", remote.url("ok"))
    register(r, "loop-name", remote.url("ok", host="localhost"))
    register(r, "loop6", "http://[::1]:9/v1")
    register(r, "metadata", "http://169.254.169.254/latest/v1")
    register(r, "zero", "http://0.0.0.0:9/v1")
    strict = make_client(tmp_path, redis_url, allow_local=False)
    for name in ("loop", "loop-name", "loop6", "metadata", "zero"):
        err = error_of(ask(strict, name), 502)
        assert err["code"] == "remote_address_refused"
        assert "server.allow_local_remotes" in err["message"]
    assert remote.hits == []  # nothing was sent

    allowed = make_client(tmp_path, redis_url, allow_local=True)
    resp = ask(allowed, "loop")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.get_json()["model"] == "loop"
    assert remote.hits == ["ok"]


def test_redirects_are_not_followed(
    tmp_path: Path, redis_url: str, r: redis.Redis, remote: Remote
) -> None:
    register(r, "moved", remote.url("redirect"))
    err = error_of(ask(make_client(tmp_path, redis_url, allow_local=True), "moved"), 502)
    assert err["code"] == "bad_gateway" and "redirect" in err["message"]
    assert remote.hits == ["redirect"]  # the target of the redirect was never asked


def test_remote_errors_keep_the_envelope(
    tmp_path: Path, redis_url: str, r: redis.Redis, remote: Remote
) -> None:
    client = make_client(tmp_path, redis_url, allow_local=True)
    for kind in ("text500", "text400", "json400"):
        register(r, kind, remote.url(kind))
    err = error_of(ask(client, "text500"), 502)
    assert err["code"] == "bad_gateway" and "upstream meltdown" in err["message"]
    err = error_of(ask(client, "text400"), 502)
    assert "HTTP 400" in err["message"] and "bad thing" in err["message"]
    err = error_of(ask(client, "json400"), 400)  # a client error in the envelope keeps its status
    assert err["code"] == "context_length" and "prompt too long" in err["message"]


def test_only_remote_prefixed_variables_are_sent_as_keys(
    tmp_path: Path,
    redis_url: str,
    r: redis.Redis,
    remote: Remote,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RESIDENCY_ADMIN_KEY", "the-admin-secret")
    monkeypatch.setenv("RESIDENCY_REMOTE_TEST_KEY", "remote-secret")
    client = make_client(tmp_path, redis_url, allow_local=True)
    resp = client.put(
        "/admin/models/leaky",
        json={"base_url": remote.url("ok"), "api_key_env": "RESIDENCY_ADMIN_KEY"},
        headers=AUTH,
    )
    err = error_of(resp, 400)
    assert err["param"] == "api_key_env" and "RESIDENCY_REMOTE_" in err["message"]

    # An entry stored before the rule existed is refused when used, and nothing is sent.
    register(r, "legacy", remote.url("ok"), api_key_env="RESIDENCY_ADMIN_KEY")
    err = error_of(ask(client, "legacy"), 500)
    assert err["code"] == "remote_key_refused" and "RESIDENCY_REMOTE_" in err["message"]
    assert remote.hits == []

    resp = client.put(
        "/admin/models/good",
        json={"base_url": remote.url("ok"), "api_key_env": "RESIDENCY_REMOTE_TEST_KEY"},
        headers=AUTH,
    )
    assert resp.status_code == 201, resp.get_data(as_text=True)
    assert ask(client, "good").status_code == 200
    assert remote.auth == ["Bearer remote-secret"]
