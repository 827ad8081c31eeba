"""A model's answer text as a chat stream cut at given places, and what an OpenAI client builds
from the stream's deltas, beside the whole answer's message: what the answer readers' round
trips compare (a stream cut anywhere must assemble to the whole answer)."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterable
from typing import Any

from workers import toolcalls
from workers.toolcalls import ReaderFor

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chunks_of(pieces: Iterable[str], finish: str = "stop") -> list[dict[str, Any]]:
    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {**BASE, "choices": [choice]}

    return [
        chunk({"role": "assistant"}),
        *(chunk({"content": p}) for p in pieces),
        chunk({}, finish),
    ]


def cut(text: str, cuts: Iterable[int]) -> list[str]:
    bounds = [0, *sorted(min(max(c, 0), len(text)) for c in cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


#: (content, [(name, arguments)], reasoning, finish_reason); content None when only calls.
Assembled = tuple[str | None, list[tuple[str, Any]], str | None, str]


def assemble(chunks: Iterable[dict[str, Any]]) -> Assembled:
    """What an OpenAI client builds from the deltas (reasoning None when there was none)."""
    content, reasoning, finish = "", "", ""
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        choice = c["choices"][0]
        delta = choice["delta"]
        assert "content" not in delta or delta["content"], "an empty content delta"
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"name": "", "arguments": "", "id": ""})
            slot["id"] += tc.get("id") or ""
            slot["name"] += (tc.get("function") or {}).get("name") or ""
            slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        finish = choice["finish_reason"] or finish
    out = [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())]
    assert all(v["id"].startswith("call_") for v in calls.values())
    return (content or None) if out else content, out, reasoning or None, finish


def whole(text: str, names: Iterable[str], reader_for: ReaderFor) -> Assembled:
    """The whole answer's message, in ``assemble``'s terms."""
    message = {"role": "assistant", "content": text}
    resp = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
    choice = toolcalls.answer_with_calls(copy.deepcopy(resp), names, reader_for)["choices"][0]
    message = choice["message"]
    if "reasoning_content" in message:
        assert message["reasoning_content"], "an empty reasoning_content field"
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]
    content = message["content"]
    return content, calls, message.get("reasoning_content"), choice["finish_reason"]


def streamed(
    text: str, cuts: Iterable[int], names: Iterable[str], reader_for: ReaderFor
) -> Assembled:
    out = toolcalls.stream_with_calls(chunks_of(cut(text, cuts)), names, reader_for)
    return assemble(out)
