"""Every answer of the Anthropic Messages API parsed with the official ``anthropic`` SDK's own
pydantic types, from the raw JSON over a real HTTP server (the SDK's client would fill in or
skip what is missing): a whole ``Message`` (text, stop sequence, forced tool call), every
stream event (``RawMessageStreamEvent``), count_tokens (``MessageTokensCount``) and error
bodies (``ErrorResponse``, and the typed exception the SDK's client raises for each status).

A stream's ``message_start`` must carry the prompt's tokens (what count_tokens and a whole
answer report), also when the stream started with a keep-alive while its model loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
import requests
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from residency.tinymodel import write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.fixtures import sse
from tests.integration.test_anthropic_compat import ADMIN, FORCED, STOPS, USER, WEATHER
from tests.integration.test_bounded_work import http_server
from tests.integration.tools_template import TOOLS_TEMPLATE

EVENT = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture
def port(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[int]:
    """As ``test_anthropic_compat``'s (``a`` plain ChatML, ``t`` a template with tools, keys
    required), with room on ``a`` for the tool format a template without tools gets: its
    description of the tools is a few hundred tokens on the tiny models' vocabulary."""
    tools_model = models_dir / "tiny-tools.gguf"
    if not tools_model.exists():
        write_tiny_model(tools_model, seed=5, chat_template=TOOLS_TEMPLATE)
    models = tiny_models(models_dir)
    models["a"]["n_ctx"] = 2048
    models["t"] = {"path": str(tools_model), "n_ctx": 2048, "parallel": 1}
    pool = start_pool(models=models, auth={"required": True})
    with http_server(pool) as p:
        yield p


HEADERS = {"x-api-key": ADMIN, "anthropic-version": "2023-06-01"}


def post(port: int, path: str, body: dict[str, Any], headers: Any = None) -> requests.Response:
    return requests.post(
        f"http://127.0.0.1:{port}{path}",
        json=body,
        headers=HEADERS if headers is None else headers,
        timeout=120,
    )


def whole(port: int, body: dict[str, Any]) -> Message:
    resp = post(port, "/v1/messages", body)
    assert resp.status_code == 200, resp.text
    return Message.model_validate(resp.json())


def stream(port: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's events, each checked: its ``event:`` line names its type, and every event
    but ``ping`` (which the SDK skips, and has no type for) parses as a stream event."""
    out: list[dict[str, Any]] = sse.read(f"http://127.0.0.1:{port}/v1/messages", body, HEADERS)
    for ev in out:
        if ev["type"] != "ping":
            EVENT.validate_python(ev)
    kinds = [e["type"] for e in out if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    return out


def counted(port: int, body: dict[str, Any]) -> int:
    keep = ("model", "messages", "system", "tools", "tool_choice")
    resp = post(port, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k in keep})
    assert resp.status_code == 200, resp.text
    return MessageTokensCount.model_validate(resp.json()).input_tokens


BODIES: list[Any] = [
    {"model": "a", "max_tokens": 6, "messages": USER},
    {"model": "a", "max_tokens": 6, "messages": USER, "system": "Be brief."},
    {"model": "a", "max_tokens": 100, "messages": USER, "stop_sequences": STOPS},
    {"model": "a", "max_tokens": 200, "messages": USER, "tools": [WEATHER], "tool_choice": FORCED},
    {"model": "t", "max_tokens": 200, "messages": USER, "tools": [WEATHER], "tool_choice": FORCED},
    {"model": "t", "max_tokens": 8, "messages": USER, "tools": [WEATHER]},
]


@pytest.mark.parametrize(
    "body", BODIES, ids=["text", "system", "stops", "a-forced", "t-forced", "t-auto"]
)
def test_messages_whole_and_streamed_parse_with_the_sdk_types(port: int, body: Any) -> None:
    n = counted(port, body)
    msg = whole(port, body)
    assert msg.usage.input_tokens == n
    if "tool_choice" in body:
        assert msg.stop_reason == "tool_use"
    evs = stream(port, body)
    start = EVENT.validate_python(evs[0])
    assert start.type == "message_start"
    # The prompt's tokens up front, as count_tokens and the whole answer count them.
    assert start.message.usage.input_tokens == n
    delta = EVENT.validate_python([e for e in evs if e["type"] == "message_delta"][-1])
    assert delta.type == "message_delta" and delta.usage.input_tokens in (None, n)


def test_message_start_counts_the_prompt_when_the_stream_waited_for_a_load(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    # Keep-alives every few milliseconds: the stream sends one while its model loads (a model
    # process takes far longer than that to start), before its first chunk.
    pool = start_pool(models=tiny_models(models_dir), server={"sse_keepalive_s": 0.001})
    with http_server(pool) as p:
        body = {"model": "a", "max_tokens": 4, "messages": USER}
        evs = stream(p, body)
        # As Anthropic's streams do, it starts with message_start: the load was waited for
        # with keep-alive comment lines, not events.
        assert evs[0]["type"] == "message_start"
        raw = requests.post(
            f"http://127.0.0.1:{p}/v1/messages",
            json={**body, "model": "b", "stream": True},
            headers=HEADERS,
            timeout=120,
        ).text
        assert raw.startswith(": keep-alive\n\n") and "event: message_start" in raw
        start = EVENT.validate_python(evs[0])
        assert start.type == "message_start"
        assert start.message.usage.input_tokens == counted(p, body) > 0


# --- errors -----------------------------------------------------------------------------------


def error_of(resp: requests.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    err = ErrorResponse.model_validate(resp.json())
    assert err.type == "error" and err.error.type == kind
    return err.error.message


def admin(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = post(port, path, body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 201, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_errors_parse_as_the_sdk_error_response(port: int) -> None:
    body = {"model": "a", "max_tokens": 4, "messages": USER}
    msgs, count = "/v1/messages", "/v1/messages/count_tokens"
    bad = error_of(post(port, msgs, {**body, "frequency_penalty": 1}), 400, "invalid_request_error")
    assert bad.startswith("frequency_penalty: ")
    missing = error_of(
        post(port, msgs, {"model": "a", "messages": USER}), 400, "invalid_request_error"
    )
    assert "'max_tokens'" in missing
    error_of(post(port, msgs, {**body, "max_tokens": "x"}), 400, "invalid_request_error")
    not_json = requests.post(
        f"http://127.0.0.1:{port}{msgs}",
        data=b"{",
        headers={**HEADERS, "Content-Type": "application/json"},
        timeout=30,
    )
    error_of(not_json, 400, "invalid_request_error")
    error_of(post(port, msgs, {**body, "model": "nope"}), 404, "not_found_error")
    error_of(post(port, count, {"model": "nope", "messages": USER}), 404, "not_found_error")
    error_of(post(port, msgs, body, headers={}), 401, "authentication_error")
    error_of(
        post(port, msgs, body, headers={"x-api-key": "rsk_0_wrong"}), 401, "authentication_error"
    )
    # Paths and methods of the Messages API that this box does not serve: still its envelope.
    error_of(post(port, "/v1/messages/batches", body), 404, "not_found_error")
    got = requests.get(f"http://127.0.0.1:{port}{msgs}", headers=HEADERS, timeout=30)
    error_of(got, 405, "invalid_request_error")

    # A key scoped to another model: 403; a user over its requests per minute: 429.
    admin(port, "/admin/users", {"name": "rl", "quotas": {"requests_per_minute": 1}})
    key = admin(port, "/admin/users/rl/keys", {"models": ["t"]})["key"]
    scoped = {**HEADERS, "x-api-key": key}
    error_of(post(port, msgs, body, headers=scoped), 403, "permission_error")
    first = post(port, count, {"model": "t", "messages": USER}, headers=scoped)
    assert first.status_code == 200, first.text
    limited = post(port, count, {"model": "t", "messages": USER}, headers=scoped)
    error_of(limited, 429, "rate_limit_error")
    assert int(limited.headers["Retry-After"]) >= 1


def test_the_sdk_raises_its_typed_errors(port: int) -> None:
    client = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{port}", api_key=ADMIN, max_retries=0, timeout=120
    )
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="a", max_tokens=4, messages=USER, extra_body={"frequency_penalty": 1}
        )
    ErrorResponse.model_validate(bad.value.body)
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="nope", max_tokens=4, messages=USER)
    ErrorResponse.model_validate(nf.value.body)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=USER)
    with pytest.raises(anthropic.AuthenticationError) as unauth:
        client.with_options(api_key="rsk_0_wrong").messages.create(
            model="a", max_tokens=4, messages=USER
        )
    ErrorResponse.model_validate(unauth.value.body)
    # A stream refused before it starts raises the same typed error.
    refused = client.messages.stream(model="nope", max_tokens=4, messages=USER)
    with pytest.raises(anthropic.NotFoundError), refused as s:
        list(s)
    # Over the body limit: 413, Anthropic's request_too_large (which the SDK's ErrorResponse
    # union does not list: the exception is typed by the status).
    with pytest.raises(anthropic.ContentTooLargeError) as big:
        client.messages.create(
            model="a", max_tokens=4, messages=[{"role": "user", "content": "x" * 2_000_000}]
        )
    assert big.value.body["error"]["type"] == "request_too_large"

    admin(port, "/admin/users", {"name": "sdk", "quotas": {"requests_per_minute": 1}})
    scoped = client.with_options(
        api_key=admin(port, "/admin/users/sdk/keys", {"models": ["t"]})["key"]
    )
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        scoped.messages.create(model="a", max_tokens=4, messages=USER)
    ErrorResponse.model_validate(denied.value.body)
    assert scoped.messages.count_tokens(model="t", messages=USER).input_tokens > 0
    with pytest.raises(anthropic.RateLimitError) as limited:
        scoped.messages.count_tokens(model="t", messages=USER)
    ErrorResponse.model_validate(limited.value.body)
