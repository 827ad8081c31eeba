"""The Responses API (``POST /v1/responses``) driven by the official ``openai`` client over a real
HTTP server, against real model processes (llama.cpp, tiny GGUFs): text answers with their
usage, instructions, JSON schemas, forced function calls and their outputs sent back, what is
refused, and streams whose events come in order and end with what a whole answer would be.

The tiny models emit random tokens: every call and every JSON answer here is forced by a
grammar, and the assertions are on shapes, orders, counts and validity, never on free text.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration.test_openai_compat import PERSON, client

__all__ = ["client"]  # the fixture: models "a" (plain ChatML) and "t" (a template with tools)

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris"]}, "days": {"const": 3}},
        "required": ["city", "days"],
    },
    "strict": True,
}
FORCED: Any = {"type": "function", "name": "get_weather"}
QUESTION = "What is the weather in Paris?"


def _usage_adds_up(r: Any) -> None:
    u = r.usage
    assert u is not None
    assert u.input_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0


def test_a_text_answer_with_its_usage_and_instructions(client: openai.OpenAI) -> None:
    r = client.responses.create(model="a", input=QUESTION, max_output_tokens=6)
    assert (r.object, r.model) == ("response", "a")
    assert r.id.startswith("resp_")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert isinstance(r.output_text, str)
    _usage_adds_up(r)
    assert r.usage is not None and r.usage.output_tokens <= 6
    if r.status == "incomplete":
        assert r.usage.output_tokens == 6
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.max_output_tokens == 6 and r.tools == [] and r.tool_choice == "auto"

    told = client.responses.create(
        model="a", input=QUESTION, instructions="Answer in French.", max_output_tokens=2
    )
    assert told.instructions == "Answer in French."
    # The instructions are a system message before the question: more input tokens.
    assert told.usage is not None and told.usage.input_tokens > r.usage.input_tokens


def test_an_answer_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    # A string of at least 200 characters cannot close within 5 tokens: always cut.
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 200, "maxLength": 256}},
        "required": ["s"],
    }
    fmt: Any = {"type": "json_schema", "name": "long", "schema": schema}
    r = client.responses.create(
        model="a", input=QUESTION, text={"format": fmt}, max_output_tokens=5
    )
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 5
    assert r.output[0].status == "incomplete"


def test_json_schema_answers_parse_and_validate(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    for _ in range(5):
        r = client.responses.create(
            model="a",
            input=QUESTION,
            text={"format": fmt},
            temperature=1.0,
            # Room for the grammar to close: whitespace between tokens is free for the model.
            max_output_tokens=450,
        )
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), PERSON)
        assert r.text is not None and r.text.format is not None
        assert r.text.format.type == "json_schema"


def _call(r: Any) -> Any:
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
    assert call.status == "completed"
    return call


def test_a_forced_function_call_and_its_output_sent_back(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="t", input=QUESTION, tools=[WEATHER], tool_choice=FORCED, max_output_tokens=200
    )
    assert first.status == "completed"
    call = _call(first)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    assert first.output_text == ""

    final = client.responses.create(
        model="t",
        input=[
            {"role": "user", "content": QUESTION},
            *first.output,  # the items as they came, sent back
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'},
        ],
        tools=[WEATHER],
        max_output_tokens=8,
    )
    # The tiny model answers junk; what matters is that it is an answer, not another call.
    assert [o.type for o in final.output] == ["message"]
    assert isinstance(final.output_text, str)
    _usage_adds_up(final)
    assert final.usage is not None and first.usage is not None
    assert final.usage.input_tokens > first.usage.input_tokens  # the call and its output


def test_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="a", input=QUESTION, previous_response_id="resp_123")
    assert e.value.param == "previous_response_id"
    assert "does not store responses" in e.value.message
    assert "send the whole conversation in `input`" in e.value.message

    # A hosted tool is dropped (this box runs none) unless the request names it.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="a",
            input=QUESTION,
            tools=[{"type": "web_search"}],
            tool_choice={"type": "web_search"},  # type: ignore[arg-type,typeddict-item]
        )
    assert (e.value.param, e.value.code) == ("tool_choice.type", "unsupported_tool")

    # A model whose template cannot take tools, asked to choose: answered (the generic format).
    out = client.responses.create(model="a", input=QUESTION, tools=[WEATHER], max_output_tokens=4)
    assert out.status in ("completed", "incomplete")

    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input=QUESTION)


EXPECTED_TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    # response.output_text.delta, once per piece of text
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_a_stream_in_order_ends_with_the_whole_answer(client: openai.OpenAI) -> None:
    kw: Any = {"model": "a", "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[-1] == end
    body = [k for k in kinds[:-1] if k != "response.output_text.delta"]
    assert body == EXPECTED_TEXT_EVENTS
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds.index("response.output_text.done") == 4 + len(deltas)

    final = events[-1].response  # type: ignore[union-attr]
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.status == whole.status
    assert final.output_text == "".join(deltas) == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
        whole.usage.total_tokens,
    )


def test_a_streamed_function_call_assembles_to_the_whole_call(client: openai.OpenAI) -> None:
    kw: Any = {
        "model": "t",
        "input": QUESTION,
        "tools": [WEATHER],
        "tool_choice": FORCED,
        "max_output_tokens": 200,
        "temperature": 0,
    }
    whole = client.responses.create(**kw)
    expected = _call(whole)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    added = events[2].item  # type: ignore[union-attr]
    assert (added.type, added.name) == ("function_call", "get_weather")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments  # type: ignore[union-attr]
    assert json.loads(args) == json.loads(expected.arguments)
    final = events[-1].response  # type: ignore[union-attr]
    assert _call(final).call_id == added.call_id

    # The client's own stream helper checks every event against its running snapshot.
    with client.responses.stream(**kw) as stream:
        done = stream.get_final_response()
    assert json.loads(_call(done).arguments) == {"city": "Paris", "days": 3}


def test_what_codex_sends_is_accepted_and_what_was_ignored_is_named(
    client: openai.OpenAI,
) -> None:
    # Codex CLI's fields that change nothing here, on every request it makes.
    raw = client.responses.with_raw_response.create(
        model="a",
        input=QUESTION,
        max_output_tokens=2,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "medium", "summary": "auto"},
        tools=[{"type": "web_search"}],
        extra_body={"client_metadata": {"x-codex-turn-metadata": "{}"}},
    )
    # reasoning.effort is not among them: it is the chat's reasoning_effort.
    assert raw.headers["x-residency-ignored"] == (
        "client_metadata, reasoning.summary, include, tools[0] (web_search)"
    )
    r = raw.parse()
    assert r.status == "incomplete" and r.tools == []
    # Nothing ignored: no header.
    plain = client.responses.with_raw_response.create(
        model="a", input=QUESTION, max_output_tokens=1
    )
    assert "x-residency-ignored" not in plain.headers
    # A field that would change the answer is still refused, by name.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="a", input=QUESTION, max_output_tokens=1, extra_body={"frobnicate": 1}
        )
    assert (e.value.param, e.value.code) == ("frobnicate", "unknown_parameter")
