"""The web role's HTTP layer against a real Redis: envelopes, limits, admin API, the reply bus.

A "fake model process" here is a thread that pops one request from the model's queue and writes
reply messages exactly as a model process does (``residency.work.add_reply``); no llama.cpp.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from residency import keys, registry
from residency.box import Box
from residency.errors import ApiError, slots_pinned
from residency.messages import ReplyType, Request
from residency.redis_server import EmbeddedRedis
from residency.settings import ModelSpec
from residency.work import add_reply
from tests.conftest import OPEN_AUTH_ENV
from web import create_app
from web.state import PROBE_TIMEOUT_S

ADMIN = "test-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def rc(r: redis.Redis) -> redis.Redis:
    """The shared test Redis, emptied for this test (tests/conftest.py)."""
    return r


@pytest.fixture
def box(tmp_path: Path, redis_url: str) -> Box:
    b = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url=redis_url,
        # A short reply timeout, so that a test whose fake model never answers fails fast.
        environ={
            **OPEN_AUTH_ENV,
            "RESIDENCY_ADMIN_KEY": ADMIN,
            "RESIDENCY_SERVER_REQUEST_TIMEOUT_S": "10",
        },
    )
    b.models_dir.mkdir(parents=True)
    (b.models_dir / "tiny.gguf").write_bytes(b"GGUF")
    (b.models_dir / "emb.gguf").write_bytes(b"GGUF")
    return b


@pytest.fixture
def app(box: Box, rc: redis.Redis) -> Flask:
    for name, typ, source in (("tiny", "llm", "file"), ("emb", "embedding", "admin")):
        spec = ModelSpec(path=str(box.models_dir / f"{name}.gguf"), type=typ)
        registry.put(rc, registry.Entry(name, spec, source), "test")
    return create_app(box)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def patch(client: FlaskClient, body: dict[str, Any]) -> Any:
    resp = client.patch("/admin/config", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.get_json()
    return resp.get_json()


def assert_envelope(resp: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return dict(err)


Script = Callable[[redis.Redis, Request], None]


class FakeModel(threading.Thread):
    """Serves exactly one request of ``model`` with ``script(r, request)``."""

    def __init__(self, rc: redis.Redis, model: str, script: Script) -> None:
        super().__init__(daemon=True)
        self.rc, self.model, self.script = rc, model, script
        self.request: Request | None = None

    def run(self) -> None:
        got = self.rc.brpop([keys.queue(self.model)], timeout=10)
        if got is None:
            return
        self.request = Request.loads(got[1])
        self.script(self.rc, self.request)


@pytest.fixture
def serve(rc: redis.Redis) -> Iterator[Callable[[str, Script], FakeModel]]:
    """Starts fake model threads; joins them before the Redis client closes."""
    started: list[FakeModel] = []

    def start(model: str, script: Script) -> FakeModel:
        fake = FakeModel(rc, model, script)
        fake.start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.join(10)


def chunk(text: str) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "/path/tiny.gguf",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }


def sse_events(body: str) -> list[Any]:
    out: list[Any] = []
    for block in body.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


# --- envelopes and limits -------------------------------------------------------------------


def test_unknown_model_is_404_envelope(client: FlaskClient) -> None:
    err = assert_envelope(
        client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404, "model_not_found"
    )
    assert err["param"] == "model"
    assert_envelope(client.get("/v1/models/nope"), 404, "model_not_found")


@pytest.mark.parametrize("data", [b"{not json", b"", b"[1, 2]", b'{"a": NaN}'])
def test_bad_json_is_400(client: FlaskClient, data: bytes) -> None:
    resp = client.post(
        "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    assert_envelope(resp, 400, "invalid_json")


def test_validation_error_names_param(client: FlaskClient) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 1}]}
    err = assert_envelope(client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "messages[1].content"


def test_oversized_body_is_413(client: FlaskClient) -> None:
    patch(client, {"server": {"max_request_bytes": 2048}})
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
    assert_envelope(client.post("/v1/chat/completions", json=big), 413, "request_too_large")


def body_of_size(n: int) -> bytes:
    raw = json.dumps({**CHAT, "model": "nope", "messages": [{"role": "user", "content": ""}]})
    pad = n - len(raw.encode())
    return raw.replace('"content": ""', '"content": "' + "x" * pad + '"').encode()


@pytest.mark.parametrize(("size", "status"), [(2048, 404), (2049, 413), (9000, 413)])
def test_chunked_body_limit(client: FlaskClient, size: int, status: int) -> None:
    """No Content-Length (chunked upload): the limit is enforced while reading, to the byte."""
    patch(client, {"server": {"max_request_bytes": 2048}})
    raw = body_of_size(size)
    assert len(raw) == size
    resp = client.post(
        "/v1/chat/completions",
        input_stream=io.BytesIO(raw),
        environ_overrides={"wsgi.input_terminated": True},
        headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
    )
    assert_envelope(resp, status)


def test_unknown_path_and_method_are_envelopes(client: FlaskClient) -> None:
    assert_envelope(client.get("/v2/whatever"), 404, "not_found")
    assert_envelope(client.get("/v1/chat/completions"), 405, "method_not_allowed")


def test_wrong_model_type_is_400(client: FlaskClient) -> None:
    err = assert_envelope(client.post("/v1/chat/completions", json={**CHAT, "model": "emb"}), 400)
    assert err["param"] == "model"
    resp = client.post("/v1/embeddings", json={"model": "tiny", "input": "x"})
    assert assert_envelope(resp, 400)["param"] == "model"


# --- the reply bus --------------------------------------------------------------------------


def test_non_stream_round_trip(client: FlaskClient, rc: redis.Redis, serve: Any) -> None:
    answer = {"id": "x", "object": "chat.completion", "model": "/path/tiny.gguf", "choices": []}

    def script(r: redis.Redis, req: Request) -> None:
        add_reply(r, req.id, ReplyType.DONE, answer)

    fake = serve("tiny", script)
    resp = client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 5})
    fake.join(5)
    assert resp.status_code == 200
    assert resp.get_json() == {**answer, "model": "tiny"}
    assert fake.request is not None
    assert fake.request.params == {"messages": CHAT["messages"], "max_tokens": 5}
    assert fake.request.stream is False
    assert rc.exists(keys.reply(fake.request.id)) == 0  # cleaned up
    text = client.get("/metrics").get_data(as_text=True)
    assert 'residency_requests_total{code="200",model="tiny"}' in text
    assert 'residency_time_to_first_token_seconds_count{model="tiny"}' in text


def test_stream_round_trip(client: FlaskClient, rc: redis.Redis, serve: Any) -> None:
    def script(r: redis.Redis, req: Request) -> None:
        add_reply(r, req.id, ReplyType.CHUNK, {"chunks": [chunk("a"), chunk("b")]})
        add_reply(r, req.id, ReplyType.CHUNK, {"chunks": [chunk("c")]})
        add_reply(r, req.id, ReplyType.DONE, {})

    serve("tiny", script)
    resp = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status_code == 200
    assert resp.mimetype == "text/event-stream"
    assert resp.headers["Cache-Control"] == "no-cache"
    assert resp.headers["X-Accel-Buffering"] == "no"
    events = sse_events(resp.get_data(as_text=True))
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["delta"]["content"] for e in events[:-1]] == ["a", "b", "c"]
    assert all(e["model"] == "tiny" for e in events[:-1])


def test_error_before_first_chunk_keeps_status(
    client: FlaskClient, rc: redis.Redis, serve: Any
) -> None:
    def script(r: redis.Redis, req: Request) -> None:
        add_reply(r, req.id, ReplyType.ERROR, slots_pinned("tiny", "llm").to_reply())

    serve("tiny", script)
    resp = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert_envelope(resp, 409, "slots_pinned")


def test_error_mid_stream_is_an_event(client: FlaskClient, rc: redis.Redis, serve: Any) -> None:
    def script(r: redis.Redis, req: Request) -> None:
        add_reply(r, req.id, ReplyType.CHUNK, {"chunks": [chunk("a")]})
        add_reply(r, req.id, ReplyType.ERROR, ApiError(500, "model crashed").to_reply())

    serve("tiny", script)
    resp = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = sse_events(resp.get_data(as_text=True))
    assert events[0]["choices"][0]["delta"]["content"] == "a"
    assert events[1]["error"]["message"] == "model crashed"
    assert events[2] == "[DONE]"


def test_client_disconnect_cancels(client: FlaskClient, rc: redis.Redis, serve: Any) -> None:
    stop = threading.Event()

    def script(r: redis.Redis, req: Request) -> None:
        add_reply(r, req.id, ReplyType.CHUNK, {"chunks": [chunk("a")]})
        stop.wait(10)

    fake = serve("tiny", script)
    resp = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, buffered=False)
    first = next(iter(resp.response))
    assert b'"a"' in first
    resp.close()  # what the WSGI server does when the client goes away
    stop.set()
    assert fake.request is not None
    assert rc.get(keys.cancel(fake.request.id)) == "1"
    assert 0 < rc.ttl(keys.cancel(fake.request.id)) <= keys.REPLY_TTL_S


def test_queue_full_is_429(client: FlaskClient, rc: redis.Redis) -> None:
    patch(client, {"pool": {"max_queue_per_model": 1}})
    rc.lpush(keys.queue("tiny"), "someone else's request")
    resp = client.post("/v1/chat/completions", json=CHAT)
    assert_envelope(resp, 429, "queue_full")
    assert resp.headers["Retry-After"] == "1"


def test_timeout_is_503_and_dequeues(client: FlaskClient, rc: redis.Redis) -> None:
    patch(client, {"server": {"request_timeout_s": 0.3}})
    resp = client.post("/v1/chat/completions", json=CHAT)
    assert_envelope(resp, 503, "timeout")
    assert "Retry-After" in resp.headers
    assert rc.llen(keys.queue("tiny")) == 0  # will not be served later
    # Withdrawn while still queued: no process took it, so it needs no cancel flag.
    assert list(rc.scan_iter(keys.cancel("*"))) == []
    events = [json.loads(e) for e in rc.lrange(keys.events(), 0, -1)]
    assert {"type": "demand", "model": "tiny", "data": {}} in events


def test_embeddings_base64(client: FlaskClient, rc: redis.Redis, serve: Any) -> None:
    answer = {"object": "list", "model": "p", "data": [{"index": 0, "embedding": [1.0, -2.0]}]}

    def script(r: redis.Redis, req: Request) -> None:
        assert req.params == {"input": ["hello"]}
        add_reply(r, req.id, ReplyType.DONE, answer)

    serve("emb", script)
    resp = client.post(
        "/v1/embeddings", json={"model": "emb", "input": "hello", "encoding_format": "base64"}
    )
    assert resp.status_code == 200
    out = resp.get_json()
    assert out["model"] == "emb"
    assert out["data"][0]["embedding"] == "AACAPwAAAMA="  # <f4 [1.0, -2.0]


def test_models_list(client: FlaskClient) -> None:
    out = client.get("/v1/models").get_json()
    assert out["object"] == "list"
    assert [m["id"] for m in out["data"]] == ["emb", "tiny"]
    m = out["data"][1]
    assert (m["object"], m["owned_by"], m["state"]) == ("model", "residency", "unloaded")
    assert client.get("/v1/models/tiny").get_json()["id"] == "tiny"


# --- admin API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN}, {"Authorization": "Basic x"}],
)
def test_admin_requires_key(client: FlaskClient, headers: dict[str, str]) -> None:
    assert_envelope(client.get("/admin/config", headers=headers), 401)
    assert_envelope(client.patch("/admin/config", json={}, headers=headers), 401)


def test_patch_is_all_or_nothing(client: FlaskClient, rc: redis.Redis) -> None:
    before = client.get("/admin/config", headers=AUTH).get_json()
    body = {
        "pool": {"max_loaded_models": 0, "auto_evict": True, "bogus": 1},
        "server": {"port": 9000},
    }
    resp = client.patch("/admin/config", json=body, headers=AUTH)
    err = assert_envelope(resp, 400, "invalid_settings")
    problems = resp.get_json()["problems"]
    assert set(problems) == {"pool.max_loaded_models", "pool.bogus", "server.port"}
    for key in problems:
        assert key in err["message"]
    assert err["param"] in problems
    after = client.get("/admin/config", headers=AUTH).get_json()
    assert after == before
    assert rc.hgetall(keys.config_admin()) == {}


def test_patch_success_returns_generation(client: FlaskClient, rc: redis.Redis) -> None:
    gen0 = client.get("/admin/config", headers=AUTH).get_json()["generation"]
    out = patch(client, {"pool": {"max_loaded_models": 2}})
    assert out == {"updated": {"pool.max_loaded_models": 2}, "generation": gen0 + 1}
    cfg = client.get("/admin/config", headers=AUTH).get_json()
    assert cfg["config"]["pool"]["max_loaded_models"] == 2
    assert cfg["sources"]["pool.max_loaded_models"] == "admin"
    assert cfg["sources"]["pool.auto_evict"] == "default"
    assert cfg["generation"] == out["generation"]
    assert "models" not in cfg["config"]
    audit = client.get("/admin/audit?limit=1", headers=AUTH).get_json()["audit"]
    assert audit[0]["action"] == "config.patch"


def test_admin_models_put_delete(client: FlaskClient, box: Box, tmp_path: Path) -> None:
    good = {"path": "tiny.gguf", "n_ctx": 512}
    resp = client.put("/admin/models/new-one", json=good, headers=AUTH)
    assert resp.status_code == 201, resp.get_json()
    assert resp.get_json()["model"]["path"] == str((box.models_dir / "tiny.gguf").resolve())
    assert client.put("/admin/models/new-one", json=good, headers=AUTH).status_code == 200

    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"GGUF")
    (box.models_dir / "link.gguf").symlink_to(outside)
    for path in ("../outside.gguf", str(outside), "link.gguf"):
        resp = client.put("/admin/models/x", json={"path": path}, headers=AUTH)
        assert assert_envelope(resp, 400, "path_not_allowed")["param"] == "path"
    resp = client.put("/admin/models/x", json={"path": "missing.gguf"}, headers=AUTH)
    assert assert_envelope(resp, 400)["param"] == "path"
    resp = client.put("/admin/models/x", json={"path": "tiny.gguf", "n_ctx": 1}, headers=AUTH)
    assert assert_envelope(resp, 400)["param"] == "n_ctx"
    resp = client.put("/admin/models/bad name", json=good, headers=AUTH)
    assert assert_envelope(resp, 400)["param"] == "name"

    listed = client.get("/admin/models", headers=AUTH).get_json()["models"]
    assert {m["name"] for m in listed} == {"tiny", "emb", "new-one"}
    assert all(m["state"] == "unloaded" for m in listed)

    assert_envelope(client.delete("/admin/models/tiny", headers=AUTH), 409)
    assert_envelope(client.delete("/admin/models/ghost", headers=AUTH), 404)
    assert client.delete("/admin/models/new-one", headers=AUTH).status_code == 200
    assert_envelope(client.get("/admin/models/new-one", headers=AUTH), 404)


def test_admin_residency_control(client: FlaskClient, rc: redis.Redis) -> None:
    resp = client.post("/admin/models/tiny/load", headers=AUTH)
    assert (resp.status_code, resp.get_json()) == (202, {"model": "tiny", "requested": "load"})
    resp = client.post("/admin/models/tiny/unload", headers=AUTH)
    assert resp.status_code == 202
    events = [json.loads(e) for e in rc.lrange(keys.events(), -2, -1)]
    assert events == [
        {"type": "config", "model": "tiny", "data": {"load": True}},
        {"type": "config", "model": "tiny", "data": {"unload": True}},
    ]
    assert rc.hget(keys.explicit(), "tiny") == "unload"  # the later wish replaces the earlier
    assert_envelope(client.post("/admin/models/ghost/load", headers=AUTH), 404)

    resp = client.post("/admin/models/tiny/pin", json={"pinned": True}, headers=AUTH)
    assert resp.get_json()["pinned"] is True
    entry = registry.get(rc, "tiny")
    assert entry is not None and entry.spec.pinned and entry.source == "file"
    resp = client.post("/admin/models/tiny/pin", json={"pinned": "yes"}, headers=AUTH)
    assert assert_envelope(resp, 400)["param"] == "pinned"


def test_faults_only_when_enabled(client: FlaskClient, box: Box, rc: redis.Redis) -> None:
    body = {"hold": {"tiny": True}, "memory_pressure": 0.5}
    assert_envelope(client.post("/admin/faults", json=body, headers=AUTH), 404)
    # Restart-only: a process started with it on (here through the environment).
    box.environ = {**box.environ, "RESIDENCY_DEBUG_FAULT_INJECTION": "true"}
    client = create_app(box).test_client()
    resp = client.post("/admin/faults", json=body, headers=AUTH)
    assert resp.get_json() == {"faults": {"hold:tiny": "1", "memory_pressure": "0.5"}}
    resp = client.post("/admin/faults", json={"hold": {"tiny": False}}, headers=AUTH)
    assert resp.get_json() == {"faults": {"memory_pressure": "0.5"}}
    assert rc.hgetall(keys.faults()) == {"memory_pressure": "0.5"}


# --- ops --------------------------------------------------------------------------------------


def test_ops_endpoints(client: FlaskClient, rc: redis.Redis) -> None:
    assert client.get("/livez").get_json() == {"status": "ok"}
    resp = client.get("/readyz")
    assert resp.status_code == 503 and "Retry-After" in resp.headers
    assert set(resp.get_json()["reasons"]) == {"no coordinator leader", "no live worker agent"}
    rc.set(keys.leader(), "token", px=5000)
    rc.sadd(keys.workers(), "box1")
    rc.hset(keys.worker("box1"), "pid", 1)
    assert client.get("/readyz").status_code == 200

    resp = client.get("/health")
    assert (resp.status_code, resp.get_json()) == (
        503,
        {"status": "starting", "config_error": None},
    )
    record = {"status": "ok", "generation": 1, "models": [], "max_models": {}}
    rc.hset(keys.health(), mapping={"generation": 7, "record": json.dumps(record)})
    health = client.get("/health").get_json()
    assert (health["generation"], health["config_error"]) == (7, None)

    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.content_type.startswith("text/plain")
    assert "residency_model_loads_total" in resp.get_data(as_text=True)


def test_redis_down_is_503(tmp_path: Path) -> None:
    box = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url=f"unix://{tmp_path}/absent.sock",
        environ={**OPEN_AUTH_ENV, "RESIDENCY_ADMIN_KEY": ADMIN},
    )
    client = create_app(box).test_client()
    resp = client.post("/v1/chat/completions", json=CHAT)
    assert_envelope(resp, 503, "redis_unavailable")
    assert "Retry-After" in resp.headers
    assert client.get("/livez").status_code == 200
    assert client.get("/readyz").status_code == 503


def test_redis_stopped_mid_run_is_503_until_it_is_back(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False)
    box = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url=server.start(),
        environ={
            **OPEN_AUTH_ENV,
            "RESIDENCY_ADMIN_KEY": ADMIN,
            "RESIDENCY_SERVER_REQUEST_TIMEOUT_S": "5",
        },
    )
    try:
        app = create_app(box)
        client = app.test_client()
        # Served while Redis is up (an unknown model is a Redis lookup: 404).
        assert_envelope(client.post("/v1/chat/completions", json=CHAT), 404, "model_not_found")
        assert client.get("/admin/config", headers=AUTH).status_code == 200

        server.stop()
        for resp in (
            client.post("/v1/chat/completions", json=CHAT),
            client.get("/v1/models"),
            client.get("/admin/config", headers=AUTH),
            client.get("/admin/models", headers=AUTH),
            client.get("/health"),
        ):
            assert_envelope(resp, 503, "redis_unavailable")
            assert int(resp.headers["Retry-After"]) > 0
        resp = client.get("/readyz")
        assert resp.status_code == 503 and "Retry-After" in resp.headers
        assert resp.get_json()["reasons"] == ["Redis unreachable: ConnectionError"]
        # The readiness probe's client gives up at once: short timeouts and no retries.
        probe = app.extensions["residency"].probe
        assert probe.connection_pool.connection_kwargs["socket_timeout"] == PROBE_TIMEOUT_S
        assert probe.get_retry() is not None and probe.get_retry().get_retries() == 0
        assert client.get("/livez").status_code == 200

        server.start()  # the same socket again: the same clients reconnect
        assert_envelope(client.post("/v1/chat/completions", json=CHAT), 404, "model_not_found")
        assert client.get("/admin/config", headers=AUTH).status_code == 200
    finally:
        server.stop()
