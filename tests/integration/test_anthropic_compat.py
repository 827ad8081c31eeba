"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), driven by the
official ``anthropic`` client over a real HTTP server, against real model processes
(llama.cpp, tiny GGUFs) on a box that requires API keys (the client sends its key as
``x-api-key``).

The tiny models emit random printable pieces and practically never end on their own; every
call here is forced by a grammar, so the assertions are on shapes, orders and counts, never on
free text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
import requests

from residency.tinymodel import write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import http_server
from tests.integration.tools_template import TOOLS_TEMPLATE

ADMIN = "test-admin-key"  # the pool's admin key (tests/conftest.py)
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
# One possible value per argument: the call is fully decided by the grammar.
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris"]}, "days": {"const": 3}},
        "required": ["city", "days"],
    },
}
FORCED: Any = {"type": "tool", "name": "get_weather"}
# Pieces the tiny models emit all the time (most of their vocabulary starts with a space):
# sampled at temperature 1, 100 tokens practically always hold one.
STOPS = [" ", "e", "a", "t"]


@pytest.fixture
def port(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[int]:
    """``a``: the plain ChatML tiny model; ``t``: one whose template takes tools. Keys are
    required (the default)."""
    tools_model = models_dir / "tiny-tools.gguf"
    if not tools_model.exists():
        write_tiny_model(tools_model, seed=5, chat_template=TOOLS_TEMPLATE)
    models = tiny_models(models_dir)
    models["t"] = {"path": str(tools_model), "n_ctx": 2048, "parallel": 1}
    pool = start_pool(models=models, auth={"required": True})
    with http_server(pool) as p:
        yield p


def client_at(port: int, key: str = ADMIN) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{port}", api_key=key, max_retries=0, timeout=120
    )


@pytest.fixture
def client(port: int) -> anthropic.Anthropic:
    return client_at(port)


def text_of(msg: Any) -> str:
    assert all(b.type == "text" for b in msg.content)
    return "".join(b.text for b in msg.content)


def test_text_whole_and_streamed(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="a", max_tokens=8, messages=USER)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "a"
    assert whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 8 and whole.usage.input_tokens > 0
    assert text_of(whole)

    with client.messages.stream(model="a", max_tokens=8, messages=USER) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    raw = [k for k in kinds if k not in ("text",)]  # the helper adds "text" events
    assert raw[-2] == "message_delta"
    assert raw.count("content_block_start") == raw.count("content_block_stop") == 1
    start = events[0]
    assert start.type == "message_start"
    # The prompt's tokens are known up front; the same prompt as the whole request.
    assert start.message.usage.input_tokens == whole.usage.input_tokens
    assert start.message.content == []
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    assert final.usage.input_tokens == whole.usage.input_tokens
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == text_of(final) != ""


def test_stop_sequences_whole_and_streamed(client: anthropic.Anthropic) -> None:
    kw: Any = {
        "model": "a",
        "max_tokens": 100,
        "messages": USER,
        "stop_sequences": STOPS,
        # Sent by hand: this client version has no temperature argument.
        "extra_body": {"temperature": 1.0},
    }
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "stop_sequence"
    assert whole.stop_sequence in STOPS
    assert not any(s in text_of(whole) for s in STOPS)
    assert whole.usage.output_tokens < 100

    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence in STOPS
    assert not any(s in text_of(final) for s in STOPS)


def test_a_system_prompt_is_part_of_the_prompt_and_counted(client: anthropic.Anthropic) -> None:
    plain = client.messages.create(model="a", max_tokens=1, messages=USER)
    system = "You are a weather bot. Answer in one word."
    with_system = client.messages.create(model="a", max_tokens=1, messages=USER, system=system)
    assert with_system.usage.input_tokens > plain.usage.input_tokens
    counted = client.messages.count_tokens(model="a", messages=USER, system=system)
    assert counted.input_tokens == with_system.usage.input_tokens
    blocks: Any = [{"type": "text", "text": system}]
    assert client.messages.count_tokens(model="a", messages=USER, system=blocks).input_tokens == (
        counted.input_tokens
    )
    assert (
        client.messages.count_tokens(model="a", messages=USER).input_tokens
        == plain.usage.input_tokens
    )


def test_a_forced_tool_call_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model="t", max_tokens=200, messages=USER, tools=[WEATHER], tool_choice=FORCED
    )
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris", "days": 3})
    # count_tokens counts what the request gives the model, tools included.
    counted = client.messages.count_tokens(
        model="t", messages=USER, tools=[WEATHER], tool_choice=FORCED
    )
    assert counted.input_tokens == first.usage.input_tokens
    assert client.messages.count_tokens(model="t", messages=USER).input_tokens < (
        counted.input_tokens
    )

    messages: Any = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "clear sky"},
                {"type": "text", "text": "So?"},
            ],
        },
    ]
    final = client.messages.create(model="t", max_tokens=8, messages=messages, tools=[WEATHER])
    # The tiny model answers junk; what matters is that it is an answer, not another call.
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert text_of(final)
    assert final.usage.input_tokens > first.usage.input_tokens
    assert (
        client.messages.count_tokens(model="t", messages=messages, tools=[WEATHER]).input_tokens
        == final.usage.input_tokens
    )


def test_a_streamed_tool_call_assembles_to_the_whole_one(client: anthropic.Anthropic) -> None:
    kw: Any = {
        "model": "t",
        "max_tokens": 200,
        "messages": USER,
        "tools": [WEATHER],
        "tool_choice": FORCED,
    }
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [call] = final.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris", "days": 3})
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    kinds = [e.type for e in events if e.type not in ("input_json",)]
    assert kinds[0] == "message_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_keys_and_errors_in_anthropics_envelope(port: int, client: anthropic.Anthropic) -> None:
    # A wrong key: 401 in Anthropic's envelope.
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client_at(port, "rsk_0123456789abcdef_wrong").messages.create(
            model="a", max_tokens=4, messages=USER
        )
    assert auth.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": auth.value.body["error"]["message"]},
    }
    # Without a key at all (the client always sends one): plain HTTP.
    resp = requests.post(
        f"http://127.0.0.1:{port}/v1/messages",
        json={"model": "a", "max_tokens": 4, "messages": USER},
        timeout=30,
    )
    assert resp.status_code == 401
    assert resp.json()["type"] == "error"
    # The same key as a bearer token works too (what OpenAI clients send).
    resp = requests.post(
        f"http://127.0.0.1:{port}/v1/messages",
        json={"model": "a", "max_tokens": 2, "messages": USER},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json()["type"] == "message"

    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="a",
            max_tokens=4,
            messages=USER,
            extra_body={"frequency_penalty": 1},
        )
    err = bad.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith("frequency_penalty: Extra inputs are not permitted")

    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="a",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )
    # Taken as an image, and refused by the model that cannot see it, by name.
    message = bad.value.body["error"]["message"]
    assert message.startswith("messages.0.content.0: ")
    assert "model 'a' cannot read images" in message

    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=4, messages=USER)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=USER)

    # The model process's 400 (a prompt past the model's context), in Anthropic's envelope.
    long = [{"role": "user", "content": "hello " * 2000}]
    with pytest.raises(anthropic.BadRequestError) as ctx:
        client.messages.create(model="a", max_tokens=4, messages=long)
    assert ctx.value.body["error"]["type"] == "invalid_request_error"
    assert "context length" in ctx.value.body["error"]["message"]
    # Streamed: refused before the stream starts, with its HTTP status.
    stream = client.messages.stream(model="a", max_tokens=4, messages=long)
    with pytest.raises(anthropic.BadRequestError), stream as s:
        list(s)


def test_what_claude_code_sends_is_accepted_and_what_was_ignored_is_named(port: int) -> None:
    # Claude Code's fields that change nothing here, and a system message mid-conversation.
    body = {
        "model": "a",
        "max_tokens": 1,
        "messages": [
            *USER,
            {"role": "assistant", "content": "Sunny."},
            {"role": "system", "content": [{"type": "text", "text": "Answer in French. " * 20}]},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "output_config": {"effort": "medium"},
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
    }
    url = f"http://127.0.0.1:{port}/v1/messages"
    auth = {"x-api-key": ADMIN}
    for stream in (False, True):
        resp = requests.post(url, json={**body, "stream": stream}, headers=auth, timeout=120)
        assert resp.status_code == 200, resp.text
        # thinking is not among them: it is the chat's reasoning_effort.
        assert resp.headers["x-residency-ignored"] == (
            "context_management, output_config.effort, tools[0] (web_search_20250305)"
        )
    whole = requests.post(url, json=body, headers=auth, timeout=120).json()
    without = dict(body, messages=[*USER, body["messages"][1], body["messages"][3]])
    shorter = requests.post(url, json=without, headers=auth, timeout=120).json()
    # The system message reached the model: it is part of the prompt.
    assert whole["usage"]["input_tokens"] > shorter["usage"]["input_tokens"] + 20
    # An error about a field, in Anthropic's words: its dotted path first.
    bad = dict(body, messages=[{"role": "robot", "content": "x"}])
    resp = requests.post(url, json=bad, headers=auth, timeout=60)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("messages.0.role: ")
