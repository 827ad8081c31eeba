"""The Responses API translated onto chat (web.responses_request, web.responses_output): requests
to chat bodies that the chat validator takes, chat answers and streams to Response objects and
events that the official ``openai`` client's models validate, and every refused field named."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from openai.types.responses import Response
from openai.types.responses.response_stream_event import ResponseStreamEvent

from residency.errors import ApiError
from web.responses_output import Events, Meta, from_chat
from web.responses_request import NOT_STORED, to_chat
from web.validation import validate_chat

META = Meta("resp_1", 1700000000, "m")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": True,
}
USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 3,
    "total_tokens": 10,
    "prompt_tokens_details": {"cached_tokens": 2},
}
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


def req(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **kw}


def chat_of(**kw: Any) -> dict[str, Any]:
    tr = to_chat(req(**kw))
    validate_chat(tr.chat)  # what the route does next: it must take every translation
    return tr.chat


# --- requests ---------------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert chat_of()["messages"] == [{"role": "user", "content": "hi"}]
    chat = chat_of(instructions="Be brief.", max_output_tokens=20, temperature=0, top_p=0.5)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"]) == (20, 0, 0.5)
    assert chat["stream"] is False and "stream_options" not in chat


def test_a_stream_asks_chat_for_the_usage() -> None:
    tr = to_chat(req(stream=True))
    assert tr.stream is True
    assert tr.chat["stream_options"] == {"include_usage": True}


def test_message_items_with_parts_and_roles() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        # An output item sent back as it came: its id, status and annotations are ignored.
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "c", "annotations": []}],
        },
        {"role": "user", "content": "d"},
    ]
    v = validate_chat(to_chat(req(input=items)).chat)
    assert v.params["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]


def test_function_calls_and_their_outputs_become_tool_calls_and_tool_messages() -> None:
    items = [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "content": "Looking."},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {
            "type": "function_call",
            "id": "fc_2",
            "status": "completed",
            "call_id": "c2",
            "name": "get_weather",
            "arguments": '{"city": "Rome"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "rain"}],
        },
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "fog"},
    ]
    msgs = chat_of(input=items, tools=[WEATHER])["messages"]
    call = lambda i, a: {  # noqa: E731
        "id": i,
        "type": "function",
        "function": {"name": "get_weather", "arguments": a},
    }
    assert msgs == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        # The text and the calls after it are one assistant turn.
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [call("c1", "{}"), call("c2", '{"city": "Rome"}')],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", "{}")]},
        {"role": "tool", "tool_call_id": "c3", "content": "fog"},
    ]


def test_an_answers_output_items_round_trip_into_the_next_request() -> None:
    first = from_chat(
        {
            "choices": [
                {
                    "message": {
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_9",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{}"},
                            }
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        },
        to_chat(req(tools=[WEATHER])).echo,
        META,
    )
    items = [
        {"role": "user", "content": "hi"},
        *first["output"],
        {"type": "function_call_output", "call_id": "call_9", "output": "ok"},
    ]
    msgs = chat_of(input=items, tools=[WEATHER])["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["tool_calls"][0]["id"] == msgs[2]["tool_call_id"] == "call_9"


def test_tools_tool_choice_and_text_format_translate_to_chat() -> None:
    chat = chat_of(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER["parameters"],
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "none", "required"):
        assert chat_of(tools=[WEATHER], tool_choice=choice)["tool_choice"] == choice
    assert "tool_choice" not in chat_of(tool_choice="auto")

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    v = validate_chat(to_chat(req(text={"format": fmt})).chat)
    assert v.params["response_format"] == {"type": "json_object", "schema": schema}
    obj = chat_of(text={"format": {"type": "json_object"}})
    assert obj["response_format"] == {"type": "json_object"}
    assert "response_format" not in chat_of(text={"format": {"type": "text"}})


def test_the_echo_repeats_the_parameters_in_the_responses_form() -> None:
    tr = to_chat(
        req(
            instructions="x",
            tools=[WEATHER],
            tool_choice="required",
            metadata={"k": "v"},
            store=True,
            user="u",
            reasoning={},
            include=[],
            max_output_tokens=9,
        )
    )
    e = tr.echo
    assert e["tools"] == [WEATHER] and e["tool_choice"] == "required"
    assert (e["instructions"], e["metadata"], e["user"]) == ("x", {"k": "v"}, "u")
    assert e["store"] is False  # nothing is stored, whatever was asked
    assert e["max_output_tokens"] == 9 and e["parallel_tool_calls"] is True
    assert e["text"] == {"format": {"type": "text"}}
    assert to_chat(req()).echo["tool_choice"] == "auto"


def test_fields_that_change_nothing_are_accepted_and_named() -> None:
    # What Codex CLI sends on every request, beside its own function tools.
    tr = to_chat(
        req(
            client_metadata={"x-codex-turn": "1"},
            include=["reasoning.encrypted_content"],
            reasoning={"effort": "medium", "summary": "auto"},
            tools=[WEATHER, {"type": "web_search"}, {"type": "namespace", "name": "mcp"}],
            prompt_cache_key="k",
        )
    )
    assert tr.ignored == (
        "client_metadata",
        "reasoning.summary",
        "include",
        "tools[1] (web_search)",
        "tools[2] (namespace)",
    )
    assert [t["function"]["name"] for t in tr.chat["tools"]] == ["get_weather"]
    assert tr.chat["reasoning_effort"] == "medium"  # the effort is used, the summary not
    assert tr.echo["tools"] == [WEATHER]
    assert to_chat(req(reasoning={}, include=[])).ignored == ()
    # Only hosted tools: the request goes on without tools.
    assert "tools" not in to_chat(req(tools=[{"type": "web_search"}])).chat


BAD: list[tuple[dict[str, Any], str, str | None]] = [
    ({"input": "hi"}, "model", "missing_required"),
    ({"model": "m"}, "input", "missing_required"),
    (req(input=[]), "input", None),
    (req(input=5), "input", "invalid_type"),
    (req(previous_response_id="resp_1"), "previous_response_id", "unsupported"),
    (req(conversation="conv_1"), "conversation", "unsupported"),
    (req(background=True), "background", "unsupported"),
    (req(frobnicate=1), "frobnicate", "unknown_parameter"),
    (req(tools=[{"type": 5}]), "tools[0].type", "invalid_type"),
    (req(tools=[{"type": "function"}]), "tools[0].name", "missing_required"),
    (req(tools=[WEATHER, WEATHER]), "tools[1].name", None),
    (
        req(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}),
        "tool_choice.name",
        None,
    ),
    (
        req(tools=[WEATHER, {"type": "web_search"}], tool_choice={"type": "web_search"}),
        "tool_choice.type",
        "unsupported_tool",
    ),
    (req(tool_choice="required"), "tool_choice", None),
    (req(tool_choice="sometimes"), "tool_choice", None),
    (req(reasoning="high"), "reasoning", "invalid_type"),
    (req(include="all"), "include", "invalid_type"),
    (req(truncation="auto"), "truncation", "unsupported"),
    (req(max_output_tokens=0), "max_output_tokens", "invalid_value"),
    (req(max_output_tokens="9"), "max_output_tokens", "invalid_type"),
    (req(stream="yes"), "stream", "invalid_type"),
    (req(metadata={"k": 1}), "metadata.k", "invalid_type"),
    (req(text={"format": {"type": "xml"}}), "text.format.type", None),
    (
        req(text={"format": {"type": "json_schema", "name": "x"}}),
        "text.format.schema",
        "invalid_type",
    ),
    (req(input=[{"role": "robot", "content": "x"}]), "input[0].role", None),
    (req(input=[{"role": "user"}]), "input[0].content", "missing_required"),
    (req(input=[{"role": "user", "content": []}]), "input[0].content", None),
    (
        req(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
        "input[0].content[0].type",
        None,
    ),
    (
        req(input=[{"type": "reasoning", "summary": [{"type": "text", "text": "x"}]}]),
        "input[0].summary[0].type",
        None,
    ),
    (req(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type", "unsupported"),
    (
        req(input=[{"type": "function_call_output", "call_id": "c1", "output": "x"}]),
        "input[0].call_id",
        None,
    ),
    (
        req(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
        "input[0].call_id",
        "missing_required",
    ),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD)
def test_bad_requests_name_the_field(body: dict[str, Any], param: str, code: str | None) -> None:
    with pytest.raises(ApiError) as e:
        to_chat(body)
    assert e.value.status == 400
    assert (e.value.param, e.value.code) == (param, code), e.value.message


def test_previous_response_id_says_to_send_the_whole_conversation() -> None:
    with pytest.raises(ApiError) as e:
        to_chat(req(previous_response_id="resp_1"))
    assert e.value.message == NOT_STORED
    assert "does not store responses" in NOT_STORED and "`input`" in NOT_STORED


def test_schemas_the_grammar_cannot_enforce_are_refused_where_they_were_sent() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema}
    with pytest.raises(ApiError) as e:
        to_chat(req(text={"format": fmt}))
    assert (e.value.param, e.value.code) == (
        "text.format.schema.properties.n.maximum",
        "unsupported_schema",
    )
    tool = {**WEATHER, "parameters": schema}
    with pytest.raises(ApiError) as e:
        to_chat(req(tools=[tool], tool_choice={"type": "function", "name": "get_weather"}))
    assert e.value.param == "tools[0].parameters.properties.n.maximum"
    # Not forced: the model may answer without calling it, nothing to enforce.
    to_chat(req(tools=[tool], tool_choice="auto"))


# --- whole answers ----------------------------------------------------------------------------


def chat_answer(content: Any, finish: str = "stop", calls: Any = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": USAGE,
    }


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def test_a_text_answer_is_one_message_with_the_usage() -> None:
    r = from_chat(chat_answer("Hello."), to_chat(req()).echo, META)
    parsed = Response.model_validate(r)
    assert parsed.output_text == "Hello."
    assert (parsed.id, parsed.model, parsed.status) == ("resp_1", "m", "completed")
    assert r["incomplete_details"] is None
    [item] = r["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert item["content"] == [
        {"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}
    ]
    assert r["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }


def test_tool_calls_are_function_call_items() -> None:
    r = from_chat(chat_answer(None, "tool_calls", [CALL]), to_chat(req(tools=[WEATHER])).echo, META)
    parsed = Response.model_validate(r)
    assert parsed.output_text == ""
    [item] = r["output"]
    assert item["type"] == "function_call" and item["id"].startswith("fc_")
    assert (item["call_id"], item["name"], item["arguments"], item["status"]) == (
        "call_1",
        "get_weather",
        "{}",
        "completed",
    )
    both = from_chat(chat_answer("Let me look.", "tool_calls", [CALL]), {}, META)
    assert [o["type"] for o in both["output"]] == ["message", "function_call"]


def test_an_answer_cut_by_its_token_limit_is_incomplete() -> None:
    r = from_chat(chat_answer("Hel", "length"), to_chat(req(max_output_tokens=3)).echo, META)
    Response.model_validate(r)
    assert r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete"


# --- streams ----------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        "usage": None,
    }


USAGE_CHUNK = {"id": "chatcmpl-1", "choices": [], "usage": USAGE}


def run(chunks: list[dict[str, Any]], echo: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    ev = Events(META, echo if echo is not None else to_chat(req(tools=[WEATHER])).echo)
    out = ev.start()
    for c in chunks:
        out += ev.feed(c)
    out += ev.finish()
    for e in out:
        EVENTS.validate_python(e)  # every event as the official client models it
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_a_text_stream_in_order_ends_with_the_whole_response() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo."}),
        chunk({}, "stop"),
        USAGE_CHUNK,
    ]
    events = run(chunks, to_chat(req()).echo)
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    # Not known yet: left out (OpenAI's schema has no null usage).
    assert events[0]["response"]["output"] == [] and "usage" not in events[0]["response"]
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["Hel", "lo."]
    assert events[6]["text"] == "Hello."
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {events[2]["item"]["id"]}
    # The final response equals what the whole answer would have been (but for ids).
    final = events[-1]["response"]
    whole = from_chat(chat_answer("Hello."), to_chat(req()).echo, META)
    assert final["usage"] == whole["usage"]
    assert Response.model_validate(final).output_text == "Hello."
    assert _without_ids(final) == _without_ids(whole)


def _without_ids(r: dict[str, Any]) -> str:
    out = json.loads(json.dumps(r))
    for item in out["output"]:
        item.pop("id")
    return json.dumps(out, sort_keys=True)


def test_a_stream_with_text_then_a_tool_call() -> None:
    first = {"index": 0, "id": "call_1", "type": "function"}
    chunks = [
        chunk({"role": "assistant", "content": "Let me look."}),
        chunk({"tool_calls": [{**first, "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}),
        chunk({}, "tool_calls"),
        USAGE_CHUNK,
    ]
    events = run(chunks)
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["output_index"] for e in events[2:13]] == [0] * 6 + [1] * 5
    added = events[8]["item"]
    assert (added["type"], added["call_id"], added["name"], added["arguments"]) == (
        "function_call",
        "call_1",
        "get_weather",
        "",
    )
    assert events[11]["arguments"] == '{"city": "Paris"}'
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"city": "Paris"}'
    assert final["output"][1]["id"] == added["id"]


def test_two_streamed_calls_are_two_items() -> None:
    def call(i: int) -> dict[str, Any]:
        fn = {"name": "get_weather", "arguments": "{}"}
        return chunk({"tool_calls": [{"index": i, "id": f"call_{i}", "function": fn}]})

    events = run([call(0), call(1), chunk({}, "tool_calls")])
    final = events[-1]["response"]
    assert [o["call_id"] for o in final["output"]] == ["call_0", "call_1"]
    assert types(events).count("response.output_item.done") == 2


def test_a_stream_cut_by_its_token_limit_ends_incomplete() -> None:
    events = run([chunk({"content": "Hel"}), chunk({}, "length"), USAGE_CHUNK])
    assert types(events)[-1] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert events[-2]["item"]["status"] == "incomplete"


def test_an_empty_stream_still_has_its_message() -> None:
    events = run([chunk({"role": "assistant"}), chunk({}, "stop")], to_chat(req()).echo)
    whole = from_chat(chat_answer(""), to_chat(req()).echo, META)
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["message"]
    assert events[-1]["response"]["output"][0]["content"] == whole["output"][0]["content"]


def test_a_broken_stream_ends_with_an_error_and_failed() -> None:
    ev = Events(META, to_chat(req()).echo)
    out = ev.start() + ev.feed(chunk({"content": "Hel"}))
    err = ApiError(503, "no reply", type="server_error", code="timeout").envelope()["error"]
    out += ev.fail(err)
    assert ev.finish() == []  # nothing after the end
    for e in out:
        EVENTS.validate_python(e)
    assert types(out)[-2:] == ["error", "response.failed"]
    assert (out[-2]["code"], out[-2]["message"]) == ("timeout", "no reply")
    assert out[-1]["response"]["status"] == "failed"
    # The failed response's code is one of OpenAI's; the error event keeps the precise one.
    assert out[-1]["response"]["error"] == {"code": "server_error", "message": "no reply"}
    ev = Events(META, to_chat(req()).echo)
    limited = ApiError(429, "slow down", type="rate_limit_error", code="queue_full")
    failed = (ev.start() + ev.fail(limited.envelope()["error"]))[-1]
    assert failed["response"]["error"]["code"] == "rate_limit_exceeded"
