"""No way in from a web page, over real HTTP (a threaded server running the real app) against a
real Redis: a "simple" cross-origin POST (``text/plain``) is refused 415 before anything is
queued, a request carrying a rebinding page's ``Host`` is refused 421 (probes included), a
foreign ``Origin`` 403 unless ``server.cors_origins`` lists it — and the box's own callers
(loopback names, the bind address, listed names, the dashboard's same-origin calls) get through.

The box of these tests takes keyless API calls (``[auth] required = false``, as the loopback demo
does): what stops a page here is these checks, not a key. A "fake model process" thread answers
the requests that get through (tests/integration/test_web_http.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
from werkzeug.serving import make_server

from residency import keys, registry
from residency.box import Box
from residency.messages import ReplyType, Request
from residency.settings import ModelSpec
from residency.work import add_reply
from tests.integration.test_web_http import FakeModel
from web import create_app

ADMIN = "test-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ANSWER = {"id": "x", "object": "chat.completion", "model": "/m/tiny.gguf", "choices": []}


def answer(r: redis.Redis, req: Request) -> None:
    add_reply(r, req.id, ReplyType.DONE, ANSWER)


@pytest.fixture
def serve_box(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> Iterator[Callable[..., tuple[str, int]]]:
    """Starts the real app on a real socket with settings ``env``; returns (url, port)."""
    servers: list[Any] = []

    def start(**env: str) -> tuple[str, int]:
        box = Box(
            data_dir=tmp_path,
            config_path=None,
            redis_url=redis_url,
            environ={
                "RESIDENCY_ADMIN_KEY": ADMIN,
                "RESIDENCY_AUTH_REQUIRED": "false",
                # A request that got through by mistake and found no model answers fast.
                "RESIDENCY_SERVER_REQUEST_TIMEOUT_S": "3",
                **env,
            },
        )
        box.models_dir.mkdir(parents=True, exist_ok=True)
        (box.models_dir / "tiny.gguf").write_bytes(b"GGUF")
        spec = ModelSpec(path=str(box.models_dir / "tiny.gguf"))
        registry.put(r, registry.Entry("tiny", spec, "admin"), "test")
        srv = make_server("127.0.0.1", 0, create_app(box), threaded=True)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        servers.append((srv, t))
        return f"http://127.0.0.1:{srv.server_port}", srv.server_port

    yield start
    for srv, t in servers:
        srv.shutdown()
        t.join(10)


def err(resp: requests.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    e = resp.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == code
    return dict(e)


def queued(r: redis.Redis) -> int:
    return int(r.llen(keys.queue("tiny")))


# --- Content-Type ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None],
)
def test_a_simple_post_is_refused_415_and_queues_nothing(
    serve_box: Callable[..., tuple[str, int]], r: redis.Redis, content_type: str | None
) -> None:
    # What any web page can send without a preflight: a JSON text as text/plain.
    url, _ = serve_box()
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/v1/chat/completions", "/v1/completions"):
        resp = requests.post(url + path, data=json.dumps(CHAT), headers=headers, timeout=30)
        e = err(resp, 415, "unsupported_media_type")
        assert e["param"] == "Content-Type"
    assert queued(r) == 0
    # The admin API too, and PATCH/PUT (a key is no excuse for a non-JSON body).
    resp = requests.post(url + "/admin/users", data='{"name": "x"}', headers={**AUTH, **headers})
    err(resp, 415, "unsupported_media_type")
    assert not r.exists(keys.users())
    resp = requests.patch(
        url + "/admin/config", data='{"pool": {"max_loaded_models": 3}}', headers=headers
    )
    err(resp, 415, "unsupported_media_type")
    # A call with no body has no type to check (every such route needs the admin token).
    resp = requests.post(url + "/admin/models/tiny/load", headers=AUTH, timeout=30)
    assert resp.status_code == 202, resp.text


def test_a_json_post_with_parameters_is_served(
    serve_box: Callable[..., tuple[str, int]], r: redis.Redis
) -> None:
    url, _ = serve_box()
    fake = FakeModel(r, "tiny", answer)
    fake.start()
    resp = requests.post(
        url + "/v1/chat/completions",
        data=json.dumps(CHAT),
        headers={"Content-Type": "application/json; charset=utf-8"},
        timeout=30,
    )
    fake.join(10)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "tiny" and fake.request is not None


# --- Host --------------------------------------------------------------------------------------


def test_a_foreign_host_is_refused_421_everywhere(
    serve_box: Callable[..., tuple[str, int]], r: redis.Redis
) -> None:
    # A DNS-rebinding page: its name now resolves to 127.0.0.1, and its requests say so.
    url, port = serve_box()
    evil = {"Host": f"evil.example:{port}"}
    resp = requests.post(url + "/v1/chat/completions", json=CHAT, headers=evil, timeout=30)
    e = err(resp, 421, "misdirected_request")
    assert e["param"] == "Host" and "server.allowed_hosts" in e["message"]
    assert queued(r) == 0
    for path in ("/v1/models", "/livez", "/readyz", "/health", "/admin/ui", "/openapi.json"):
        err(requests.get(url + path, headers=evil, timeout=30), 421, "misdirected_request")
    resp = requests.get(url + "/admin/config", headers={**evil, **AUTH}, timeout=30)
    err(resp, 421, "misdirected_request")


def test_loopback_names_and_listed_hosts_are_answered(
    serve_box: Callable[..., tuple[str, int]],
) -> None:
    url, port = serve_box(RESIDENCY_SERVER_ALLOWED_HOSTS='["web", "box.example"]')
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        "localhost",
        f"[::1]:{port}",
        "127.0.0.2",
        "web:8000",  # a Compose probe, or Prometheus scraping the service by name
        "BOX.example",
    ):
        resp = requests.get(url + "/livez", headers={"Host": host}, timeout=30)
        assert resp.status_code == 200, (host, resp.text)
        assert requests.get(url + "/v1/models", headers={"Host": host}, timeout=30).ok
    err(
        requests.get(url + "/livez", headers={"Host": "other.example"}, timeout=30),
        421,
        "misdirected_request",
    )


# --- Origin ------------------------------------------------------------------------------------


def test_a_foreign_origin_is_refused_403_and_a_listed_one_served(
    serve_box: Callable[..., tuple[str, int]], r: redis.Redis
) -> None:
    url, port = serve_box(RESIDENCY_SERVER_CORS_ORIGINS='["https://app.example"]')
    foreign = {"Origin": "https://evil.example"}
    resp = requests.post(url + "/v1/chat/completions", json=CHAT, headers=foreign, timeout=30)
    e = err(resp, 403, "origin_not_allowed")
    assert e["param"] == "Origin" and "server.cors_origins" in e["message"]
    assert "Access-Control-Allow-Origin" not in resp.headers
    err(requests.get(url + "/v1/models", headers=foreign, timeout=30), 403, "origin_not_allowed")
    resp = requests.options(
        url + "/v1/chat/completions",
        headers={**foreign, "Access-Control-Request-Method": "POST"},
        timeout=30,
    )
    err(resp, 403, "origin_not_allowed")
    for other in ("null", "http://app.example", f"http://127.0.0.1:{port + 1}"):
        err(
            requests.get(url + "/v1/models", headers={"Origin": other}, timeout=30),
            403,
            "origin_not_allowed",
        )
    assert queued(r) == 0

    # The listed origin: its preflight is answered, and its calls with the CORS headers.
    listed = {"Origin": "https://app.example"}
    pre = requests.options(
        url + "/v1/chat/completions",
        headers={
            **listed,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )
    assert pre.status_code == 204
    assert pre.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "content-type" in pre.headers["Access-Control-Allow-Headers"].lower()
    fake = FakeModel(r, "tiny", answer)
    fake.start()
    resp = requests.post(url + "/v1/chat/completions", json=CHAT, headers=listed, timeout=30)
    fake.join(10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"

    # The box's own pages (the dashboard) call it same-origin: Origin = the Host it was reached at.
    own = {"Origin": f"http://127.0.0.1:{port}"}
    assert requests.get(url + "/v1/models", headers=own, timeout=30).ok
    resp = requests.post(url + "/admin/users", json={"name": "alice"}, headers={**own, **AUTH})
    assert resp.status_code == 201, resp.text
    assert "Access-Control-Allow-Origin" not in resp.headers  # needs none
