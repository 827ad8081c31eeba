"""The Anthropic Messages API's translation to and from chat completions (web/anthropic.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from residency.errors import ApiError
from web import anthropic
from web.validation import validate_chat

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def body(**kw: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **kw,
    }


def refused(b: dict[str, Any], *, count: bool = False) -> ApiError:
    with pytest.raises(ApiError) as e:
        validate_chat(anthropic.to_chat(b, count=count))
    assert e.value.status == 400
    return e.value


# --- request ----------------------------------------------------------------------------------


def test_a_plain_request_becomes_a_chat_request() -> None:
    chat = anthropic.to_chat(
        body(
            system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Really."}],
            stop_sequences=["END"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            metadata={"user_id": "u-1"},
        )
    )
    assert chat == {
        "model": "m",
        "max_tokens": 16,
        "messages": [
            {"role": "system", "content": "Be brief.\nReally."},
            {"role": "user", "content": "hi"},
        ],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["END"],
    }
    v = validate_chat(chat)
    assert v.params["stop"] == ["END"] and not v.stream


def test_a_stream_asks_for_the_usage_chunk() -> None:
    chat = anthropic.to_chat(body(stream=True, system="s"))
    assert chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert chat["messages"][0] == {"role": "system", "content": "s"}
    assert validate_chat(chat).stream


def test_tool_use_and_tool_results_become_tool_calls_and_tool_messages() -> None:
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"c": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "boom"}],
                    "is_error": True,
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    chat = anthropic.to_chat(
        body(messages=msgs, tools=[WEATHER_TOOL], tool_choice={"type": "auto"})
    )
    assert chat["messages"] == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"c": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER_TOOL["input_schema"],
                "description": "The weather in a city",
            },
        }
    ]
    assert chat["tool_choice"] == "auto"
    validate_chat(chat)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        (
            {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    chat = anthropic.to_chat(body(tools=[WEATHER_TOOL], tool_choice=choice))
    assert chat["tool_choice"] == expected
    validate_chat(chat)


def test_unknown_fields_are_refused_by_name_in_anthropics_words() -> None:
    e = refused(body(mcp_servers=[], container="c"))
    assert e.param == "container"
    assert e.message.startswith("container: Extra inputs are not permitted")
    assert e.code == "unknown_field"
    # count_tokens takes fewer fields.
    b = body()
    del b["max_tokens"]
    assert anthropic.to_chat(b, count=True)["messages"] == [{"role": "user", "content": "hi"}]
    assert refused(body(), count=True).param == "max_tokens"


def test_fields_that_change_nothing_are_accepted_and_named() -> None:
    ignored: list[str] = []
    chat = anthropic.to_chat(
        body(
            thinking={"type": "enabled", "budget_tokens": 1024},
            context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
            output_config={"effort": "high"},
            service_tier="auto",
        ),
        ignored=ignored,
    )
    assert ignored == ["context_management", "service_tier", "output_config.effort"]
    # thinking is not among them: it asks for a reasoning effort (tests/unit/test_reasoning_*).
    assert chat == {**anthropic.to_chat(body()), "reasoning_effort": "low"}
    # What would change the answer is not ignored.
    assert refused(body(output_config={"verbosity": "low"})).param == "output_config.verbosity"


def test_output_config_format_is_a_json_schema_answer() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    chat = anthropic.to_chat(
        body(output_config={"format": {"type": "json_schema", "schema": schema}})
    )
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    validate_chat(chat)
    bad = body(output_config={"format": {"type": "xml"}})
    assert refused(bad).param == "output_config.format.type"


def test_a_system_message_anywhere_is_a_system_message() -> None:
    chat = anthropic.to_chat(
        body(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "again"},
            ]
        )
    )
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "system", "user"]
    assert chat["messages"][2] == {"role": "system", "content": "Be brief."}
    validate_chat(chat)
    bad = body(messages=[{"role": "system", "content": [{"type": "image"}]}])
    assert refused(bad).param == "messages[0].content[0].type"


def test_server_tools_are_dropped_unless_chosen() -> None:
    server = {"type": "web_search_20250305", "name": "web_search"}
    ignored: list[str] = []
    chat = anthropic.to_chat(body(tools=[server, WEATHER_TOOL]), ignored=ignored)
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    assert ignored == ["tools[0] (web_search_20250305)"]
    # Only server tools: the request goes on without tools.
    chat = anthropic.to_chat(body(tools=[server], tool_choice={"type": "auto"}))
    assert "tools" not in chat and "tool_choice" not in chat
    e = refused(body(tools=[server], tool_choice={"type": "tool", "name": "web_search"}))
    assert (e.param, e.code) == ("tool_choice.name", "unsupported_tool")


def test_errors_start_with_the_dotted_field() -> None:
    e = ApiError(400, "'messages[2].role' must be 'user'", param="messages[2].role")
    assert anthropic.error_body(e)["error"]["message"] == (
        "messages.2.role: 'messages[2].role' must be 'user'"
    )
    plain = anthropic.error_body(ApiError(429, "slow down"))
    assert plain["error"] == {"type": "rate_limit_error", "message": "slow down"}


@pytest.mark.parametrize(
    ("b", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (body(messages=None), "messages"),
        (body(messages=[]), "messages"),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (body(messages=[{"role": "user"}]), "messages[0].content"),
        (body(messages=[{"role": "user", "content": []}]), "messages[0].content"),
        (
            body(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image", "source": {"type": "base64", "data": "AA=="}},
                        ],
                    }
                ]
            ),
            "messages[0].content[1].source.media_type",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            "messages[0].content[0].source.type",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
            "messages[0].content[0].type",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "x"}]}]),
            "messages[0].content[0].type",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]),
            "messages[0].content[0].type",
        ),
        (
            body(messages=[{"role": "assistant", "content": [{"type": "thinking"}]}]),
            "messages[0].content[0].thinking",
        ),
        (
            body(
                messages=[
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "x", "name": "f", "input": "{}"}],
                    }
                ]
            ),
            "messages[0].content[0].input",
        ),
        (body(system=[{"type": "image"}]), "system[0].type"),
        (body(stop_sequences="END"), "stop_sequences"),
        (body(stop_sequences=["a", "b", "c", "d", "e"]), "stop_sequences"),
        (body(stop_sequences=[1]), "stop_sequences[0]"),
        (body(max_tokens=0), "max_tokens"),
        (body(temperature="hot"), "temperature"),
        (body(stream="yes"), "stream"),
        (body(metadata="x"), "metadata"),
        (body(tools=[{"name": "f"}]), "tools[0].input_schema"),
        (body(tool_choice={"type": "function"}), "tool_choice.type"),
        (body(tools=[WEATHER_TOOL], tool_choice={"type": "tool"}), "tool_choice.name"),
        (
            body(
                tools=[
                    {"name": "f", "input_schema": {"type": "object", "properties": {}, "not": {}}}
                ],
                tool_choice={"type": "tool", "name": "f"},
            ),
            "tools[0].input_schema.not",
        ),
    ],
)
def test_bad_requests_name_the_field(b: dict[str, Any], param: str) -> None:
    try:
        validate_chat(anthropic.to_chat(b))
    except ApiError as e:
        e = anthropic.renamed(e)
        assert e.status == 400
        assert e.param == param, e.message
        assert param.split("[")[0].split(".")[0] in e.message
    else:
        pytest.fail("accepted")


def test_a_user_turns_images_become_image_url_parts_in_order() -> None:
    png = {"type": "base64", "media_type": "image/png", "data": "AA=="}
    content = [
        {"type": "text", "text": "compare"},
        {"type": "image", "source": png},
        {"type": "image", "source": {"type": "url", "url": "https://example.invalid/b.png"}},
    ]
    chat = anthropic.to_chat(body(messages=[{"role": "user", "content": content}]))
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/b.png"}},
            ],
        }
    ]
    # Chat's validation keeps them: the model that serves the request decides (vision).
    assert validate_chat(chat).params["messages"] == chat["messages"]


def test_images_elsewhere_and_documents_are_refused_as_unsupported() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://example.invalid/a"}}
    e = refused(body(messages=[{"role": "assistant", "content": [image]}]))
    assert e.code == "unsupported" and e.param == "messages[0].content[0].type"
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    e = refused(body(messages=[{"role": "user", "content": [result]}]))
    assert e.code == "unsupported" and e.param == "messages[0].content[0].content[0].type"
    e = refused(body(messages=[{"role": "user", "content": [{"type": "document"}]}]))
    assert e.code == "unsupported"


# --- response ---------------------------------------------------------------------------------


def chat_response(message: dict[str, Any], finish: str, **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "/models/x.gguf",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
    }


def test_a_text_answer_becomes_a_message() -> None:
    out = anthropic.to_message(
        chat_response({"role": "assistant", "content": "Hello"}, "stop"), "m"
    )
    assert out["id"].startswith("msg_")
    assert out == {
        "id": out["id"],
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 5},
    }


def test_stop_reasons() -> None:
    def reason(finish: str, **choice: Any) -> tuple[str, str | None]:
        msg = {"role": "assistant", "content": "x"}
        out = anthropic.to_message(chat_response(msg, finish, **choice), "m")
        return out["stop_reason"], out["stop_sequence"]

    assert reason("stop") == ("end_turn", None)
    assert reason("stop", stop_sequence=None) == ("end_turn", None)
    assert reason("stop", stop_sequence="END") == ("stop_sequence", "END")
    assert reason("length") == ("max_tokens", None)
    assert reason("tool_calls") == ("tool_use", None)


def test_tool_calls_become_tool_use_blocks() -> None:
    msg = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    out = anthropic.to_message(chat_response(msg, "tool_calls"), "m")
    assert out["content"] == [
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}}
    ]
    assert out["stop_reason"] == "tool_use"


# --- stream -----------------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **kw: Any) -> Any:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, **kw}
    return {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}


USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}


def run(chunks: list[Any], keepalive_first: bool = False) -> list[dict[str, Any]]:
    ev = anthropic.StreamEvents("m")
    out = ev.ping() if keepalive_first else []
    for c in chunks:
        out += ev.feed(c)
    return out + ev.end()


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_a_text_stream_in_anthropics_order() -> None:
    first = chunk({"role": "assistant"})
    first["prompt_tokens"] = 9
    events = run(
        [first, chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk({}, "stop"), USAGE]
    )
    assert types(events) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 9, "output_tokens": 0}
    assert events[1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert [e["delta"] for e in events[2:4]] == [
        {"type": "text_delta", "text": "Hel"},
        {"type": "text_delta", "text": "lo"},
    ]
    assert events[5] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 4, "input_tokens": 9},
    }


def test_a_stream_stopped_by_a_stop_sequence_or_max_tokens() -> None:
    events = run([chunk({"content": "a"}), chunk({}, "stop", stop_sequence="END"), USAGE])
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    events = run([chunk({"content": "a"}), chunk({}, "length")])
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 0}  # no usage chunk came


def test_a_tool_call_stream_becomes_input_json_deltas() -> None:
    def call(i: int, **kw: Any) -> Any:
        return chunk({"tool_calls": [{"index": i, **kw}]})

    events = run(
        [
            chunk({"role": "assistant"}),
            chunk({"content": "Sure."}),
            call(0, id="call_1", type="function", function={"name": "f", "arguments": ""}),
            call(0, function={"arguments": '{"a": '}),
            call(0, function={"arguments": "1}"}),
            call(1, id="call_2", type="function", function={"name": "g", "arguments": "{}"}),
            chunk({}, "tool_calls"),
            USAGE,
        ]
    )
    assert types(events) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert starts[1]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_1",
        "name": "f",
        "input": {},
    }
    json_parts = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == 1
    ]
    assert json.loads("".join(json_parts)) == {"a": 1}
    assert all(
        e["delta"]["type"] == "input_json_delta"
        for e in events
        if e["type"] == "content_block_delta" and e["index"] > 0
    )
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_pings_and_an_empty_stream() -> None:
    # A keep-alive before the first chunk does not start the message: message_start waits for
    # the chunk that carries the prompt's tokens.
    first = chunk({"content": "x"})
    first["prompt_tokens"] = 9
    events = run([first], keepalive_first=True)
    assert types(events)[:2] == ["ping", "message_start"]
    assert events[1]["message"]["usage"]["input_tokens"] == 9
    assert types(run([])) == ["message_start", "message_delta", "message_stop"]


def test_sse_names_each_event() -> None:
    assert anthropic.sse({"type": "ping"}) == 'event: ping\ndata: {"type":"ping"}\n\n'


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ],
)
def test_the_error_envelope(status: int, kind: str) -> None:
    e = ApiError(status, "went wrong", type="whatever", param="p", retry_after=3)
    assert anthropic.error_body(e) == {
        "type": "error",
        "error": {"type": kind, "message": "p: went wrong"},
    }


def test_renamed_keeps_status_and_retry_after() -> None:
    e = anthropic.renamed(ApiError(400, "'stop' must be...", param="stop", retry_after=2))
    assert (e.param, e.message, e.retry_after) == (
        "stop_sequences",
        "'stop_sequences' must be...",
        2,
    )


def test_text_out_names_the_stop_string_it_ended_at() -> None:
    from workers.textout import TextOut

    out = TextOut(["zz", "b"])
    assert not out.add(b"aa") and out.matched is None
    assert out.add(b"zbz")  # "b" comes first
    assert (out.text, out.matched) == ("aaz", "b")


def test_a_tool_search_result_names_the_tools_it_found() -> None:
    # Claude Code's ToolSearch answers with tool_reference blocks (its deferred tools).
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [
            {"type": "text", "text": "Found 2 tools"},
            {"type": "tool_reference", "tool_name": "WebFetch"},
            {"type": "tool_reference", "tool_name": "NotebookEdit"},
        ],
    }
    chat = anthropic.to_chat(
        body(
            messages=[
                {"role": "user", "content": "find a tool"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {}}
                    ],
                },
                {"role": "user", "content": [result]},
            ]
        )
    )
    assert chat["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "Found 2 tools\nTool available: WebFetch\nTool available: NotebookEdit",
    }
    bad = dict(result, content=[{"type": "tool_reference"}])
    msgs = [{"role": "user", "content": [bad]}]
    assert refused(body(messages=msgs)).param == "messages[0].content[0].content[0].tool_name"
