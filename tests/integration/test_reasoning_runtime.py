"""Reasoning through the runtime on real llama.cpp (tiny GGUFs whose vocabularies have
``<think>`` and ``</think>`` as control tokens, as real ones do), each generation's text
scripted token by token through the real engine (``workers.faults.StepFaults``): the split of
whole and streamed answers, the reasoning tokens counted, a prompt that leaves the answer
inside reasoning unless ``reasoning_effort`` turns thinking off, and earlier turns' reasoning
kept from a template that would render it as their text."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from residency.settings import ModelSpec
from residency.tinymodel import write_tiny_model
from tests.integration.reasoning_templates import OPEN_TEMPLATE, THINK_TEMPLATE, THINK_TOKENS
from workers import reasoning
from workers.faults import StepFaults
from workers.runtime import LlamaRuntime

USER = [{"role": "user", "content": "hi"}]


class Scripted:
    def __init__(self, path: Path, **spec: Any) -> None:
        self.steps = StepFaults(threading.Event())
        self.rt = LlamaRuntime(wrap=self.steps.wrap)
        self.rt.load(ModelSpec(path=str(path), n_ctx=512, parallel=1, **spec), "cpu")

    def chat(self, text: str, stream: bool = False, **params: Any) -> Any:
        self.steps.script(text)
        return self.rt.chat({"messages": USER, "max_tokens": 100, **params}, stream)

    def streamed(self, text: str, **params: Any) -> tuple[str, str, int | None]:
        content, thought = "", ""
        for chunk in self.chat(text, True, **params):
            for choice in chunk["choices"]:
                content += choice["delta"].get("content") or ""
                thought += choice["delta"].get("reasoning_content") or ""
        return content, thought, reasoning.TALLY.tokens

    def tokens(self, text: str) -> int:
        return len(self.rt.llm.tokenize(text.encode(), add_bos=False, special=False))


@pytest.fixture
def model(tmp_path: Path) -> Iterator[Any]:
    made: list[Scripted] = []

    def _model(template: str, **spec: Any) -> Scripted:
        path = tmp_path / f"m{len(made)}.gguf"
        write_tiny_model(path, seed=9, chat_template=template, control_tokens=THINK_TOKENS)
        made.append(Scripted(path, **spec))
        return made[-1]

    yield _model
    for m in made:
        m.rt.close()


def test_a_think_block_is_reasoning_whole_and_streamed(model: Any) -> None:
    m = model(THINK_TEMPLATE)
    text = "<think>I should greet back.</think>\n\nHello there."
    out = m.chat(text)
    message = out["choices"][0]["message"]
    assert message["content"] == "Hello there."
    assert message["reasoning_content"] == "I should greet back."
    n = m.tokens("I should greet back.")
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}
    assert out["usage"]["completion_tokens"] > n
    assert m.streamed(text) == ("Hello there.", "I should greet back.", n)
    # An answer without reasoning has no reasoning field, and counts none.
    plain = m.chat("Just this.")
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert plain["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_a_prompt_ending_inside_reasoning_until_the_effort_turns_it_off(model: Any) -> None:
    m = model(OPEN_TEMPLATE)
    message = m.chat("I reason.</think>\n\nThe answer.")["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("The answer.", "I reason.")
    n = m.tokens("I reason.")
    assert m.streamed("I reason.</think>The answer.") == ("The answer.", "I reason.", n)
    # "none": the template closes the block in the prompt (enable_thinking=false).
    off = m.chat("The answer.", reasoning_effort="none")["choices"][0]["message"]
    assert off["content"] == "The answer." and "reasoning_content" not in off
    on = m.rt.count_tokens({"messages": USER, "reasoning_effort": "high"})["input_tokens"]
    shut = m.rt.count_tokens({"messages": USER, "reasoning_effort": "none"})["input_tokens"]
    assert shut > on  # the effort reached the template


def test_an_answer_under_a_grammar_is_not_split(model: Any) -> None:
    """The grammar makes the answer JSON from its first token: even where the prompt leaves it
    inside reasoning, it is the content (and counts no reasoning)."""
    takes_tools = (
        "{%- if tools %}<|im_start|>system\n<tool_call>{{ tools }}<|im_end|>\n{%- endif %}"
    )
    m = model(takes_tools + OPEN_TEMPLATE)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    rf = {"type": "json_object"}
    for extra in ({}, {"tools": [tool], "tool_choice": "auto"}):
        out = m.chat('{"a": 1}', response_format=rf, **extra)
        message = out["choices"][0]["message"]
        assert message["content"] == '{"a": 1}' and "reasoning_content" not in message
        assert "completion_tokens_details" not in out["usage"]
        assert m.streamed('{"a": 1}', response_format=rf, **extra) == ('{"a": 1}', "", None)


def test_reasoning_none_keeps_it_all_in_the_content(model: Any) -> None:
    m = model(THINK_TEMPLATE, reasoning="none")
    text = "<think>I should greet back.</think>Hello there."
    out = m.chat(text)
    assert out["choices"][0]["message"]["content"] == text
    assert "reasoning_content" not in out["choices"][0]["message"]
    assert "completion_tokens_details" not in out["usage"]
    assert m.streamed(text) == (text, "", None)


def test_earlier_reasoning_is_not_rendered_as_what_the_assistant_said(model: Any) -> None:
    m = model(THINK_TEMPLATE)

    def prompt_tokens(assistant: dict[str, Any]) -> int:
        messages = [*USER, {"role": "assistant", **assistant}, {"role": "user", "content": "ok"}]
        return int(m.rt.count_tokens({"messages": messages})["input_tokens"])

    bare = prompt_tokens({"content": "Hello there."})
    thought = "I should greet back, warmly and at some length."
    assert prompt_tokens({"content": f"<think>{thought}</think>\n\nHello there."}) == bare
    assert prompt_tokens({"content": "Hello there.", "reasoning_content": thought}) == bare
