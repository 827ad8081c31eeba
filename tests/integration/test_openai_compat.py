"""OpenAI compatibility of chat, driven by the official ``openai`` client over a real HTTP server,
against real model processes (llama.cpp, tiny GGUFs): ``stream_options.include_usage``, tool
calls (forced and ``required`` calls, streamed and whole, and a round trip), and JSON schemas
enforced by a grammar.

The tiny models emit random tokens, so every call and every JSON answer here is forced by a
grammar; the assertions are on shapes, counts and validity, never on free text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from residency.tinymodel import write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import http_server
from tests.integration.tools_template import TOOLS_TEMPLATE

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# One possible value per argument: the call is fully decided by the grammar, so a stream and a
# whole answer must agree whatever the sampling did.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris"]}, "days": {"const": 3}},
            "required": ["city", "days"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"const": 1}, "b": {"const": 2}},
            "required": ["a", "b"],
        },
    },
}
FORCED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def client(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[openai.OpenAI]:
    """``a``: the plain ChatML tiny model (no tools in its template); ``t``: one whose
    template takes tools."""
    tools_model = models_dir / "tiny-tools.gguf"
    if not tools_model.exists():
        write_tiny_model(tools_model, seed=5, chat_template=TOOLS_TEMPLATE)
    models = tiny_models(models_dir)
    models["t"] = {"path": str(tools_model), "n_ctx": 2048, "parallel": 1}
    pool = start_pool(models=models)
    with http_server(pool) as port:
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )


# --- stream_options.include_usage -----------------------------------------------------------


def test_include_usage_ends_chat_and_completion_streams_with_the_usage(
    client: openai.OpenAI,
) -> None:
    whole = client.chat.completions.create(model="a", messages=USER, max_tokens=6)
    assert whole.usage is not None
    chunks = list(
        client.chat.completions.create(
            model="a",
            messages=USER,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert body and all(c.usage is None for c in body)
    assert "usage" in body[0].model_dump(exclude_unset=True)  # sent, as null
    assert last.choices == []
    assert last.id == body[0].id
    u = last.usage
    assert u is not None
    assert u.prompt_tokens == whole.usage.prompt_tokens
    [finish] = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert u.completion_tokens == 6 if finish == "length" else u.completion_tokens <= 6
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None
    cached = u.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 <= cached <= u.prompt_tokens

    # Completions too; and without the option no chunk carries usage.
    *body, last = list(
        client.completions.create(
            model="a",
            prompt="hello",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert last.choices == [] and last.usage is not None
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in body)
    plain = list(
        client.chat.completions.create(model="a", messages=USER, max_tokens=3, stream=True)
    )
    assert all(c.choices for c in plain)
    assert all("usage" not in c.model_dump(exclude_unset=True) for c in plain)

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="a",
            messages=USER,
            stream_options={"include_usage": True},
        )
    assert e.value.param == "stream_options"


# --- tools ------------------------------------------------------------------------------------


def test_tools_for_a_model_whose_template_cannot_take_them_are_described_in_the_prompt(
    client: openai.OpenAI,
) -> None:
    # The generic format (tests/integration/test_generic_tools.py): an answer, not a 400.
    for stream in (False, True):
        out = client.chat.completions.create(
            model="a",
            messages=USER,
            tools=[WEATHER],
            max_tokens=4,
            stream=stream,
        )
        if stream:
            assert list(out)
    # Calls there, forced or chosen: tests/integration/test_generic_tools.py (a model with
    # room for the tools' description).


def _call(msg: Any) -> tuple[str, Any]:
    [tc] = msg.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_")
    return tc.function.name, json.loads(tc.function.arguments)


def test_a_forced_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="t",
        messages=USER,
        tools=[WEATHER, ADD],
        tool_choice=FORCED,
        max_tokens=200,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _call(choice.message) == ("get_weather", {"city": "Paris", "days": 3})
    [tc] = choice.message.tool_calls or []
    messages: list[Any] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "clear"}'},
    ]
    final = client.chat.completions.create(
        model="t",
        messages=messages,
        tools=[WEATHER, ADD],
        max_tokens=8,
    )
    answer = final.choices[0]
    # The tiny model answers junk; what matters is that it is an answer, not another call.
    assert answer.finish_reason in ("stop", "length")
    assert isinstance(answer.message.content, str)
    assert not answer.message.tool_calls
    assert final.usage is not None and final.usage.prompt_tokens > 0


@pytest.mark.parametrize("choice", ["required", "forced"])
def test_streamed_tool_call_deltas_assemble_to_the_whole_call(
    client: openai.OpenAI, choice: str
) -> None:
    kw: dict[str, Any] = {
        "model": "t",
        "messages": USER,
        "tools": [WEATHER],
        "tool_choice": FORCED if choice == "forced" else "required",
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    expected = _call(whole.choices[0].message)
    assert expected == ("get_weather", {"city": "Paris", "days": 3})

    with client.chat.completions.stream(**kw) as stream:
        deltas = [e for e in stream if e.type == "chunk"]
        done = stream.get_final_completion()
    assert done.choices[0].finish_reason == "tool_calls"
    assert _call(done.choices[0].message) == expected
    # OpenAI's shape: the id, type and name come once, in the call's first delta.
    firsts = [
        tc
        for d in deltas
        for c in d.chunk.choices
        for tc in c.delta.tool_calls or []
        if tc.function is not None and tc.function.name
    ]
    assert len(firsts) == 1 and firsts[0].id and firsts[0].type == "function"


def test_required_streams_through_the_parser_with_two_tools(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="t",
            messages=USER,
            tools=[WEATHER, ADD],
            tool_choice="required",
            max_tokens=200,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls, [c.model_dump() for c in chunks]
    assert {tc.index for tc in calls} == {0}
    name = "".join(tc.function.name or "" for tc in calls if tc.function)
    args = json.loads("".join(tc.function.arguments or "" for tc in calls if tc.function))
    assert (name, args) in (
        ("get_weather", {"city": "Paris", "days": 3}),
        ("add", {"a": 1, "b": 2}),
    )
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --- JSON schemas -----------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "role": {"enum": ["admin", "user", "guest"]},
        "age": {"type": "integer"},
    },
    "required": ["name", "role", "age"],
    "additionalProperties": False,
}


def test_json_schema_answers_always_validate(client: openai.OpenAI) -> None:
    rf: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for i in range(20):
        out = client.chat.completions.create(
            model="a",
            messages=USER,
            response_format=rf,
            temperature=1.0,
            seed=i,
            # Room for the grammar to close: whitespace between tokens is free for the model.
            max_tokens=450,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    out = client.chat.completions.create(
        model="a",
        messages=USER,
        response_format={"type": "json_object"},
        max_tokens=450,
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content or ""), dict | list)


def test_a_schema_the_grammar_cannot_enforce_is_refused(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="a",
            messages=USER,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    assert e.value.param == "response_format.json_schema.schema.properties.n.maximum"
    assert e.value.code == "unsupported_schema"


# --- fields that change nothing -----------------------------------------------------------


def test_fields_a_chat_ignores_are_named_and_those_it_cannot_serve_refused(
    client: openai.OpenAI,
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="a",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        user="u",
        store=True,
        extra_body={"frobnicate": 1, "bad\u00e9name": 2},
    )
    # In the body's order, which the client chooses.
    named = raw.headers["x-residency-ignored"].split(", ")
    assert sorted(named) == ["(a field with an odd name)", "frobnicate", "store", "user"]
    plain = client.chat.completions.with_raw_response.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert "x-residency-ignored" not in plain.headers
    for extra in ({"audio": {"voice": "alloy"}}, {"modalities": ["text", "audio"]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="a", messages=[{"role": "user", "content": "hi"}], extra_body=extra
            )
        assert (e.value.param, e.value.code) == (next(iter(extra)), "unsupported")
