"""Reasoning kept apart and a tool-call format other than Hermes's, end to end: a real Redis, real
model processes running llama.cpp on tiny GGUFs, requests through the official ``openai`` client
over a real HTTP server, each answer's text scripted token by token through the real engine
(the ``script_text`` fault).

The "thinking" models' vocabularies have ``<think>`` and ``</think>`` as control tokens, as real
ones do: what the client gets shows that they reached the answer's reader as text. The
reasoning is in ``reasoning_content`` (whole) and ``delta.reasoning_content`` (streamed), never
in ``content``, and counted in ``usage.completion_tokens_details.reasoning_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import openai
import pytest
import requests

from residency.tinymodel import write_tiny_model
from tests.conftest import Pool
from tests.integration.reasoning_templates import (
    OPEN_TEMPLATE,
    QWEN3_CODER_TEMPLATE,
    THINK_TEMPLATE,
    THINK_TOKENS,
)
from tests.integration.test_bounded_work import http_server
from tests.integration.test_fault_script import ADMIN, WEATHER

USER = [{"role": "user", "content": "Say hello."}]
THOUGHT = "The user greets me. I greet back."
ANSWER = "Hello there!"


@dataclass
class Box:
    pool: Pool
    client: openai.OpenAI
    base: str
    paths: dict[str, Path]

    def script(self, **texts: Any) -> None:
        resp = requests.post(
            f"{self.base}/admin/faults", json={"script_text": texts}, headers=ADMIN, timeout=30
        )
        assert resp.status_code == 200, resp.text

    def chat(self, model: str, **kw: Any) -> Any:
        return self.client.chat.completions.create(
            model=model, messages=kw.pop("messages", USER), **{"max_tokens": 200, **kw}
        )

    def streamed(self, model: str, **kw: Any) -> tuple[str, str, list[Any], str | None, Any]:
        """(content, reasoning, tool call deltas, finish reason, usage) of a streamed answer."""
        content, thought, finish, usage = "", "", None, None
        calls: list[Any] = []
        opts = {"include_usage": True}
        for chunk in self.chat(model, stream=True, stream_options=opts, **kw):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                thought += getattr(choice.delta, "reasoning_content", None) or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
        return content, thought, calls, finish, usage

    def tokens(self, model: str, text: str) -> int:
        """``text``'s tokens in ``model``'s vocabulary (what its reasoning is counted in)."""
        vocab = llama_cpp.Llama(str(self.paths[model]), vocab_only=True, verbose=False)
        try:
            return len(vocab.tokenize(text.encode(), add_bos=False, special=False))
        finally:
            vocab.close()


@pytest.fixture
def box(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[Box]:
    """``think``: mentions <think> in its template; ``open``: its generation prompt ends inside
    <think> (Qwen3-style, with ``enable_thinking``); ``none``: ``think``'s file with
    ``reasoning = "none"``; ``coder``: takes tools in Qwen3-Coder's XML."""
    paths = {
        "think": models_dir / "tiny-think.gguf",
        "open": models_dir / "tiny-think-open.gguf",
        "coder": models_dir / "tiny-qwen3-coder.gguf",
    }
    templates = {"think": THINK_TEMPLATE, "open": OPEN_TEMPLATE, "coder": QWEN3_CODER_TEMPLATE}
    for name, path in paths.items():
        if not path.exists():
            tokens = () if name == "coder" else THINK_TOKENS
            write_tiny_model(path, seed=21, chat_template=templates[name], control_tokens=tokens)
    paths["none"] = paths["think"]
    models = {
        name: {"path": str(path), "n_ctx": 1024, "parallel": 1} for name, path in paths.items()
    }
    models["none"]["reasoning"] = "none"
    pool = start_pool(models=models, debug={"fault_injection": True}, pool={"max_loaded_models": 4})
    with http_server(pool) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield Box(pool, client, base, paths)


def test_reasoning_is_apart_from_the_content_whole_and_streamed(box: Box) -> None:
    text = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    box.script(think=[text, text])
    whole = box.chat("think")
    message = whole.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == THOUGHT  # type: ignore[attr-defined]
    n = box.tokens("think", THOUGHT)
    assert whole.usage.completion_tokens_details.reasoning_tokens == n
    assert whole.usage.completion_tokens > n

    content, thought, calls, finish, usage = box.streamed("think")
    assert (content, thought, calls, finish) == (ANSWER, THOUGHT, [], "stop")
    assert usage.completion_tokens_details.reasoning_tokens == n
    assert usage.completion_tokens == whole.usage.completion_tokens

    # The answer goes back as the next turn's history, its reasoning beside it.
    box.script(think="Again!")
    history = [*USER, {**message.model_dump(exclude_none=True)}, {"role": "user", "content": "Hi"}]
    again = box.chat("think", messages=history).choices[0].message
    assert again.content == "Again!"
    assert getattr(again, "reasoning_content", None) is None  # it did not reason this time


def test_an_answer_that_starts_inside_reasoning_is_split_without_an_opener(box: Box) -> None:
    text = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    box.script(open=[text, text])
    message = box.chat("open").choices[0].message
    assert (message.content, message.reasoning_content) == (ANSWER, THOUGHT)  # type: ignore[attr-defined]
    content, thought, _, _, usage = box.streamed("open")
    assert (content, thought) == (ANSWER, THOUGHT)
    assert usage.completion_tokens_details.reasoning_tokens == box.tokens("open", THOUGHT)

    # reasoning_effort "none" reaches the template, which closes the block in the prompt.
    box.script(open=ANSWER)
    off = box.chat("open", reasoning_effort="none").choices[0].message
    assert off.content == ANSWER
    assert getattr(off, "reasoning_content", None) is None


def test_reasoning_none_leaves_everything_in_the_content(box: Box) -> None:
    text = f"<think>{THOUGHT}</think>{ANSWER}"
    box.script(none=[text, text])
    message = box.chat("none").choices[0].message
    assert message.content == text  # the markers included: nothing is taken out
    assert getattr(message, "reasoning_content", None) is None
    content, thought, _, _, usage = box.streamed("none")
    assert (content, thought) == (text, "")
    assert usage.completion_tokens_details is None


CODER_CALL = (
    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "</function>\n</tool_call>"
)


def test_qwen3_coder_calls_whole_and_streamed(box: Box) -> None:
    box.script(coder=[CODER_CALL, CODER_CALL])
    choice = box.chat("coder", tools=[WEATHER], tool_choice="auto").choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    content, _, calls, finish, _ = box.streamed("coder", tools=[WEATHER], tool_choice="auto")
    assert (content, finish) == ("Checking.\n", "tool_calls")
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Oslo"}
