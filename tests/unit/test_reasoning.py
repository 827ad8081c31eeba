"""A model's reasoning told apart from its answer (workers.reasoning): pure, fed recorded model
outputs and controlled chunks. The reasoning is never content, a stream cut anywhere assembles
to the whole answer, and a marker cut across chunks is still a marker."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.answer_stream import streamed, whole
from workers import reasoning, toolcalls
from workers.reasoning import Split, Style
from workers.toolcalls import Plain, ReaderFor, ToolText

THINK = Style("<think>", "</think>")
MAGISTRAL = Style("[THINK]", "[/THINK]")
NAMES = ["get_weather"]


def split(style: Style = THINK, inner: ReaderFor = Plain, inside: bool = False) -> ReaderFor:
    return lambda names: Split(style, inner(names), inside)


def read(text: str, reader_for: ReaderFor | None = None) -> tuple[str | None, str, list[Any]]:
    got = toolcalls.read(text, NAMES, reader_for or split())
    return got.content, got.reasoning, [(c.name, json.loads(c.arguments)) for c in got.calls]


# Recorded shapes of real answers: DeepSeek-R1 / QwQ write the opener themselves; Qwen3 and
# R1's distills get it from the prompt and write only the closer; Magistral uses [THINK].
R1 = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?"
OPENED = "The user greets me.\nI should greet back.\n</think>\n\nHello! How can I help?"
MAGISTRAL_ANSWER = "[THINK]Two plus two is four.[/THINK]\n\n**4**"
QWEN3_CALL = (
    "<think>\nThe user wants the weather in Oslo; I have a tool for it.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def test_a_think_block_is_reasoning_and_the_rest_is_content() -> None:
    assert read(R1) == (
        "Hello! How can I help?",
        "The user greets me. I should greet back.",
        [],
    )


def test_an_answer_that_starts_inside_reasoning_needs_no_opener() -> None:
    content, thought, _ = read(OPENED, split(inside=True))
    assert (content, thought) == (
        "Hello! How can I help?",
        "The user greets me.\nI should greet back.",
    )
    # An opener the model writes anyway is not reasoning either.
    assert read("<think>\n" + OPENED, split(inside=True))[:2] == (content, thought)


def test_an_answer_without_a_block_is_all_content() -> None:
    assert read("  Just an answer.\n") == ("  Just an answer.\n", "", [])
    # Starting inside: a closer never written leaves it all reasoning (cut by max_tokens).
    assert read("still thinking about", split(inside=True)) == ("", "still thinking about", [])


def test_a_block_cut_by_max_tokens_is_reasoning_to_its_end() -> None:
    assert read("<think>Let me see, the first step") == ("", "Let me see, the first step", [])


def test_magistral_markers() -> None:
    assert read(MAGISTRAL_ANSWER, split(MAGISTRAL)) == ("**4**", "Two plus two is four.", [])


def test_a_call_after_reasoning_is_parsed_from_the_content() -> None:
    assert read(QWEN3_CALL, split(inner=ToolText)) == (
        None,
        "The user wants the weather in Oslo; I have a tool for it.",
        [("get_weather", {"city": "Oslo"})],
    )
    # A call-shaped text inside the reasoning is the model thinking, not calling.
    thought = '<think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call></think>ok'
    assert read(thought, split(inner=ToolText))[0] == "ok"
    assert read(thought, split(inner=ToolText))[2] == []


def test_two_blocks_are_one_reasoning_apart_from_the_content_between() -> None:
    assert read("<think>a</think>b <think> c </think>d") == ("b d", "a\n\nc", [])


def test_whitespace_before_an_opening_block_is_not_content() -> None:
    assert read("\n\n<think>x</think>\n\ny") == ("y", "x", [])


def test_a_marker_split_across_chunks_is_held_until_it_is_decided() -> None:
    r = Split(THINK, Plain())
    assert r.feed("<th") == []
    assert r.feed("ink>Hmm") == [("reasoning", "Hmm")]
    assert r.feed(" ok </thi") == [("reasoning", " ok")]  # the space waits: it may end it
    assert r.feed("nk>\n") == []
    assert r.feed("\nDone") == [("content", "Done")]
    assert r.finish() == []
    # A tail that turns out not to be the closer is reasoning after all.
    r = Split(THINK, Plain())
    assert r.feed("<think>a </th") == [("reasoning", "a")]
    assert r.feed("eory") == [("reasoning", " </theory")]


def test_a_partial_opener_that_is_not_one_is_content() -> None:
    assert read("<thin ice>") == ("<thin ice>", "", [])
    assert read("I <think") == ("I <think", "", [])


@pytest.mark.parametrize(
    ("setting", "template", "expected"),
    [
        ("auto", "{{ '<think>' }}", THINK),
        ("auto", "[THINK]", MAGISTRAL),
        ("auto", "<|start|>assistant<|channel|>final", reasoning.HARMONY),
        ("auto", "{{ messages }}", reasoning.NONE),
        ("auto", None, reasoning.NONE),
        ("none", "<think>", reasoning.NONE),
        ("<reasoning>", None, Style("<reasoning>", "</reasoning>")),
        ("[THINK]", "<think>", MAGISTRAL),
    ],
)
def test_the_style_comes_from_the_setting_or_the_template(
    setting: str, template: str | None, expected: Style
) -> None:
    assert reasoning.style(setting, template) == expected


def test_a_prompt_ending_with_the_opener_leaves_the_answer_inside() -> None:
    assert reasoning.ends_open("<|im_start|>assistant\n<think>\n", THINK)
    assert not reasoning.ends_open("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not reasoning.ends_open("Use <think> tags.<|im_start|>assistant\n", THINK)
    assert not reasoning.ends_open("<think>\n", reasoning.NONE)


QWEN3_TEMPLATE = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
GPT_OSS_TEMPLATE = (
    '{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "medium" %}{%- endif %}'
    '{{- "Reasoning: " + reasoning_effort }}{%- if "thinking" in message %}'
    "{{ message.thinking }}{% endif %}"
)
V31_TEMPLATE = "{% if not thinking is defined %}{% set thinking = false %}{% endif %}"


def test_the_effort_reaches_the_template_variables_it_uses() -> None:
    assert reasoning.template_kwargs("none", QWEN3_TEMPLATE) == {"enable_thinking": False}
    assert reasoning.template_kwargs("high", QWEN3_TEMPLATE) == {"enable_thinking": True}
    assert reasoning.template_kwargs("low", GPT_OSS_TEMPLATE) == {"reasoning_effort": "low"}
    assert reasoning.template_kwargs("none", V31_TEMPLATE) == {"thinking": False}
    assert reasoning.template_kwargs("medium", V31_TEMPLATE) == {"thinking": True}
    # Not asked for, or a template that takes none: the template renders as it did.
    assert reasoning.template_kwargs(None, QWEN3_TEMPLATE) == {}
    assert reasoning.template_kwargs("high", "{{ messages }} thinking") == {}


def test_a_variable_is_a_bare_name_in_a_jinja_block() -> None:
    assert reasoning.uses_variable("{% if thinking %}", "thinking")
    assert not reasoning.uses_variable("{{ message.thinking }}", "thinking")
    assert not reasoning.uses_variable("{% if 'thinking' in message %}", "thinking")
    assert not reasoning.uses_variable("{% if enable_thinking %}", "thinking")
    assert not reasoning.uses_variable("thinking", "thinking")  # text, not template code


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": "<think>I greet.</think>\n\nHello!",
        "reasoning_content": "I greet.",
    },
    {"role": "user", "content": "again"},
]


def test_earlier_reasoning_is_dropped_for_a_template_that_does_not_render_it() -> None:
    out = reasoning.history(HISTORY, THINK, "{{ messages }}")
    assert out[1] == {"role": "assistant", "content": "Hello!"}
    assert out[0] == HISTORY[0] and out[2] == HISTORY[2]
    assert "reasoning_content" in HISTORY[1]  # the request's own messages are not changed
    parts = [{"type": "text", "text": "<think>x</think>Hi"}]
    got = reasoning.history([{"role": "assistant", "content": parts}], THINK, None)
    assert got[0]["content"] == [{"type": "text", "text": "Hi"}]


def test_earlier_reasoning_reaches_a_template_that_renders_it() -> None:
    qwen3 = "{{ message.reasoning_content }}"
    assert reasoning.history(HISTORY, THINK, qwen3) == HISTORY
    gpt_oss = reasoning.history(HISTORY, reasoning.HARMONY, GPT_OSS_TEMPLATE)
    assert gpt_oss[1]["thinking"] == "I greet." and "reasoning_content" not in gpt_oss[1]


def test_with_reasoning_none_the_text_of_earlier_turns_is_kept() -> None:
    out = reasoning.history(HISTORY, reasoning.NONE, "{{ messages }}")
    assert out[1]["content"] == HISTORY[1]["content"]


def test_the_stream_tally_counts_the_reasoning_deltas() -> None:
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"reasoning_content": "ab"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "cd"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    reasoning.TALLY.tokens = None
    assert list(reasoning.tallied(chunks, len)) == chunks
    assert reasoning.TALLY.tokens == 4
    usage: dict[str, Any] = {"completion_tokens": 9}
    reasoning.usage_details(usage, 4)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}


# Round trips: a stream cut anywhere assembles to the whole answer, reasoning included.
CASES = [
    (R1, split()),
    (OPENED, split(inside=True)),
    ("<think>\n" + OPENED, split(inside=True)),
    (MAGISTRAL_ANSWER, split(MAGISTRAL)),
    (QWEN3_CALL, split(inner=ToolText)),
    ("\n<think> a \n</think> \n b <think>c", split()),
]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), case=st.sampled_from(CASES))
def test_a_stream_cut_anywhere_assembles_to_the_whole_answer(
    data: st.DataObject, case: tuple[str, ReaderFor]
) -> None:
    text, reader_for = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=14))
    assert streamed(text, cuts, NAMES, reader_for) == whole(text, NAMES, reader_for)


#: Fragments a random answer is made of: markers, their pieces, whitespace, words, a call.
FRAGMENTS = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<thi",
        "nk>",
        "</",
        "<",
        "\n",
        " ",
        "\n\n",
        "word",
        "é",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "<tool_call>",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(FRAGMENTS, max_size=14),
    cuts=st.lists(st.integers(0, 300), max_size=14),
    inside=st.booleans(),
    calls=st.booleans(),
)
def test_any_answer_streams_to_what_the_whole_one_is(
    parts: list[str], cuts: list[int], inside: bool, calls: bool
) -> None:
    text = "".join(parts)
    reader_for = split(inner=ToolText if calls else Plain, inside=inside)
    got = streamed(text, cuts, NAMES, reader_for)
    assert got == whole(text, NAMES, reader_for)
    content, _, thought, _ = got
    # An opener always starts reasoning: never content.
    assert "<think>" not in (content or "")
    if "<think>" not in text and not inside and not calls:
        assert (content, thought) == (text, None)
