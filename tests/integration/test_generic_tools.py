"""Tools on a model whose chat template takes none (the generic format: the tools described in
a system message, the answer a JSON call or reply enforced by a grammar), tool history on such
a model, large bounds in tool schemas, and strings without control characters — through the
official ``openai`` client, real HTTP, real model processes (llama.cpp, tiny GGUFs).

The tiny models emit random tokens: which branch of the answer is taken is forced with a
logit_bias on the first letter of its key ("tool_call" / "response"), and a call's arguments
are fully decided by their schema, so whole and streamed answers must agree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from residency.tinymodel import IM_END_ID, write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import http_server
from tests.integration.test_openai_compat import ADD, USER, WEATHER
from tests.integration.tools_template import TOOLS_TEMPLATE

CALLS = {("get_weather", '{"city": "Paris", "days": 3}'), ("add", '{"a": 1, "b": 2}')}
# The tiny vocabulary's ids of "t" and "r" (a byte token and a piece each): the answer's key
# starts with one of them, so pushing one down takes the other branch.
NO_T = {"121": -100, "386": -100}  # {"response": ...}
NO_R = {"119": -100, "384": -100}  # {"tool_call": ...}
# Byte tokens 0x01-0x1F (ids follow the control tokens): raw control characters.
CONTROL_BYTES = {str(IM_END_ID + 1 + b): 3 for b in range(1, 0x20)}
# A template that takes only user and assistant turns, alternating (as Mistral's and Llama 2's
# do): a tool result or a call it cannot render is its refusal, unless written as text.
STRICT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{%- endif %}"
    "{%- if message['role'] not in ('user', 'assistant') or message['content'] is none %}"
    "{{ raise_exception('Only user and assistant text') }}{%- endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def client(start_pool: Callable[..., Pool], models_dir: Path) -> Iterator[openai.OpenAI]:
    """``g``: the plain ChatML tiny model with room for the tools' description (one token per
    character or so); ``t``: one whose template takes tools; ``s``: one whose template takes
    only alternating user and assistant text."""
    tools_model = models_dir / "tiny-tools.gguf"
    if not tools_model.exists():
        write_tiny_model(tools_model, seed=5, chat_template=TOOLS_TEMPLATE)
    strict_model = models_dir / "tiny-strict.gguf"
    if not strict_model.exists():
        write_tiny_model(strict_model, seed=6, chat_template=STRICT_TEMPLATE)
    models = tiny_models(models_dir)
    models["s"] = {"path": str(strict_model), "n_ctx": 4096, "parallel": 1}
    models["g"] = {"path": str(models_dir / "tiny0.gguf"), "n_ctx": 4096, "parallel": 1}
    models["t"] = {"path": str(tools_model), "n_ctx": 4096, "parallel": 1}
    pool = start_pool(models=models)
    with http_server(pool) as port:
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )


def _calls(msg: Any) -> list[tuple[str, str]]:
    out = []
    for tc in msg.tool_calls or []:
        assert tc.type == "function" and tc.id.startswith("call_")
        out.append((tc.function.name, tc.function.arguments))
    return out


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[dict[str, Any], list[Any]]:
    """A stream's chunks, and what they assemble to (as a client concatenates them):
    ``content``, ``calls`` ([(name, arguments)]) and ``finish_reason``."""
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                name, args = calls.setdefault(tc.index, ["", ""])
                fn = tc.function
                calls[tc.index] = [
                    name + ((fn and fn.name) or ""),
                    args + ((fn and fn.arguments) or ""),
                ]
    done = {
        "content": content,
        "calls": [tuple(v) for _, v in sorted(calls.items())],
        "finish_reason": finish,
    }
    return done, chunks


def test_auto_on_a_model_without_tools_in_its_template_answers_a_call(
    client: openai.OpenAI,
) -> None:
    kw: dict[str, Any] = {
        "model": "g",
        "messages": USER,
        "tools": [WEATHER, ADD],
        "max_tokens": 300,
        "temperature": 0,
        "logit_bias": NO_R,
    }
    for choice in (None, "auto"):
        whole = client.chat.completions.create(**kw, **({"tool_choice": choice} if choice else {}))
        c = whole.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None
        [call] = _calls(c.message)
        assert call in CALLS
    done, chunks = _streamed(client, **kw)
    assert done["finish_reason"] == "tool_calls"
    assert done["calls"] == [call] and done["content"] == ""
    # OpenAI's shape: the name once, in the call's first delta; no content; usage at the end.
    firsts = [
        tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or [] if tc.id
    ]
    assert len(firsts) == 1 and firsts[0].function and firsts[0].function.name == call[0]
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert whole.usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_auto_on_a_model_without_tools_in_its_template_answers_a_reply(
    client: openai.OpenAI,
) -> None:
    kw: dict[str, Any] = {
        "model": "g",
        "messages": USER,
        "tools": [WEATHER, ADD],
        "max_tokens": 40,
        "temperature": 0,
        "logit_bias": NO_T,
    }
    whole = client.chat.completions.create(**kw)
    c = whole.choices[0]
    assert c.finish_reason in ("stop", "length") and not c.message.tool_calls
    assert isinstance(c.message.content, str)
    # The reply's text, decoded from its JSON string: not the JSON.
    assert not c.message.content.lstrip().startswith('{"response"')
    done, chunks = _streamed(client, **kw)
    assert done["content"] == c.message.content and done["calls"] == []
    assert done["finish_reason"] == c.finish_reason
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_sampled_auto_answers_are_a_call_to_one_of_the_tools_or_content(
    client: openai.OpenAI,
) -> None:
    for seed in range(4):
        out = client.chat.completions.create(
            model="g",
            messages=USER,
            tools=[WEATHER, ADD],
            max_tokens=60,
            temperature=1.0,
            seed=seed,
        )
        c = out.choices[0]
        if c.finish_reason == "tool_calls":
            assert c.message.content is None and set(_calls(c.message)) <= CALLS
        else:
            assert isinstance(c.message.content, str) and not c.message.tool_calls


def test_required_and_parallel_calls_on_a_model_without_tools_in_its_template(
    client: openai.OpenAI,
) -> None:
    # Even pushed towards a reply, "required" only has the call branch.
    kw: dict[str, Any] = {
        "model": "g",
        "messages": USER,
        "tools": [WEATHER, ADD],
        "tool_choice": "required",
        "max_tokens": 300,
        "temperature": 0,
        "logit_bias": NO_T,
    }
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    [call] = _calls(whole.choices[0].message)
    assert call in CALLS
    done, _ = _streamed(client, **kw)
    assert done["calls"] == [call] and done["finish_reason"] == "tool_calls"
    named = {"type": "function", "function": {"name": "add"}}
    out = client.chat.completions.create(**{**kw, "tool_choice": named})
    assert _calls(out.choices[0].message) == [("add", '{"a": 1, "b": 2}')]
    out = client.chat.completions.create(**kw, parallel_tool_calls=True)
    calls = _calls(out.choices[0].message)
    assert out.choices[0].finish_reason == "tool_calls" and calls and set(calls) <= CALLS


def test_a_tool_round_trip_on_a_model_without_tools_in_its_template(
    client: openai.OpenAI,
) -> None:
    first = client.chat.completions.create(
        model="g",
        messages=USER,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=300,
        temperature=0,
    )
    [tc] = first.choices[0].message.tool_calls or []
    messages: list[Any] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "clear"}'},
    ]
    # With the tools, and without them (a history alone must render too), also where the
    # template takes nothing but user and assistant text.
    for model, extra in (("g", {"tools": [WEATHER], "logit_bias": NO_T}), ("g", {}), ("s", {})):
        final = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, **extra
        )
        answer = final.choices[0]
        assert answer.finish_reason in ("stop", "length")
        assert isinstance(answer.message.content, str) and not answer.message.tool_calls


BIG = {
    "type": "function",
    "function": {
        "name": "write",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"enum": ["a.txt"]},
                "content": {"type": "string", "maxLength": 524288},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}


# What no grammar enforces cheaply: a costly nested pattern, a format the converter ignores, a
# keyword it cannot read. With "auto" web cannot know whether a grammar is built; the generic
# grammar loosens them.
LOOSE = {
    "type": "function",
    "function": {
        "name": "loose",
        "parameters": {
            "type": "object",
            "properties": {
                "s": {"type": "string", "pattern": "^((a|b){0,100}){0,100}$"},
                "e": {"type": "string", "format": "email"},
                "n": {"not": {"type": "null"}},
            },
        },
    },
}


@pytest.mark.parametrize("model", ["t", "g"])
def test_a_tool_with_a_huge_max_length_is_accepted_and_compiles(
    client: openai.OpenAI, model: str
) -> None:
    # auto: no grammar on a template that takes tools; the generic grammar drops the bound.
    for tools in ([BIG], [BIG, LOOSE]):
        out = client.chat.completions.create(model=model, messages=USER, tools=tools, max_tokens=8)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # required: a grammar is built either way, with the bound dropped (no 400).
    out = client.chat.completions.create(
        model=model, messages=USER, tools=[BIG], tool_choice="required", max_tokens=8
    )
    assert out.choices[0].finish_reason in ("length", "tool_calls")


def test_grammar_strings_never_hold_raw_control_characters(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        },
        "required": ["s", "tags"],
        "additionalProperties": False,
    }
    rf: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for seed in range(20):
        out = client.chat.completions.create(
            model="a",
            messages=USER,
            response_format=rf,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            # The model picks control bytes often: the grammar alone must keep them out.
            logit_bias=CONTROL_BYTES,
        )
        c = out.choices[0]
        assert c.finish_reason == "stop", c
        value = json.loads(c.message.content or "")
        assert isinstance(value["s"], str)
    # A tool call's arguments: the handler's grammar (a template that takes tools) and the
    # generic one.
    note = {
        "type": "function",
        "function": {
            "name": "note",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "maxLength": 24}},
                "required": ["text"],
                "additionalProperties": False,
            },
        },
    }
    for model in ("t", "g"):
        for seed in range(5):
            out = client.chat.completions.create(
                model=model,
                messages=USER,
                tools=[note],
                tool_choice={"type": "function", "function": {"name": "note"}},
                temperature=1.0,
                seed=seed,
                max_tokens=200,
                logit_bias=CONTROL_BYTES,
            )
            [tc] = out.choices[0].message.tool_calls or []
            assert isinstance(json.loads(tc.function.arguments)["text"], str)
