"""A model's reasoning kept apart from its answer, through each API's translation (pure: no box).

What the model processes answer (chat completions): ``message.reasoning_content`` in a whole
answer, ``delta.reasoning_content`` chunks before the content in a stream, and
``usage.completion_tokens_details.reasoning_tokens``. Here recorded answers and chunk streams of
that shape go through each translator, and what comes out is parsed with the official
``openai`` and ``anthropic`` clients' own types: chat passes the field through, Messages makes
a ``thinking`` block before the text, Responses a ``reasoning`` item before the message. The
requests' side: ``reasoning_effort`` (chat), ``reasoning.effort`` (Responses) and ``thinking``
(Messages) ask for an effort, and reasoning sent back in a conversation's history becomes the
assistant turn's ``reasoning_content``.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response
from openai.types.responses.response_stream_event import ResponseStreamEvent

from residency.errors import ApiError
from tests.fixtures.openai_schemas import RESPONSE_EVENTS, check
from web import anthropic, responses_request, validation
from web.openai_api import ChunkStream
from web.responses_output import Events, Meta, from_chat

META = Meta("resp_1", 1700000000, "m")
THOUGHT = "The user greets me; a greeting back fits."
ANSWER = "Hello!"
USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 12,
    "total_tokens": 19,
    "completion_tokens_details": {"reasoning_tokens": 9},
}
RESPONSE_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
ANTHROPIC_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)


def whole(content: str | None = ANSWER, reasoning: str | None = THOUGHT, **msg: Any) -> Any:
    """A whole chat answer as a model process gives it."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, **msg}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    finish = "tool_calls" if msg.get("tool_calls") else "stop"
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": USAGE,
    }


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


USAGE_CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [],
    "usage": USAGE,
}
#: A stream as a model process sends it: the reasoning first, in pieces, then the answer.
STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "The user greets me; "}),
    chunk({"reasoning_content": "a greeting back fits."}),
    chunk({"content": "Hel"}),
    chunk({"content": "lo!"}),
    chunk({}, "stop"),
    USAGE_CHUNK,
]


# --- chat completions -------------------------------------------------------------------------


@pytest.mark.parametrize("effort", validation.REASONING_EFFORTS)
def test_chat_passes_reasoning_effort_to_the_model(effort: str) -> None:
    v = validation.validate_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": effort}
    )
    assert v.params["reasoning_effort"] == effort


@pytest.mark.parametrize(("effort", "code"), [("max", "invalid_value"), (3, "invalid_type")])
def test_chat_refuses_another_reasoning_effort_naming_it(effort: Any, code: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as e:
        validation.validate_chat({**body, "reasoning_effort": effort})
    assert (e.value.status, e.value.param, e.value.code) == (400, "reasoning_effort", code)


def test_chat_history_keeps_an_assistant_turns_reasoning() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
        {"role": "user", "content": "and?"},
    ]
    v = validation.validate_chat({"model": "m", "messages": messages})
    assert v.params["messages"][1] == {
        "role": "assistant",
        "content": ANSWER,
        "reasoning_content": THOUGHT,
    }
    for bad, param in (
        (
            {"role": "user", "content": "x", "reasoning_content": "y"},
            "messages[0].reasoning_content",
        ),
        (
            {"role": "assistant", "content": "x", "reasoning_content": 1},
            "messages[0].reasoning_content",
        ),
    ):
        with pytest.raises(ApiError) as e:
            validation.validate_chat({"model": "m", "messages": [bad]})
        assert (e.value.status, e.value.param) == (400, param)


def test_chat_answers_pass_the_reasoning_through_whole_and_streamed() -> None:
    answer = whole()
    check("CreateChatCompletionResponse", answer)
    parsed = ChatCompletion.model_validate(answer)
    assert parsed.choices[0].message.content == ANSWER  # the reasoning is not in the answer
    # The SDK keeps a field it does not model, as it came.
    assert parsed.choices[0].message.model_extra == {"reasoning_content": THOUGHT}

    dialect = ChunkStream("m", None)
    lines = [dialect.chunk(c) for c in STREAM]
    got = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert got == STREAM  # unchanged, every field
    reasoning, content = "", ""
    for c in got:
        check("CreateChatCompletionStreamResponse", c)
        for choice in ChatCompletionChunk.model_validate(c).choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content", "")
            content += choice.delta.content or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)


# --- Anthropic Messages: requests -------------------------------------------------------------


def messages_body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize(
    ("thinking", "effort"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, "low"),
        ({"type": "enabled", "budget_tokens": 4095}, "low"),
        ({"type": "enabled", "budget_tokens": 4096}, "medium"),
        ({"type": "enabled", "budget_tokens": 16383}, "medium"),
        ({"type": "enabled", "budget_tokens": 16384}, "high"),
        ({"type": "enabled", "budget_tokens": 31999}, "high"),  # Claude Code's
        ({"type": "disabled"}, "none"),
        ({"type": "adaptive"}, None),
        (None, None),
    ],
)
def test_messages_thinking_asks_for_an_effort(thinking: Any, effort: str | None) -> None:
    body = messages_body() if thinking is None else messages_body(thinking=thinking)
    for count in (False, True):  # count_tokens too: a template may render "none" differently
        if count:
            body = {k: x for k, x in body.items() if k != "max_tokens"}
        ignored: list[str] = []
        chat = anthropic.to_chat(body, count=count, ignored=ignored)
        assert chat.get("reasoning_effort") == effort
        assert ignored == []  # thinking is used, not ignored
        assert validation.validate_chat(chat).params.get("reasoning_effort") == effort


def test_messages_thinking_display_is_ignored_and_named() -> None:
    ignored: list[str] = []
    thinking = {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}
    chat = anthropic.to_chat(messages_body(thinking=thinking), ignored=ignored)
    assert (chat["reasoning_effort"], ignored) == ("low", ["thinking.display"])


@pytest.mark.parametrize(
    ("thinking", "param"),
    [
        ("on", "thinking"),
        ({"type": "sometimes"}, "thinking.type"),
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": "lots"}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 1023}, "thinking.budget_tokens"),
        ({"type": "disabled", "budget_tokens": 2048}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 2048, "depth": 3}, "thinking.depth"),
    ],
)
def test_messages_bad_thinking_is_refused_naming_the_field(thinking: Any, param: str) -> None:
    with pytest.raises(ApiError) as e:
        anthropic.to_chat(messages_body(thinking=thinking))
    assert (e.value.status, e.value.param) == (400, param)
    assert anthropic.error_body(e.value)["error"]["message"].startswith(f"{param}:")


def test_messages_thinking_blocks_in_history_become_reasoning_content() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I need the weather tool.", "signature": ""},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Let me look."},
                call,
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "It is sunny.", "signature": "c2ln"},
                {"type": "thinking", "thinking": "Say so.", "signature": "c2ln"},
                {"type": "text", "text": "Sunny."},
            ],
        },
        {"role": "user", "content": "Thanks"},
    ]
    chat = anthropic.to_chat(messages_body(messages=history))
    v = validation.validate_chat(chat)
    first, second = (m for m in v.params["messages"] if m["role"] == "assistant")
    assert first["reasoning_content"] == "I need the weather tool."  # the redacted one dropped
    assert first["content"] == "Let me look." and len(first["tool_calls"]) == 1
    assert second == {
        "role": "assistant",
        "content": "Sunny.",
        "reasoning_content": "It is sunny.\nSay so.",
    }
    # Only redacted: nothing of it reaches the model.
    only = [{"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "ok"}]
    chat = anthropic.to_chat(messages_body(messages=[{"role": "assistant", "content": only}]))
    assert chat["messages"] == [{"role": "assistant", "content": "ok"}]


# --- Anthropic Messages: answers --------------------------------------------------------------


def test_messages_answer_has_a_thinking_block_before_its_text() -> None:
    out = anthropic.to_message(whole(), "m")
    parsed = Message.model_validate(out)
    assert [b.type for b in parsed.content] == ["thinking", "text"]
    assert out["content"][0] == {"type": "thinking", "thinking": THOUGHT, "signature": ""}
    assert out["content"][1] == {"type": "text", "text": ANSWER}
    assert out["usage"]["output_tokens"] == 12  # Anthropic counts the thinking as output
    # Without reasoning, no thinking block; with a tool call, thinking, then the call.
    assert [b["type"] for b in anthropic.to_message(whole(reasoning=None), "m")["content"]] == [
        "text"
    ]
    tc = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    out = anthropic.to_message(whole(None, tool_calls=[tc]), "m")
    assert [b["type"] for b in out["content"]] == ["thinking", "tool_use"]
    assert out["stop_reason"] == "tool_use"


def anthropic_stream(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ev = anthropic.StreamEvents("m")
    out: list[dict[str, Any]] = []
    for c in chunks:
        out += ev.feed(c)
    out += ev.end()
    for e in out:
        ANTHROPIC_EVENT.validate_python(e)  # every event as the official client models it
    return out


def test_messages_stream_has_a_thinking_block_then_the_text_block() -> None:
    events = anthropic_stream(STREAM)
    kinds = [
        (e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
        for e in events
    ]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[4]["delta"] == {"type": "signature_delta", "signature": ""}
    # What the SDK's own stream accumulator makes of it is the whole answer.
    snapshot: Any = None
    for e in events:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs={})
    got = [b.to_dict() for b in snapshot.content]
    assert got == anthropic.to_message(whole(), "m")["content"]


def test_messages_stream_of_reasoning_then_a_tool_call() -> None:
    call = {"index": 0, "id": "call_1", "type": "function"}
    events = anthropic_stream(
        [
            chunk({"reasoning_content": "A tool."}),
            chunk({"tool_calls": [{**call, "function": {"name": "f", "arguments": "{}"}}]}),
            chunk({}, "tool_calls"),
        ]
    )
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [
        (0, "thinking"),
        (1, "tool_use"),
    ]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


# --- Responses: requests ----------------------------------------------------------------------


def responses_chat(**kw: Any) -> dict[str, Any]:
    tr = responses_request.to_chat({"model": "m", "input": "hi", **kw})
    validation.validate_chat(tr.chat)  # what the route does next: it must take it
    return tr.chat


def test_responses_effort_becomes_reasoning_effort_and_the_summary_stays_ignored() -> None:
    tr = responses_request.to_chat(
        {"model": "m", "input": "hi", "reasoning": {"effort": "high", "summary": "auto"}}
    )
    assert tr.chat["reasoning_effort"] == "high"
    assert tr.ignored == ("reasoning.summary",)
    assert tr.echo["reasoning"] == {"effort": "high", "summary": None}
    assert "reasoning_effort" not in responses_chat(reasoning={"summary": "auto"})
    with pytest.raises(ApiError) as e:
        responses_request.to_chat({"model": "m", "input": "hi", "reasoning": {"effort": "max"}})
    assert (e.value.param, e.value.code) == ("reasoning.effort", "invalid_value")


def test_responses_reasoning_items_go_to_the_assistant_turn_after_them() -> None:
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": THOUGHT}],
    }
    summarized = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "Use the tool."}],
        "encrypted_content": "opaque",
    }
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    chat = responses_chat(
        input=[
            {"role": "user", "content": "hi"},
            reasoning,
            {"role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]},
            {"role": "user", "content": "weather?"},
            summarized,
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},  # unreadable
            {"role": "assistant", "content": "Sunny."},
            reasoning,  # nothing follows it: dropped
            {"role": "user", "content": "thanks"},
        ]
    )
    assert chat["messages"] == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": ANSWER}],
            "reasoning_content": THOUGHT,
        },
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
            "reasoning_content": "Use the tool.",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "thanks"},
    ]


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "reasoning", "content": "x"}, "input[0].content"),
        ({"type": "reasoning", "content": ["x"]}, "input[0].content[0]"),
        (
            {"type": "reasoning", "content": [{"type": "text", "text": "x"}]},
            "input[0].content[0].type",
        ),
        (
            {"type": "reasoning", "content": [{"type": "reasoning_text"}]},
            "input[0].content[0].text",
        ),
        (
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": 1}]},
            "input[0].summary[0].text",
        ),
    ],
)
def test_responses_bad_reasoning_items_are_refused_naming_the_field(item: Any, param: str) -> None:
    with pytest.raises(ApiError) as e:
        responses_request.to_chat({"model": "m", "input": [item, {"role": "user", "content": "x"}]})
    assert (e.value.status, e.value.param) == (400, param)


# --- Responses: answers -----------------------------------------------------------------------


def test_responses_answer_has_a_reasoning_item_before_its_message() -> None:
    r = from_chat(whole(), responses_request.to_chat({"model": "m", "input": "hi"}).echo, META)
    check("Response", r)
    parsed = Response.model_validate(r)
    assert parsed.output_text == ANSWER  # the reasoning is not in the answer's text
    item, message = r["output"]
    assert item["id"].startswith("rs_")
    assert {k: x for k, x in item.items() if k != "id"} == {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": THOUGHT}],
        "status": "completed",
    }
    assert message["type"] == "message"
    assert r["usage"]["output_tokens_details"] == {"reasoning_tokens": 9}
    assert r["usage"]["output_tokens"] == 12
    # Without reasoning: no item, and no reasoning tokens.
    plain = from_chat({**whole(reasoning=None), "usage": {"prompt_tokens": 1}}, {}, META)
    assert [o["type"] for o in plain["output"]] == ["message"]
    assert plain["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


def responses_stream(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ev = Events(META, responses_request.to_chat({"model": "m", "input": "hi"}).echo)
    out = ev.start()
    for c in chunks:
        out += ev.feed(c)
    out += ev.finish()
    for e in out:
        RESPONSE_EVENT.validate_python(e)  # as the official client models it
        check(RESPONSE_EVENTS[e["type"]], e)  # as OpenAI's published schema has it
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def _without_ids(r: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(r))
    for item in out["output"]:
        item.pop("id")
    return dict(out)


def test_responses_stream_has_the_reasoning_item_then_the_message() -> None:
    events = responses_stream(STREAM)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[2]["item"]
    assert (added["type"], added["status"], added["content"]) == ("reasoning", "in_progress", [])
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert [e["output_index"] for e in events[2:9]] == [0] * 7
    assert [e["output_index"] for e in events[9:16]] == [1] * 7
    assert events[6]["text"] == THOUGHT
    assert events[8]["item"]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert events[13]["text"] == ANSWER
    # The last event's response is what the whole answer would have been (but for ids).
    final = events[-1]["response"]
    echo = responses_request.to_chat({"model": "m", "input": "hi"}).echo
    assert _without_ids(final) == _without_ids(from_chat(whole(), echo, META))
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 9}


def test_responses_reasoning_only_cut_by_the_limit_ends_as_a_whole_answer_would() -> None:
    echo = responses_request.to_chat({"model": "m", "input": "hi"}).echo
    events = responses_stream(
        [
            chunk({"reasoning_content": "Hmm, "}),
            chunk({"reasoning_content": "let"}),
            chunk({}, "length"),
        ]
    )
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    cut = whole(None, "Hmm, let")
    cut["choices"][0]["finish_reason"] = "length"
    cut.pop("usage")
    expected = from_chat(cut, echo, META)
    assert _without_ids(final) == _without_ids(expected)
    # The reasoning, then an empty message (the answer that never came) that was cut.
    assert [(o["type"], o["status"]) for o in final["output"]] == [
        ("reasoning", "completed"),
        ("message", "incomplete"),
    ]
