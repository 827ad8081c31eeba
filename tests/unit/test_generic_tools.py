"""The generic tool format for templates without tools (workers.generic_tools): its
instructions, its answer schema (checked with jsonschema), the history as text, and the reader
fed controlled text, whole and in every split."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers import generic_tools, toolcalls
from workers.generic_tools import Reader

WEATHER = {
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
ADD = {"type": "function", "function": {"name": "add"}}  # no parameters: any object
TOOLS = [WEATHER, ADD]
NAMES = ("get_weather", "add")
CALL = {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALLS = {"tool_calls": [CALL["tool_call"], {"name": "add", "arguments": {"a": 1}}]}
REPLY = {"response": "Hello"}


def test_the_schema_admits_a_call_or_a_reply_and_required_or_named_only_the_call() -> None:
    auto = generic_tools.answer_schema(generic_tools.generic(TOOLS, None, False))
    jsonschema.validate(CALL, auto)
    jsonschema.validate(REPLY, auto)
    for bad in (CALLS, {"tool_call": {"name": "nope", "arguments": {}}}, {"response": 1}, {}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, auto)
    required = generic_tools.answer_schema(generic_tools.generic(TOOLS, "required", False))
    jsonschema.validate(CALL, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(REPLY, required)
    named = generic_tools.generic(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    schema = generic_tools.answer_schema(named)
    jsonschema.validate({"tool_call": {"name": "add", "arguments": {}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(CALL, schema)
    parallel = generic_tools.answer_schema(generic_tools.generic(TOOLS, "auto", True))
    jsonschema.validate(CALLS, parallel)
    jsonschema.validate(REPLY, parallel)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": []}, parallel)


def test_the_instructions_name_each_tool_with_its_schema_and_the_answer_shape() -> None:
    g = generic_tools.generic(TOOLS, None, False)
    text = generic_tools.instructions(TOOLS, g)
    assert '"description": "The weather in a city"' in text
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    assert '{"tool_call": ' in text and '{"response": ' in text
    named = generic_tools.generic(TOOLS, {"type": "function", "function": {"name": "add"}}, True)
    text = generic_tools.instructions(TOOLS, named)
    assert "get_weather" not in text and '{"tool_calls": [' in text and "response" not in text
    # Folded into the leading system message, or a new one.
    sys_first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = generic_tools.with_instructions(sys_first, "TOOLS")
    assert out == [{"role": "system", "content": "Be brief.\n\nTOOLS"}, sys_first[1]]
    assert sys_first[0]["content"] == "Be brief."  # not changed in place
    out = generic_tools.with_instructions(sys_first[1:], "TOOLS")
    assert out == [{"role": "system", "content": "TOOLS"}, sys_first[1]]


def test_tool_calls_and_results_in_the_history_become_text() -> None:
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "x"}},
    ]
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "assistant", "content": None, "tool_calls": calls[:1]},
        {"role": "tool", "tool_call_id": "zz", "content": "?"},
        {"role": "user", "content": "thanks"},
    ]
    out = generic_tools.history_as_text(history)
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant", "user", "user"]
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in out)
    said, both = out[1]["content"].split("\n", 1)
    assert said == "Let me see."
    assert json.loads(both) == {
        "tool_calls": [
            {"name": "add", "arguments": {"a": 1}},
            {"name": "get_weather", "arguments": "x"},  # not JSON: kept as it came
        ]
    }
    # A run of results is one user turn, each naming the call's function.
    assert [json.loads(line) for line in out[2]["content"].split("\n")] == [
        {"tool_response": {"name": "add", "content": "2"}},
        {"tool_response": {"name": "get_weather", "content": "sunny"}},
    ]
    assert json.loads(out[3]["content"]) == {"tool_call": {"name": "add", "arguments": {"a": 1}}}
    assert json.loads(out[4]["content"]) == {"tool_response": {"content": "?"}}
    plain = [{"role": "user", "content": "hi"}]
    assert generic_tools.history_as_text(plain) is plain


def _read(parts: list[str], names: tuple[str, ...] = NAMES) -> list[toolcalls.Piece]:
    reader = Reader(names)
    out: list[toolcalls.Piece] = []
    for p in parts:
        out += reader.feed(p)
    return out + reader.finish()


def _joined(pieces: list[toolcalls.Piece]) -> tuple[str, list[tuple[str, Any]]]:
    content = "".join(v for k, v in pieces if k == "content")
    calls = [(v.name, json.loads(v.arguments)) for k, v in pieces if k == "call"]
    return content, calls


def test_a_reply_is_decoded_as_it_comes_and_a_call_is_held_to_the_end() -> None:
    reply = '{ "response" : "Hi \\"you\\"\\n\\u00e9\\ud83d\\ude00!" } '
    assert _joined(_read([reply])) == ('Hi "you"\n\u00e9\U0001f600!', [])
    reader = Reader(NAMES)
    assert reader.feed('{"respo') == []
    assert reader.feed('nse": "Hel') == [("content", "Hel")]
    assert reader.feed("lo\\") == [("content", "lo")]  # the escape is held until whole
    assert reader.feed('n"}') == [("content", "\n")]
    assert reader.finish() == []
    reader = Reader(NAMES)
    assert reader.feed(json.dumps(CALL)) == []
    [(kind, call)] = reader.finish()
    assert kind == "call" and call.id.startswith("call_")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert _joined(_read([json.dumps(CALLS)]))[1] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        '{"tool_call": {"name": "get_weather", "argu',  # cut short by max_tokens
        '{"tool_call": {"name": "other", "arguments": {}}}',  # not one of the tools
        "plain text",
        "",
    ],
)
def test_an_answer_that_is_no_call_is_content_unchanged(text: str) -> None:
    assert _joined(_read([text])) == (text, [])


def test_a_reply_cut_short_keeps_what_was_decoded() -> None:
    assert _joined(_read(['{"response": "Hello wor'])) == ("Hello wor", [])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_split_of_an_answer_reads_the_same_as_the_whole(data: st.DataObject) -> None:
    text = data.draw(
        st.sampled_from(
            [
                json.dumps({"response": 'a "b"\n\\ \u00e9\U0001f600 c'}),
                json.dumps({"response": "\u00e9\U0001f600"}, ensure_ascii=False),
                json.dumps(CALL, indent=1),
                json.dumps(CALLS),
                '{"response": "cut \\u00',
            ]
        )
    )
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _joined(_read(parts)) == _joined(_read([text]))


def test_the_whole_answer_and_the_stream_get_openai_shapes() -> None:
    def whole(text: str) -> dict[str, Any]:
        resp = {"choices": [{"message": {"role": "assistant", "content": text}}]}
        return toolcalls.answer_with_calls(resp, NAMES, Reader)["choices"][0]

    choice = whole(json.dumps(REPLY))
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    assert "finish_reason" not in choice
    choice = whole(json.dumps(CALL))
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [tc] = choice["message"]["tool_calls"]
    assert tc["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def stream(text: str) -> list[dict[str, Any]]:
        chunks = [chunk({"role": "assistant"}), *(chunk({"content": c}) for c in text)]
        out = toolcalls.stream_with_calls([*chunks, chunk({}, "stop")], NAMES, Reader)
        return [c["choices"][0] for c in out]

    out = stream(json.dumps(REPLY))
    assert "".join(c["delta"].get("content") or "" for c in out) == "Hello"
    assert out[-1]["finish_reason"] == "stop"
    out = stream(json.dumps(CALL))
    deltas = [d for c in out for d in c["delta"].get("tool_calls") or []]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Paris"}
    assert not any(c["delta"].get("content") for c in out)
    assert out[-1]["finish_reason"] == "tool_calls"
