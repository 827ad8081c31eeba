"""The ``script_text`` fault: a model's next generations produce given texts, token by token,
through the real engine and output path (real Redis, real model processes running llama.cpp on
tiny GGUFs, requests through the official ``openai`` client over a real HTTP server).

What runs for real is what the assertions check: the text, the finish reason, the usage, a
tool call parsed from the text (whole and streamed), ``max_tokens``, and a grammar that still
has the last word.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import requests

from residency import keys
from residency.tinymodel import write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import http_server
from tests.integration.tools_template import TOOLS_TEMPLATE

ADMIN = {"Authorization": "Bearer test-admin-key"}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@dataclass
class Box:
    pool: Pool
    client: openai.OpenAI
    base: str

    def script(self, **texts: Any) -> None:
        resp = requests.post(
            f"{self.base}/admin/faults", json={"script_text": texts}, headers=ADMIN, timeout=30
        )
        assert resp.status_code == 200, resp.text

    def left(self, model: str) -> list[str] | None:
        raw = self.pool.r.hget(keys.faults(), f"script_text:{model}")
        return None if raw is None else list(json.loads(str(raw)))


@pytest.fixture
def box(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[Box]:
    """``a``: the plain ChatML tiny model; ``t``: one whose template takes tools."""
    tools_model = models_dir / "tiny-tools.gguf"
    if not tools_model.exists():
        write_tiny_model(tools_model, seed=5, chat_template=TOOLS_TEMPLATE)
    models = tiny_models(models_dir)
    models["t"] = {"path": str(tools_model), "n_ctx": 2048, "parallel": 2}
    pool = start_pool(models=models, debug={"fault_injection": True})
    with http_server(pool) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield Box(pool, client, base)


def _chat(box: Box, model: str = "a", **kw: Any) -> Any:
    return box.client.chat.completions.create(
        model=model, messages=kw.pop("messages", USER), **{"max_tokens": 200, **kw}
    )


def _streamed(box: Box, model: str = "a", **kw: Any) -> tuple[str, list[Any], str | None, Any]:
    """(content, tool call deltas, finish reason, usage) of a streamed chat answer."""
    content, finish, usage = "", None, None
    calls: list[Any] = []
    for chunk in _chat(box, model, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return content, calls, finish, usage


def test_a_scripted_text_is_the_next_answer_whole_or_streamed_and_is_used_once(box: Box) -> None:
    text = "Hello world, this answer is scripted: 42 é."
    box.script(a=text)
    whole = _chat(box)
    assert whole.choices[0].message.content == text
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens > 0
    assert box.left("a") is None  # taken by that request

    own = _chat(box, max_tokens=8)
    assert own.choices[0].message.content != text  # the model's own again

    box.script(a=text)
    content, calls, finish, usage = _streamed(box)
    assert (content, calls, finish) == (text, [], "stop")
    # The same tokens through the streaming path: the same count.
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_list_of_texts_is_taken_in_order_one_per_request(box: Box) -> None:
    box.script(a=["first", "second"])
    assert _chat(box).choices[0].message.content == "first"
    assert box.left("a") == ["second"]
    assert _chat(box).choices[0].message.content == "second"
    assert box.left("a") is None
    assert _chat(box, max_tokens=8).choices[0].message.content not in ("first", "second")
    # Another model's script is its own.
    box.script(t="for t")
    assert _chat(box, max_tokens=8).choices[0].message.content != "for t"
    assert _chat(box, "t").choices[0].message.content == "for t"


def test_a_scripted_completion_is_the_next_completions_text(box: Box) -> None:
    box.script(a=" once upon a time")
    out = box.client.completions.create(model="a", prompt="Tell me", max_tokens=50)
    assert out.choices[0].text == " once upon a time"
    assert out.choices[0].finish_reason == "stop"


def test_a_scripted_tool_call_then_a_scripted_answer_is_a_real_round_trip(box: Box) -> None:
    box.script(t=[CALL, "It is sunny in Oslo."])
    first = _chat(box, "t", tools=[WEATHER], tool_choice="auto")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content in (None, "")
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = _chat(box, "t", messages=history, tools=[WEATHER], tool_choice="auto")
    assert second.choices[0].message.content == "It is sunny in Oslo."
    assert second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls


def test_a_scripted_tool_call_streams_as_call_deltas(box: Box) -> None:
    box.script(t=CALL)
    content, calls, finish, _ = _streamed(box, "t", tools=[WEATHER], tool_choice="auto")
    assert content == "" and finish == "tool_calls"
    assert {c.function.name for c in calls if c.function.name} == {"get_weather"}
    args = "".join(c.function.arguments or "" for c in calls)
    assert json.loads(args) == {"city": "Oslo"}


def test_max_tokens_still_ends_a_scripted_generation(box: Box) -> None:
    text = "one two three four five six seven eight nine ten"
    box.script(a=text)
    out = _chat(box, max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3
    got = out.choices[0].message.content
    assert got and text.startswith(got) and got != text


def test_the_grammar_has_the_last_word_over_a_script(box: Box) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    rf: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    box.script(a='{"ok": true}')
    assert _chat(box, response_format=rf).choices[0].message.content == '{"ok": true}'
    # A script the grammar refuses: the answer still follows the schema, not the script.
    box.script(a="not json at all")
    got = _chat(box, response_format=rf).choices[0].message.content
    assert got != "not json at all"
    jsonschema.validate(json.loads(got), schema)
