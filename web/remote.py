"""Forwarding a request to a remote model (an OpenAI-compatible ``base_url``).

Remote models are never loaded here and count toward no pool; web sends the request straight
on, streaming included, and answers the remote's errors in the OpenAI envelope.

A remote is an address an admin typed in, reached from inside the box's network, so the
forwarder is careful with it: it never follows a redirect; it resolves the remote's host once,
refuses it when any of its addresses is refused (``web.remote_target``: metadata services,
loopback, link-local, private ranges…) and connects to the address it checked
(``web.pinned_http``), never to a second lookup; it ignores the environment (no proxy variables,
no ``.netrc``); and the only environment variables it will send as an API key are
``RESIDENCY_REMOTE_*`` ones (never the admin key or the Redis URL).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import requests

from residency.errors import ApiError
from residency.settings import ModelSpec, ServerSettings, check_remote_key_env
from web import remote_target
from web.pinned_http import pinned_session

CONNECT_TIMEOUT_S = 10.0
#: How much of a remote's error body is read (and at most 500 characters of it are quoted).
ERROR_BODY_BYTES = 4096

#: How a remote's host name is resolved (tests answer for it: see ``remote_target.Resolver``).
RESOLVE: remote_target.Resolver = remote_target.system_resolver


def _bad_gateway(name: str, what: str, code: str = "bad_gateway") -> ApiError:
    return ApiError(502, f"remote model '{name}': {what}", type="server_error", code=code)


def check_target(name: str, addresses: list[str], allowed: remote_target.Allowed) -> str:
    """The address to connect to (the first), once every one of ``addresses`` passed; else the
    502 ``remote_address_refused`` naming the address and the setting that would allow it."""
    if not addresses:
        raise _bad_gateway(name, "its host resolves to no address")
    bad = remote_target.first_refused(addresses, allowed)
    if bad is not None:
        address, reason, setting = bad
        how = f"set {setting} = true to allow such targets" if setting else "never allowed"
        raise _bad_gateway(
            name, f"its address {address} is {reason}; {how}", code="remote_address_refused"
        )
    return remote_target.parse(addresses[0]).compressed


def _resolve(name: str, url: str) -> list[str]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return RESOLVE(host, port)
    except (OSError, ValueError) as e:
        raise _bad_gateway(name, f"unreachable ({e.__class__.__name__})") from e


def _body_head(resp: requests.Response) -> bytes:
    """The first ``ERROR_BODY_BYTES`` of the body (an error body is never read whole)."""
    out = b""
    try:
        for chunk in resp.iter_content(1024):
            out += chunk
            if len(out) >= ERROR_BODY_BYTES:
                break
    except requests.RequestException:
        pass  # what arrived is enough to quote
    return out[:ERROR_BODY_BYTES]


def remote_error(name: str, status: int, body: bytes) -> ApiError:
    """The client's answer to a remote's error. A client error in the OpenAI envelope keeps its
    status, message and code; anything else (a server error, a body that is not the envelope,
    plain text) is the remote failing: 502."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    if status in (401, 403, 407):
        # The box's own credentials for the upstream (RESIDENCY_REMOTE_*), not the client's:
        # passing the status on would tell the client its key is wrong.
        return _bad_gateway(
            name,
            f"the upstream refused this box's credentials (HTTP {status}); the admin should "
            "check the model's api_key_env variable",
            "remote_auth_failed",
        )
    if 400 <= status < 500 and isinstance(err, dict) and err.get("message"):
        code = err.get("code")
        return ApiError(
            status,
            f"remote model '{name}': {str(err['message'])[:500]}",
            type="server_error",
            code=code if isinstance(code, str) else None,
        )
    if isinstance(err, dict) and err.get("message"):
        text = str(err["message"])
    else:
        text = body.decode("utf-8", "replace").strip()
    return _bad_gateway(name, f"answered HTTP {status}: {text[:500] or '(empty body)'}")


Usage = tuple[int, int]  # prompt tokens, completion tokens


def reported_usage(obj: Mapping[str, Any]) -> Usage | None:
    """The (prompt, completion) tokens of an answer's ``usage`` object, when it has one."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    prompt, completion = (
        u.get("prompt_tokens", u.get("input_tokens")),
        u.get("completion_tokens", u.get("output_tokens", 0)),
    )
    if not isinstance(prompt, int) or not isinstance(completion, int | None):
        return None
    return max(0, prompt), max(0, completion or 0)


def generated_bytes(obj: Mapping[str, Any]) -> int:
    """The UTF-8 bytes of the text an answer (or a stream's chunk) generated."""
    n = 0
    for c in obj.get("choices") or []:
        if not isinstance(c, dict):
            continue
        for part in (c.get("text"), c.get("message"), c.get("delta")):
            if isinstance(part, str):
                n += len(part.encode())
            elif isinstance(part, dict):
                for v in (
                    part.get("content"),
                    part.get("reasoning_content"),
                    part.get("tool_calls"),
                ):
                    if isinstance(v, str):
                        n += len(v.encode())
                    elif v:
                        n += len(json.dumps(v).encode())
    return n


class Forwarded:
    """One forwarded request: the first byte has arrived (so the status is known).

    When the answer ends (read whole, its stream ended or closed), ``on_usage`` is called once
    with its usage: the upstream's ``usage`` when it reported one, else an estimate that never
    counts less than it could have used — ``prompt_estimate`` for the prompt and one token per
    byte of the generated text."""

    def __init__(
        self,
        name: str,
        resp: requests.Response,
        session: requests.Session | None = None,
        *,
        on_usage: Callable[[Usage], None] | None = None,
        prompt_estimate: int = 0,
        hide_usage: bool = False,
    ) -> None:
        self.name = name
        self.resp = resp
        self.session = session
        self._on_usage = on_usage
        self._prompt = prompt_estimate
        self._hide_usage = hide_usage  # asked for by web, not by the client: not relayed
        self._usage: Usage | None = None
        self._generated = 0
        self._settled = False

    def _seen(self, obj: Mapping[str, Any]) -> None:
        self._usage = reported_usage(obj) or self._usage
        self._generated += generated_bytes(obj)

    def _settle(self) -> None:
        if self._settled:
            return
        self._settled = True
        self.resp.close()
        if self.session is not None:
            self.session.close()
        if self._on_usage is not None:
            self._on_usage(self._usage or (self._prompt, self._generated))

    def json(self) -> dict[str, Any]:
        try:
            out = self.resp.json()
        except ValueError:
            raise _bad_gateway(self.name, "answered with something that is not JSON") from None
        finally:
            self.resp.close()
        try:
            if not isinstance(out, dict):
                raise _bad_gateway(self.name, "answered with JSON that is not an object")
            self._seen(out)
            return out
        finally:
            self._settle()

    def events(self) -> Iterator[dict[str, Any]]:
        """The JSON objects of the remote's SSE stream, up to ``[DONE]``."""
        try:
            # SSE is UTF-8 whatever the Content-Type says (llama.cpp's server and Ollama send a
            # bare text/event-stream, which requests would decode as Latin-1).
            for raw in self.resp.iter_lines():
                line = raw.decode("utf-8", "replace")
                if not line or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    self._seen(obj)
                    if self._hide_usage and "usage" in obj:
                        if not obj.get("choices"):
                            continue  # the usage-only chunk the client did not ask for
                        obj = {k: v for k, v in obj.items() if k != "usage"}
                    yield obj
        except requests.RequestException as e:
            raise _bad_gateway(self.name, f"stream broke: {e.__class__.__name__}") from e
        finally:
            self._settle()

    def close(self) -> None:
        self._settle()


#: The paths whose streams report usage in a last chunk when asked (``stream_options``).
USAGE_STREAMS = ("/chat/completions", "/completions")


def forward(
    name: str,
    spec: ModelSpec,
    path: str,
    body: Mapping[str, Any],
    server: ServerSettings,
    *,
    on_usage: Callable[[Usage], None] | None = None,
    prompt_estimate: int = 0,
) -> Forwarded:
    """POST ``body`` (with the remote's model name) to ``spec.base_url + path``, within
    ``server.request_timeout_s``. A non-2xx answer becomes an ApiError (see ``remote_error``);
    a redirect is not followed. ``on_usage`` is told what the request used when its answer
    ends (see ``Forwarded``); a stream asks its upstream for its usage then."""
    assert spec.base_url is not None
    url = spec.base_url.rstrip("/") + path
    allowed = remote_target.Allowed(server.allow_local_remotes, server.allow_private_remotes)
    ip = check_target(name, _resolve(name, url), allowed)
    headers = {"Content-Type": "application/json"}
    if spec.api_key_env:
        try:
            # Also checked when the model is registered; an entry stored before that rule
            # existed is refused here rather than sending an arbitrary variable.
            check_remote_key_env(spec.api_key_env)
        except ValueError as e:
            raise ApiError(
                500,
                f"remote model '{name}': api_key_env {e}; register it again",
                type="server_error",
                code="remote_key_refused",
            ) from None
        key = os.environ.get(spec.api_key_env)
        if not key:
            raise ApiError(
                500,
                f"remote model '{name}' needs ${spec.api_key_env}, which is not set",
                type="server_error",
                code="remote_key_missing",
            )
        headers["Authorization"] = f"Bearer {key}"
    payload = {**body, "model": spec.remote_model or name}
    hide_usage = False
    if payload.get("stream") and path in USAGE_STREAMS and on_usage is not None:
        opts = payload.get("stream_options")
        opts = dict(opts) if isinstance(opts, dict) else {}
        hide_usage = opts.get("include_usage") is not True
        payload["stream_options"] = {**opts, "include_usage": True}
    session = pinned_session(ip)
    try:
        resp = session.post(
            url,
            json=payload,
            headers=headers,
            stream=bool(payload.get("stream")),
            timeout=(CONNECT_TIMEOUT_S, server.request_timeout_s),
            # A redirect could lead anywhere (the address checks above would not apply to it),
            # and requests would carry the API key along to a same-host redirect.
            allow_redirects=False,
        )
    except requests.RequestException as e:
        session.close()
        raise _bad_gateway(name, f"unreachable ({e.__class__.__name__})") from e
    if resp.is_redirect or 300 <= resp.status_code < 400:
        where = resp.headers.get("Location", "?")
        resp.close()
        session.close()
        raise _bad_gateway(
            name,
            f"answered with a redirect (HTTP {resp.status_code} to {where[:200]}); not followed",
        )
    if resp.status_code >= 400:
        try:
            raise remote_error(name, resp.status_code, _body_head(resp))
        finally:
            resp.close()
            session.close()
    return Forwarded(
        name,
        resp,
        session,
        on_usage=on_usage,
        prompt_estimate=prompt_estimate,
        hide_usage=hide_usage,
    )
