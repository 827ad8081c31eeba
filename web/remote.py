"""Forwarding a request to a remote model (an OpenAI-compatible ``base_url``).

Remote models are never loaded here and count toward no pool; web sends the request straight
on, streaming included, and answers the remote's errors in the OpenAI envelope.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import requests

from residency.errors import ApiError
from residency.settings import ModelSpec

CONNECT_TIMEOUT_S = 10.0


def _bad_gateway(name: str, what: str) -> ApiError:
    return ApiError(502, f"remote model '{name}': {what}", type="server_error", code="bad_gateway")


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
    name: str, spec: ModelSpec, path: str, body: Mapping[str, Any], timeout_s: float
) -> Forwarded:
    """POST ``body`` (with the remote's model name) to ``spec.base_url + path``. A non-2xx
    answer becomes an ApiError with the remote's status and message."""
    assert spec.base_url is not None
    headers = {"Content-Type": "application/json"}
    if spec.api_key_env:
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
    url = spec.base_url.rstrip("/") + path
    try:
        resp = requests.post(
            url,
            json=payload,
            headers=headers,
            stream=bool(payload.get("stream")),
            timeout=(CONNECT_TIMEOUT_S, timeout_s),
        )
    except requests.RequestException as e:
        raise _bad_gateway(name, f"unreachable ({e.__class__.__name__})") from e
    if resp.status_code >= 400:
        try:
            err = resp.json().get("error", {})
            message = str(err.get("message") or resp.text[:500])
            code = err.get("code")
        except ValueError:
            message, code = resp.text[:500], None
        finally:
            resp.close()
        raise ApiError(
            resp.status_code, f"remote model '{name}': {message}", type="server_error", code=code
        )
    return Forwarded(name, resp)
