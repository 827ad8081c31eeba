"""The remote forwarder against a real HTTP server on loopback: redirects are not followed,
local targets are refused unless allowed, error bodies that are not the envelope are a 502,
and only ``RESIDENCY_REMOTE_*`` variables are ever sent as an API key."""

from __future__ import annotations

import json
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
#: What the fake upstream reports it used (path ``/usage``).
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
CHAT_ANSWER = {
    "id": "r",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
}
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PATH = "/v1/chat/completions"


class Remote:
    """An OpenAI-compatible server whose first path segment picks its behaviour."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.auth: list[str | None] = []
        self.hosts: list[str | None] = []
        self.bodies: list[dict[str, Any]] = []
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
            if kind == "auth401":
                err = {"message": "invalid api key", "type": "auth", "code": "invalid_api_key"}
                return jsonify({"error": err}), 401
            if kind == "json400":
                err = {"message": "prompt too long", "type": "x", "code": "context_length"}
                return jsonify({"error": err}), 400
            self.hosts.append(request.headers.get("Host"))
            self.bodies.append(request.get_json())
            if kind == "usage" and request.get_json().get("stream"):
                return Response(self._stream(request.get_json()), mimetype="text/event-stream")
            if kind == "bare-sse":
                # What llama.cpp's server and Ollama send: no charset in the Content-Type.
                stream = self._stream(request.get_json(), ("h\u00e9l", "lo \u2713"))
                return Response(stream, headers={"Content-Type": "text/event-stream"})
            if kind == "usage":
                return jsonify({**CHAT_ANSWER, "usage": USAGE})
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

    @staticmethod
    def _stream(body: dict[str, Any], pieces: tuple[str, ...] = ("hel", "lo")) -> Iterator[str]:
        chunk = {"id": "r", "object": "chat.completion.chunk", "model": "m"}
        for piece in pieces:
            delta = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
            data = json.dumps({**chunk, "choices": [delta]}, ensure_ascii=False)
            yield f"data: {data}\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': USAGE})}\n\n"
        yield "data: [DONE]\n\n"

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


def make_client(
    tmp_path: Path, redis_url: str, *, allow_local: bool, allow_private: bool = False
) -> FlaskClient:
    env = {
        **OPEN_AUTH_ENV,
        "RESIDENCY_ADMIN_KEY": ADMIN,
        "RESIDENCY_SERVER_REQUEST_TIMEOUT_S": "10",
    }
    if allow_local:
        env["RESIDENCY_SERVER_ALLOW_LOCAL_REMOTES"] = "true"
    if allow_private:
        env["RESIDENCY_SERVER_ALLOW_PRIVATE_REMOTES"] = "true"
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
    register(r, "link-local", "http://169.254.10.10/latest/v1")
    register(r, "zero", "http://0.0.0.0:9/v1")
    strict = make_client(tmp_path, redis_url, allow_local=False)
    for name in ("loop", "loop-name", "loop6", "link-local", "zero"):
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
    for kind in ("text500", "text400", "json400", "auth401"):
        register(r, kind, remote.url(kind))
    err = error_of(ask(client, "text500"), 502)
    assert err["code"] == "bad_gateway" and "upstream meltdown" in err["message"]
    err = error_of(ask(client, "text400"), 502)
    assert "HTTP 400" in err["message"] and "bad thing" in err["message"]
    err = error_of(ask(client, "json400"), 400)  # a client error in the envelope keeps its status
    assert err["code"] == "context_length" and "prompt too long" in err["message"]
    # The upstream refusing the box's own key is not the client's 401: a bad gateway.
    err = error_of(ask(client, "auth401"), 502)
    assert err["code"] == "remote_auth_failed" and "HTTP 401" in err["message"]


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


# --- addresses: metadata, CGNAT, private ranges; rebinding; the environment ---------------------

#: Addresses refused whatever the settings (metadata services, multicast), and those refused
#: unless ``server.allow_private_remotes``: each with the setting its refusal names.
NEVER = {
    "aws": "http://169.254.169.254/latest/v1",
    "aws6": "http://[fd00:ec2::254]/v1",
    "alibaba": "http://100.100.100.200/v1",
    "multicast": "http://224.0.0.1/v1",
}
PRIVATE = {
    "ten": "http://10.0.0.5:8080/v1",
    "oneseventwo": "http://172.16.3.4/v1",
    "oneninetwo": "http://192.168.1.1/v1",
    "ula": "http://[fc00::1]/v1",
    "ula-fd": "http://[fd12:3456::1]/v1",
    "cgnat": "http://100.64.0.1/v1",
    "mapped": "http://[::ffff:10.1.2.3]/v1",
}


def test_metadata_cgnat_and_private_addresses_are_refused(
    tmp_path: Path, redis_url: str, r: redis.Redis, remote: Remote
) -> None:
    for name, url in {**NEVER, **PRIVATE}.items():
        register(r, name, url)
    # Even with local targets allowed (the setting the tests' local upstreams need).
    client = make_client(tmp_path, redis_url, allow_local=True)
    for name in NEVER:
        err = error_of(ask(client, name), 502)
        assert err["code"] == "remote_address_refused", name
        assert "never allowed" in err["message"] and "server.allow_" not in err["message"]
    for name in PRIVATE:
        err = error_of(ask(client, name), 502)
        assert err["code"] == "remote_address_refused", name
        assert "private range" in err["message"], err
        assert "server.allow_private_remotes" in err["message"]
    # With private ranges allowed, the metadata services stay refused.
    client = make_client(tmp_path, redis_url, allow_local=True, allow_private=True)
    for name in NEVER:
        assert error_of(ask(client, name), 502)["code"] == "remote_address_refused"


def test_the_address_policy() -> None:
    from web.remote_target import Allowed, parse, refusal

    def why(a: str, **allowed: bool) -> str | None:
        out = refusal(parse(a), Allowed(**allowed))
        return None if out is None else out[0]

    metadata = ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "::ffff:169.254.169.254")
    # NAT64 carries an IPv4 address in its last 32 bits (a DNS64 network resolves to it).
    for a in (*metadata, "64:ff9b::a9fe:a9fe", "64:ff9b:1::a9fe:a9fe"):
        assert why(a, local=True, private=True) == "a cloud metadata service", a
    assert why("64:ff9b::7f00:1") == "a loopback address"
    assert why("64:ff9b::808:808") is None
    for a in ("10.0.0.1", "172.31.255.255", "192.168.0.1", "fc00::1", "fdff::1", "100.127.0.1"):
        assert why(a) == "in a private range", a
        assert why(a, private=True) is None, a
    for a in ("127.0.0.1", "::1", "0.0.0.0", "::", "fe80::1%eth0", "169.254.1.1", "2002:7f00:1::"):
        assert why(a) is not None and why(a, local=True) is None, a
    for a in ("8.8.8.8", "2606:4700::1111", "172.32.0.1", "100.128.0.1", "11.0.0.1"):
        assert why(a) is None, a


class Rebinding:
    """A resolver whose first answer is ``first`` and every later one 127.0.0.1 (a DNS
    rebinding attack's name): it counts its lookups."""

    def __init__(self, first: str) -> None:
        self.first = first
        self.calls = 0

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        return [self.first] if self.calls == 1 else ["127.0.0.1"]


def test_a_rebinding_name_is_connected_at_the_checked_address(
    tmp_path: Path,
    redis_url: str,
    r: redis.Redis,
    remote: Remote,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The name is resolved once: the connection goes to the address that was checked, never
    to a second answer, and the upstream still sees the name (Host header; TLS verifies the
    same name)."""
    from web import remote as forwarder

    # First answer a public address where nothing listens (TEST-NET-3), then the local
    # upstream: the request fails, the upstream is never reached. "localhost": what a second
    # lookup by anything but the checked resolver answers too.
    rebind = Rebinding("203.0.113.9")
    monkeypatch.setattr(forwarder, "RESOLVE", rebind)
    monkeypatch.setattr(forwarder, "CONNECT_TIMEOUT_S", 0.5)
    register(r, "rebind", remote.url("ok", host="localhost"))
    err = error_of(ask(make_client(tmp_path, redis_url, allow_local=False), "rebind"), 502)
    assert "unreachable" in err["message"], err
    assert remote.hits == [] and rebind.calls == 1

    # A name only the checked resolver knows: the request reaches the address it answered.
    rebind = Rebinding("127.0.0.1")
    monkeypatch.setattr(forwarder, "RESOLVE", rebind)
    port = remote.server.server_port
    register(r, "named", f"http://upstream.residency-test.invalid:{port}/ok/v1")
    resp = ask(make_client(tmp_path, redis_url, allow_local=True), "named")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert remote.hits == ["ok"] and rebind.calls == 1
    assert remote.hosts == [f"upstream.residency-test.invalid:{port}"]


def test_the_forwarder_ignores_proxy_variables_and_netrc(
    tmp_path: Path,
    redis_url: str,
    r: redis.Redis,
    remote: Remote,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy = Remote()  # were the proxy variables honoured, the request would go here
    try:
        netrc = tmp_path / "netrc"
        netrc.write_text("machine 127.0.0.1 login someone password hunter2\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
        for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"):
            monkeypatch.setenv(var, f"http://127.0.0.1:{proxy.server.server_port}")
        for var in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(var, raising=False)
        register(r, "plain", remote.url("ok"))
        resp = ask(make_client(tmp_path, redis_url, allow_local=True), "plain")
        assert resp.status_code == 200, resp.get_data(as_text=True)
        assert remote.hits == ["ok"] and proxy.hits == []
        assert remote.auth == [None]  # no credentials from .netrc
    finally:
        proxy.close()


def test_a_remote_stream_is_read_as_utf8_whatever_its_content_type(
    tmp_path: Path, redis_url: str, r: redis.Redis, remote: Remote
) -> None:
    register(r, "bare", remote.url("bare-sse"))
    client = make_client(tmp_path, redis_url, allow_local=True)
    body = {"model": "bare", "messages": [{"role": "user", "content": "x"}], "stream": True}
    resp = client.post(PATH, json=body)
    assert resp.status_code == 200
    text = ""
    for line in resp.get_data(as_text=True).splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    assert text == "h\u00e9llo \u2713"
