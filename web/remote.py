"""Forwarding a request to a remote model (an OpenAI-compatible ``base_url``).

Remote models are never loaded here and count toward no pool; web sends the request straight
on, streaming included, and answers the remote's errors in the OpenAI envelope.

A remote is an address an admin typed in, reached from inside the box's network, so the
forwarder is careful with it: it never follows a redirect, it refuses loopback, link-local
(cloud metadata services live there) and unspecified addresses unless
``server.allow_local_remotes`` is on, and the only environment variables it will send as an API
key are ``RESIDENCY_REMOTE_*`` ones (never the admin key or the Redis URL).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import requests

from residency.errors import ApiError
from residency.settings import ModelSpec, ServerSettings, check_remote_key_env

CONNECT_TIMEOUT_S = 10.0
#: How much of a remote's error body is read (and at most 500 characters of it are quoted).
ERROR_BODY_BYTES = 4096

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _bad_gateway(name: str, what: str, code: str = "bad_gateway") -> ApiError:
    return ApiError(502, f"remote model '{name}': {what}", type="server_error", code=code)


def refused_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` is not a remote this box forwards to by default, or None."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    return None


def check_target(name: str, addresses: Iterable[str]) -> None:
    """Refuse the remote if any address its host resolves to is refused (so a name that
    resolves to both a public and a loopback address cannot slip through)."""
    for a in addresses:
        reason = refused_reason(ipaddress.ip_address(a.split("%", 1)[0]))
        if reason is not None:
            raise _bad_gateway(
                name,
                f"its address {a} is {reason}; set server.allow_local_remotes = true "
                "to allow such targets",
                code="remote_address_refused",
            )


def _resolve(name: str, url: str) -> list[str]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:
        raise _bad_gateway(name, f"unreachable ({e.__class__.__name__})") from e
    return [str(info[4][0]) for info in infos]


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


class Forwarded:
    """One forwarded request: the first byte has arrived (so the status is known)."""

    def __init__(self, name: str, resp: requests.Response) -> None:
        self.name = name
        self.resp = resp

    def json(self) -> dict[str, Any]:
        try:
            out = self.resp.json()
        except ValueError:
            raise _bad_gateway(self.name, "answered with something that is not JSON") from None
        finally:
            self.resp.close()
        if not isinstance(out, dict):
            raise _bad_gateway(self.name, "answered with JSON that is not an object")
        return out

    def events(self) -> Iterator[dict[str, Any]]:
        """The JSON objects of the remote's SSE stream, up to ``[DONE]``."""
        try:
            for line in self.resp.iter_lines(decode_unicode=True):
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
                    yield obj
        except requests.RequestException as e:
            raise _bad_gateway(self.name, f"stream broke: {e.__class__.__name__}") from e
        finally:
            self.resp.close()

    def close(self) -> None:
        self.resp.close()


def forward(
    name: str, spec: ModelSpec, path: str, body: Mapping[str, Any], server: ServerSettings
) -> Forwarded:
    """POST ``body`` (with the remote's model name) to ``spec.base_url + path``, within
    ``server.request_timeout_s``. A non-2xx answer becomes an ApiError (see ``remote_error``);
    a redirect is not followed."""
    assert spec.base_url is not None
    url = spec.base_url.rstrip("/") + path
    if not server.allow_local_remotes:
        check_target(name, _resolve(name, url))
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
    try:
        resp = requests.post(
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
        raise _bad_gateway(name, f"unreachable ({e.__class__.__name__})") from e
    if resp.is_redirect or 300 <= resp.status_code < 400:
        where = resp.headers.get("Location", "?")
        resp.close()
        raise _bad_gateway(
            name,
            f"answered with a redirect (HTTP {resp.status_code} to {where[:200]}); not followed",
        )
    if resp.status_code >= 400:
        try:
            raise remote_error(name, resp.status_code, _body_head(resp))
        finally:
            resp.close()
    return Forwarded(name, resp)
