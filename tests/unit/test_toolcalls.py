"""Tool calls parsed from a model's text (workers.toolcalls) and what a request's tools mean
for a model (workers.chat_tools): pure, fed controlled text and chunks."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers import chat_tools, toolcalls
from workers.toolcalls import ToolText, parse

NAMES = ["get_weather", "add"]
HERMES = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
)


def calls_of(text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = parse(text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_blocks_become_calls_in_order_after_their_text() -> None:
    content, calls = calls_of(HERMES)
    assert content == "Let me look.\n"
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


def test_a_bare_json_answer_is_a_call_with_parameters_or_arguments() -> None:
    assert calls_of(' {"name": "add", "parameters": {"a": 1}}') == (None, [("add", {"a": 1})])
    assert calls_of('{"name": "add", "arguments": "{\\"a\\": 2}"}') == (None, [("add", {"a": 2})])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "rm_rf", "parameters": {}}',  # not one of the request's tools
        '{"name": "add", "parameters": {}, "extra": 1}',  # not a call's shape
        '{"answer": 42}',  # plain JSON
        '<tool_call>{"name": "add", "arguments": </tool_call>',  # broken JSON
        "hello <tool_ca",  # a partial opener at the end
        "no calls here",
    ],
)
def test_text_that_is_not_a_call_is_content_unchanged(text: str) -> None:
    assert calls_of(text) == (text, [])


def test_a_block_cut_before_its_closing_tag_is_still_a_call() -> None:
    assert calls_of('<tool_call>{"name": "add", "arguments": {}}') == (None, [("add", {})])


def test_a_partial_opener_is_held_until_it_is_decided() -> None:
    r = ToolText(NAMES)
    assert r.feed("Hi <tool") == [("content", "Hi ")]
    assert r.feed("_c") == []
    assert r.feed("ar") == [("content", "<tool_car")]  # not an opener after all
    assert r.feed(' <tool_call>{"name": "add", "arguments": {}}') == [("content", " ")]
    out = r.feed("</tool_call>")
    assert [k for k, _ in out] == ["call"]
    assert r.finish() == []


def test_an_answer_starting_with_a_brace_is_held_to_its_end() -> None:
    r = ToolText(NAMES)
    assert r.feed('{"name": "add",') == []
    assert r.feed(' "arguments": {}}') == []
    assert [k for k, _ in r.finish()] == ["call"]


def _chunks(pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {**base, "choices": [choice]}

    return [
        chunk({"role": "assistant"}),
        *(chunk({"content": p}) for p in pieces),
        chunk({}, finish),
    ]


def assemble(chunks: list[dict[str, Any]]) -> tuple[str | None, list[tuple[str, Any]], str]:
    """What an OpenAI client builds from the deltas."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = ""
    for c in chunks:
        choice = c["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"name": "", "arguments": "", "id": ""})
            slot["id"] += tc.get("id") or ""
            slot["name"] += (tc.get("function") or {}).get("name") or ""
            slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        finish = choice["finish_reason"] or finish
    out = [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())]
    for v in calls.values():
        assert v["id"].startswith("call_")
    return (content or None) if out else content, out, finish


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(HERMES)), max_size=12))
def test_a_stream_cut_anywhere_assembles_to_the_whole_answer(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(HERMES)]
    pieces = [HERMES[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    content, calls, finish = assemble(list(toolcalls.stream_with_calls(_chunks(pieces), NAMES)))
    assert (content, calls) == calls_of(HERMES)
    assert finish == "tool_calls"


def test_a_stream_without_calls_keeps_its_text_and_finish_reason() -> None:
    out = list(toolcalls.stream_with_calls(_chunks(["hello ", "<tool", " world"], "length"), NAMES))
    assert assemble(out) == ("hello <tool world", [], "length")


def test_the_whole_answer_gets_tool_calls_and_finish_reason() -> None:
    resp = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": HERMES},
                "finish_reason": "stop",
            }
        ]
    }
    out = toolcalls.answer_with_calls(resp, NAMES)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look.\n"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == NAMES
    assert all(c["type"] == "function" for c in choice["message"]["tool_calls"])


def test_forced_call_chunks_keep_id_and_name_in_the_first_only() -> None:
    def chunk(arguments: str) -> dict[str, Any]:
        call = {"index": 0, "id": "call_1", "type": "function"}
        call["function"] = {"name": "add", "arguments": arguments}
        delta = {"function_call": {"name": "add"}, "tool_calls": [call]}
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    chunks = list(toolcalls.normalized_calls([chunk('{"a"'), chunk(": 1"), chunk("}")]))
    assert assemble(chunks)[:2] == (None, [("add", {"a": 1})])
    assert all("function_call" not in c["choices"][0]["delta"] for c in chunks)


# --- what a request's tools mean for a model -------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES
]


def test_support_comes_from_the_template_or_a_function_calling_format() -> None:
    tpl = {"chat_template.default": "{% if tools %}{{ tools | tojson }}{% endif %}"}
    assert chat_tools.support("chat_template.default", tpl) == chat_tools.TEMPLATE
    assert chat_tools.support("chatml-function-calling", {}) == chat_tools.HANDLER
    assert chat_tools.support("chatml", tpl) is None
    plain = {"chat_template.default": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    assert chat_tools.support("chat_template.default", plain) is None


def test_tools_on_a_model_without_support_take_the_generic_format() -> None:
    user = [{"role": "user", "content": "hi"}]
    for choice in (None, "auto", "required"):
        params: dict[str, Any] = {"messages": user, "tools": TOOLS, "parallel_tool_calls": True}
        if choice:
            params["tool_choice"] = choice
        p = chat_tools.plan(params, None, "chatml", False)
        assert p.generic is not None
        assert p.generic.names == tuple(NAMES) and p.generic.parallel
        assert p.generic.mode == ("required" if choice == "required" else "auto")
        # The tools are in a new first system message; the handler gets neither.
        assert set(p.params) == {"messages"}
        first, rest = p.params["messages"][0], p.params["messages"][1:]
        assert first["role"] == "system" and "get_weather" in first["content"]
        assert rest == user
    named = {"type": "function", "function": {"name": "add"}}
    p = chat_tools.plan(
        {"messages": user, "tools": TOOLS, "tool_choice": named}, None, "chatml", True
    )
    assert p.generic is not None
    assert (p.generic.mode, p.generic.names, p.generic.param) == (
        "named",
        ("add",),
        "tools[1].function.parameters",
    )
    assert not p.generic.parallel  # not asked for


def test_tool_history_is_text_for_a_template_without_tools_and_kept_for_one_with() -> None:
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    p = chat_tools.plan({"messages": history}, None, "chatml", False)
    assert [m["role"] for m in p.params["messages"]] == ["user", "assistant", "user"]
    assert all(isinstance(m["content"], str) for m in p.params["messages"])
    p = chat_tools.plan({"messages": history}, chat_tools.TEMPLATE, "x", False)
    assert p.params["messages"] == history


def test_a_grammar_built_from_a_tool_drops_its_bounds_past_the_cap() -> None:
    big = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 524288}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": big}}]
    named = {"type": "function", "function": {"name": "f"}}
    p = chat_tools.plan(
        {"messages": [], "tools": tools, "tool_choice": named}, "template", "x", False
    )
    assert p.forced == (
        "tools[0].function.parameters",
        {"type": "object", "properties": {"s": {"type": "string"}}},
    )
    assert p.params["tools"][0]["function"]["parameters"] == p.forced[1]
    p = chat_tools.plan({"messages": [], "tools": tools}, chat_tools.HANDLER, "functionary", False)
    assert "maxLength" not in json.dumps(p.params["tools"])
    # No grammar: the template renders the tools as they came.
    p = chat_tools.plan({"messages": [], "tools": tools}, chat_tools.TEMPLATE, "x", False)
    assert p.params["tools"] == tools


def test_none_drops_the_tools_and_auto_parses_on_a_template() -> None:
    p = chat_tools.plan(
        {"messages": [], "tools": TOOLS, "tool_choice": "none"}, None, "chatml", False
    )
    assert p.params == {"messages": []}
    p = chat_tools.plan({"messages": [], "tools": TOOLS}, chat_tools.TEMPLATE, "x", True)
    assert p.params["tools"] == TOOLS and p.parse == frozenset(NAMES)


def test_a_call_fed_one_character_at_a_time_is_read_once_whole() -> None:
    """The closer is searched from where the last search could not have found it: a closer
    split over any two pieces is still found, and the call read once."""
    from workers.toolcalls import CLOSE, OPEN

    text = f'ok {OPEN}{{"name": "get", "arguments": {{"q": "{"x" * 300}"}}}}{CLOSE} done'
    reader = ToolText(["get"])
    pieces = [p for ch in text for p in reader.feed(ch)] + reader.finish()
    calls = [v for k, v in pieces if k == "call"]
    assert len(calls) == 1 and reader.calls == 1
    assert "".join(v for k, v in pieces if k == "content").strip().split() == ["ok", "done"]
