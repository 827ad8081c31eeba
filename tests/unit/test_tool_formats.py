"""Tool calls in every format a model writes them (workers.tool_formats, workers.harmony) and
the reader one model's answers get (workers.answer_format): pure, fed recorded model outputs
written from each format's documentation. Several calls, text before a call, malformed calls
and names not among the request's tools (content, unchanged), and a stream cut anywhere that
assembles to the whole answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.answer_stream import streamed, whole
from workers import answer_format, harmony, reasoning, tool_formats, toolcalls
from workers.tool_formats import Llama3, Mistral
from workers.toolcalls import ReaderFor, ToolText

NAMES = ["get_weather", "add"]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": ["number", "null"]}},
            },
        },
    },
]


def qwen3_coder(names: frozenset[str]) -> toolcalls.Reader:
    return tool_formats.reader_for(tool_formats.QWEN3_CODER, TOOLS)(names)


def read(text: str, reader_for: ReaderFor) -> tuple[str | None, list[tuple[str, Any]], str]:
    got = toolcalls.read(text, NAMES, reader_for)
    return got.content, [(c.name, json.loads(c.arguments)) for c in got.calls], got.reasoning


# Llama 3.1 to 3.3: a custom tool call after <|python_tag|> (the template's ipython turn), or
# the whole answer a JSON object; several calls separated by ";".
LLAMA3_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
LLAMA3_SEVERAL = (
    'Checking both.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}'
)
LLAMA3_WHOLE = '{"name": "add", "parameters": {"a": 2, "b": 3}}'


def test_llama3_calls_after_the_python_tag() -> None:
    assert read(LLAMA3_TAG, Llama3) == (None, [("get_weather", {"city": "Oslo"})], "")
    assert read(LLAMA3_SEVERAL, Llama3) == (
        "Checking both.",
        [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})],
        "",
    )


def test_llama3_whole_json_answer() -> None:
    assert read(" " + LLAMA3_WHOLE, Llama3) == (None, [("add", {"a": 2, "b": 3})], "")
    assert read('{"name": "add", "parameters": {}};{"name": "add", "arguments": {}}', Llama3)[
        1
    ] == [("add", {}), ("add", {})]


@pytest.mark.parametrize(
    "text",
    [
        '<|python_tag|>{"name": "rm_rf", "parameters": {}}',  # not one of the request's tools
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}',  # cut JSON
        '<|python_tag|>{"name": "add", "parameters": {}} and then',  # text after the call
        '<|python_tag|>brave_search.call(query="weather")',  # a built-in tool: not ours
        '{"answer": 42}',
        "No calls, just <|python_ta",
        "Plain text.",
    ],
)
def test_llama3_text_that_is_not_a_call_is_content_unchanged(text: str) -> None:
    assert read(text, Llama3) == (text, [], "")


# Mistral: the JSON list after [TOOL_CALLS] (v3 tokenizers: Mistral 7B v0.3, Nemo, Small 3),
# or name[ARGS]{json} per call (v11+: Small 3.2, Magistral, Devstral), [CALL_ID] optional.
MISTRAL_LIST = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "a1B2c3D4e"}]'
)
MISTRAL_ARGS = (
    'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1, "b": 2}'
)


def test_mistral_list_and_args_forms() -> None:
    calls = [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert read(MISTRAL_LIST, Mistral) == (None, calls, "")
    assert read(MISTRAL_ARGS, Mistral) == ("Let me check.", calls, "")
    assert read('[TOOL_CALLS]add[ARGS]{"a": 1}add[ARGS]{"a": 2}', Mistral)[1] == [
        ("add", {"a": 1}),
        ("add", {"a": 2}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]',
        '[TOOL_CALLS]rm_rf[ARGS]{"a": 1}',
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}',
        "[TOOL_CALLS]add[ARGS][1, 2]",  # arguments that are not an object
        "[TOOL_CALLS]add",
        "[TOOL_CALLS]",
        "Nothing to call [TOOL_CA",
    ],
)
def test_mistral_text_that_is_not_a_call_is_content_unchanged(text: str) -> None:
    assert read(text, Mistral) == (text, [], "")


# Qwen3-Coder: XML blocks, values as text on their own lines.
QWEN3_CODER = (
    "I'll look it up.\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n<parameter=b>\nnull\n"
    "</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_xml_values_take_their_schema_type() -> None:
    assert read(QWEN3_CODER, qwen3_coder) == (
        "I'll look it up.\n",
        [
            ("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [9, 12]}),
            ("add", {"a": 1.5, "b": None}),
        ],
        "",
    )


def test_qwen3_coder_values_that_do_not_fit_their_type_stay_text() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
        '<parameter=city>\n  42\n</parameter>\n<parameter=extra>\n{"x": 1}\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    args = {"days": "three", "city": "  42", "extra": '{"x": 1}'}
    assert read(text, qwen3_coder) == (None, [("get_weather", args)], "")


def test_qwen3_coder_without_the_outer_block_or_its_closing_tags() -> None:
    bare = "<function=add>\n<parameter=a>\n2\n</parameter>\n</function>"
    assert read(bare, qwen3_coder) == (None, [("add", {"a": 2})], "")
    # Ended at its end-of-turn token before the closers; a parameter's closer left out.
    cut = "<tool_call>\n<function=add>\n<parameter=a>\n2\n<parameter=b>\n3\n"
    assert read(cut, qwen3_coder) == (None, [("add", {"a": 2, "b": 3})], "")


def test_qwen3_coder_whitespace_after_a_call_waits_for_what_follows() -> None:
    r = qwen3_coder(frozenset(NAMES))
    assert [k for k, _ in r.feed("<function=add>\n</function>")] == ["call"]
    assert r.feed("\n\n") == []  # nothing worth sending yet
    assert r.feed("Done.") == [("content", "\n\nDone.")]
    assert r.finish() == []


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\nstray text\n</function>\n</tool_call>",
        '<tool_call>{"name": "add", "arguments": {}}</tool_call>',  # Hermes's, not this one
        "text <tool_ca",
    ],
)
def test_qwen3_coder_text_that_is_not_a_call_is_content_unchanged(text: str) -> None:
    assert read(text, qwen3_coder) == (text, [], "")


# gpt-oss (harmony): the generation starts after the prompt's "<|start|>assistant".
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather for Oslo.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}'
)
HARMONY_FINAL = (
    "<|channel|>analysis<|message|>Simple greeting.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
)
HARMONY_PREAMBLE = (
    "<|channel|>analysis<|message|>Two lookups.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "A"}'
    "<|call|>"
)


def test_harmony_channels() -> None:
    got = read(HARMONY_CALL, harmony.Harmony)
    assert got == (None, [("get_weather", {"city": "Oslo"})], "Need the weather for Oslo.")
    assert read(HARMONY_FINAL, harmony.Harmony) == (
        "Hello! How can I help?",
        [],
        "Simple greeting.",
    )
    assert read(HARMONY_PREAMBLE, harmony.Harmony) == (
        "Checking both.",
        [("get_weather", {"city": "A"})],
        "Two lookups.",
    )


def test_harmony_without_reasoning_keeps_the_analysis_as_content() -> None:
    def plain(names: frozenset[str]) -> toolcalls.Reader:
        return harmony.Harmony(names, reasoning=False)

    assert read(HARMONY_FINAL, plain) == ("Simple greeting.Hello! How can I help?", [], "")


def test_harmony_calls_that_are_not_ours_are_content() -> None:
    unknown = '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{"a": 1}'
    assert read(unknown, harmony.Harmony) == (unknown, [], "")
    broken = '<|channel|>commentary to=functions.add<|message|>{"a": '
    assert read(broken, harmony.Harmony) == (broken, [], "")
    assert read("plain text, no channels", harmony.Harmony) == ("plain text, no channels", [], "")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("<tool_call>\n<function={{ name }}>", tool_formats.QWEN3_CODER),
        ("<tool_call>{{ tool | tojson }}</tool_call>", tool_formats.HERMES),
        ("{{ '<|python_tag|>' }}", tool_formats.LLAMA3),
        ("{% if message.role == 'ipython' %}", tool_formats.LLAMA3),
        ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", tool_formats.MISTRAL),
        ("<|start|>assistant<|channel|>commentary", tool_formats.HARMONY),
        ("{{ tools }}", tool_formats.HERMES),
    ],
)
def test_auto_reads_the_format_from_the_template(template: str, expected: str) -> None:
    assert tool_formats.choose("auto", template) == expected
    assert tool_formats.choose("mistral", template) == tool_formats.MISTRAL


def test_a_models_format_and_its_markers() -> None:
    qwen3 = "<think>{{ tools }}<tool_call>"
    fmt = answer_format.decide("auto", "auto", qwen3, takes_tools=True)
    assert fmt.reasoning == fmt.shown == reasoning.Style("<think>", "</think>")
    assert fmt.tools == tool_formats.HERMES
    assert fmt.markers == ("<think>", "</think>", "<tool_call>", "</tool_call>")
    # "none": nothing is split, but the markers stay text.
    none = answer_format.decide("none", "auto", qwen3, takes_tools=False)
    assert (none.reasoning, none.tools, none.markers) == (
        reasoning.NONE,
        None,
        ("<think>", "</think>"),
    )
    gpt_oss = answer_format.decide("auto", "auto", "<|channel|>{{ tools }}", takes_tools=True)
    assert gpt_oss.reasoning.harmony and gpt_oss.tools == tool_formats.HARMONY
    assert gpt_oss.markers == harmony.MARKERS
    assert answer_format.decide("auto", "auto", "{{ messages }}", False).markers == ()


def test_the_reasoning_split_comes_before_the_calls() -> None:
    fmt = answer_format.decide("auto", "qwen3_coder", "<think>", takes_tools=True)
    reader_for = fmt.reader_for(frozenset(NAMES), TOOLS, inside=True)
    assert reader_for is not None
    text = "Which city?\n</think>\n\n" + QWEN3_CODER
    content, calls, thought = read(text, reader_for)
    assert thought == "Which city?"
    assert content == "I'll look it up.\n" and [n for n, _ in calls] == ["get_weather", "add"]
    # No tools in the request: only the split; no reasoning style and no tools: nothing.
    no_tools = fmt.reader_for(frozenset(), [], inside=False)
    assert no_tools is not None
    assert read("<think>x</think>y", no_tools) == ("y", [], "x")
    plain = answer_format.decide("auto", "auto", "{{ messages }}", takes_tools=False)
    assert plain.reader_for(frozenset(), [], inside=False) is None


# Round trips: every format, cut anywhere, assembles to the whole answer.
def _split_llama3(names: frozenset[str]) -> toolcalls.Reader:
    return reasoning.Split(reasoning.Style("<think>", "</think>"), Llama3(names))


CASES: list[tuple[str, ReaderFor]] = [
    (LLAMA3_TAG, Llama3),
    (LLAMA3_SEVERAL, Llama3),
    ("  " + LLAMA3_WHOLE, Llama3),
    ('<|python_tag|>{"name": "rm_rf", "parameters": {}}', Llama3),
    (MISTRAL_LIST, Mistral),
    (MISTRAL_ARGS, Mistral),
    ("[TOOL_CALLS]rm_rf[ARGS]{}", Mistral),
    (QWEN3_CODER, qwen3_coder),
    (QWEN3_CODER + "\n \nDone.\n", qwen3_coder),
    ("<tool_call>\n<function=rm_rf>\n</function>\n</tool_call> after", qwen3_coder),
    (HARMONY_CALL, harmony.Harmony),
    (HARMONY_FINAL, harmony.Harmony),
    (HARMONY_PREAMBLE, harmony.Harmony),
    (HARMONY_CALL.replace("get_weather", "rm_rf"), harmony.Harmony),
    ("<think>Tag it.</think>\n" + LLAMA3_TAG, _split_llama3),
]


@settings(max_examples=400, deadline=None)
@given(data=st.data(), case=st.sampled_from(CASES))
def test_a_stream_cut_anywhere_assembles_to_the_whole_answer(
    data: st.DataObject, case: tuple[str, ReaderFor]
) -> None:
    text, reader_for = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=16))
    got = streamed(text, cuts, NAMES, reader_for)
    assert got == whole(text, NAMES, reader_for)
    assert got[3] == ("tool_calls" if got[1] else "stop")


FRAGMENTS: dict[str, list[str]] = {
    "llama3": ["<|python_tag|>", "<|py", '{"name": "add", "parameters": {"a": 1}}', ";", "{"],
    "mistral": ["[TOOL_CALLS]", "[TOOL", "add", "[ARGS]", '{"a": 1}', "[CALL_ID]x", "[", "]"],
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "<function=add>",
        "</function>",
        "<parameter=a>",
        "</parameter>",
        "<tool_",
        "<function=",
        "2",
    ],
    "harmony": [
        "<|channel|>",
        "<|message|>",
        "<|start|>",
        "<|end|>",
        "<|call|>",
        "<|",
        "analysis",
        "final",
        "commentary to=functions.add",
        "assistant",
        '{"a": 1}',
    ],
}
READERS: dict[str, ReaderFor] = {
    "llama3": Llama3,
    "mistral": Mistral,
    "qwen3_coder": qwen3_coder,
    "harmony": harmony.Harmony,
}


@settings(max_examples=400, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(sorted(READERS)))
def test_any_text_streams_to_what_the_whole_answer_is(data: st.DataObject, fmt: str) -> None:
    fragments = st.sampled_from([*FRAGMENTS[fmt], " ", "\n", "word"])
    text = "".join(data.draw(st.lists(fragments, max_size=14)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=14))
    reader_for = READERS[fmt]
    assert streamed(text, cuts, NAMES, reader_for) == whole(text, NAMES, reader_for)


def test_hermes_stays_the_default_reader() -> None:
    assert tool_formats.reader_for(tool_formats.HERMES, TOOLS) is ToolText


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("3", {"type": "integer"}, 3),
        ("3.5", {"type": "number"}, 3.5),
        ("nan", {"type": "number"}, "nan"),
        ("TRUE", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, "yes"),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("[1, 2]", {"anyOf": [{"type": "null"}, {"type": "array"}]}, [1, 2]),
        ("null", {"type": "integer"}, None),
        ("null", {"type": "string"}, "null"),
        ("12", None, "12"),
    ],
)
def test_a_parameter_value_takes_its_schema_type(value: str, schema: Any, expected: Any) -> None:
    assert tool_formats.typed(value, schema) == expected
