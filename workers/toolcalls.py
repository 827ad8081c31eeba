"""Tool calls in a model's text, turned into OpenAI ``tool_calls`` (pure: no llama.cpp).

A model whose chat template takes ``tools`` answers a call in text; two formats are common:

* Hermes / Qwen: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` blocks, possibly
  after some text and several in a row;
* Llama 3.x: the whole answer is one JSON object ``{"name": "f", "parameters": {...}}``
  (``arguments`` is accepted too).

``ToolText`` reads the text as it is generated and hands out, in order, the content a client may
see and each call once it is complete: the text of a ``<tool_call>`` block (and of a partial
``<tool_call>`` opener) is held back until it is decided, and an answer that starts with ``{``
is held to its end. Text that turns out not to be a call (bad JSON, a name that is not among
the request's tools) is handed out as content, unchanged. The whole answer (``parse``) and the
stream (``stream_with_calls``) go through the same reader, so a streamed answer assembles to what
the whole one would have been.

Other formats' readers (``workers.tool_formats``, ``workers.harmony``) and the reasoning split in
front of them (``workers.reasoning``) speak the same ``Reader`` protocol; a reader may also hand
out reasoning, which goes to ``reasoning_content`` (never into ``content``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    """The call ``obj`` (decoded JSON) stands for, or None when it is not one of ours."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    extra = set(obj) - {"name", "arguments", "parameters"}
    if extra:
        return None
    return ToolCall(obj["name"], text, new_call_id())


def as_call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    """The call a decoded JSON object stands for (``{"name", "arguments" | "parameters"}``),
    or None when it is not a call to one of ``names``."""
    return _call(obj, names)


def _decode(text: str, names: frozenset[str]) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _call(obj, names)


#: What a reader hands out: ("content", text), ("call", ToolCall) or ("reasoning", text).
Piece = tuple[str, Any]


class Reader(Protocol):
    """Reads an answer's text as it is generated and hands out its content and calls."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


#: Makes a reader for the request's tool names (``ToolText``, or another format's).
ReaderFor = Callable[[frozenset[str]], Reader]


class Plain:
    """A reader of an answer that holds no calls: all of it is content (what a reasoning split
    hands on when the request has no tools)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        del names

    def feed(self, text: str) -> list[Piece]:
        return [("content", text)] if text else []

    def finish(self) -> list[Piece]:
        return []


class ToolText:
    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self._buf = ""
        self._started = False  # something other than whitespace was seen
        self._whole_json = False  # the answer started with "{": held to its end
        self._in_block = False  # inside <tool_call> ... (the opener is in _buf)
        # Where the closer may start in _buf, inside a block: the text before was searched,
        # so each token's search covers its own text, not the whole call again.
        self._close_from = 0
        self._after_call = False  # only whitespace since the last call (not worth sending)
        self.calls = 0

    def _content(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self._after_call and not text.strip():
            return []  # whitespace between calls (held: it may precede more text)
        self._after_call = False
        return [("content", text)]

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        if not self._started:
            stripped = self._buf.lstrip()
            if not stripped:
                return []
            self._started = True
            self._whole_json = stripped.startswith("{")
        if self._whole_json:
            return []
        out: list[Piece] = []
        while True:
            if self._in_block:
                end = self._buf.find(CLOSE, self._close_from)
                if end < 0:
                    self._close_from = max(0, len(self._buf) - len(CLOSE) + 1)
                    return out
                block = self._buf[: end + len(CLOSE)]
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_block = False
                self._close_from = 0
                out += self._block(block)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                out += self._content(self._buf[:start])
                self._buf = self._buf[start:]
                self._in_block = True
                continue
            keep = _partial_opener(self._buf)
            ready, self._buf = (
                self._buf[: len(self._buf) - keep],
                self._buf[len(self._buf) - keep :],
            )
            if ready.strip() or not self._after_call:
                out += self._content(ready)
            else:
                self._buf = ready + self._buf  # whitespace after a call: wait for more
            return out

    def _block(self, block: str, closed: bool = True) -> list[Piece]:
        inner = block[len(OPEN) : len(block) - (len(CLOSE) if closed else 0)]
        call = _decode(inner.strip(), self.names)
        if call is None:
            return self._content(block)
        self.calls += 1
        self._after_call = True
        return [("call", call)]

    def finish(self) -> list[Piece]:
        """The generation ended: decide what is still held."""
        rest, self._buf = self._buf, ""
        if self._whole_json:
            call = _decode(rest.strip(), self.names)
            if call is not None:
                self.calls += 1
                return [("call", call)]
            return [("content", rest)] if rest else []
        if self._in_block:
            # Ended inside a block (e.g. its stop token came before the closing tag).
            self._in_block = False
            return self._block(rest, closed=False)
        return self._content(rest) if rest.strip() else []


def _partial_opener(buf: str) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of ``<tool_call>``."""
    return partial_marker(buf, OPEN)


def partial_marker(buf: str, *markers: str) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of one of ``markers``
    (what a reader holds back: the next text may complete it)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buf)), best, -1):
            if buf.endswith(marker[:n]):
                best = n
                break
    return best


@dataclass(frozen=True)
class Read:
    """A whole answer as its reader hands it out: the content (None when only calls, or
    nothing), the calls, and the reasoning ("" when the model did not reason)."""

    content: str | None
    calls: list[ToolCall]
    reasoning: str


def read(text: str, names: Iterable[str], reader_for: ReaderFor = ToolText) -> Read:
    reader = reader_for(frozenset(names))
    pieces = reader.feed(text) + reader.finish()
    calls = [p[1] for p in pieces if p[0] == "call"]
    content = "".join(p[1] for p in pieces if p[0] == "content")
    reasoning = "".join(p[1] for p in pieces if p[0] == "reasoning")
    if calls:
        # Whitespace around the calls is not content (a stream drops it the same way).
        return Read(content if content.strip() else None, calls, reasoning)
    return Read(content, calls, reasoning)


def parse(
    text: str, names: Iterable[str], reader_for: ReaderFor = ToolText
) -> tuple[str | None, list[ToolCall]]:
    """The content (None when only calls, or nothing) and the calls of a whole answer."""
    got = read(text, names, reader_for)
    return got.content, got.calls


def answer_with_calls(
    resp: dict[str, Any], names: Iterable[str], reader_for: ReaderFor = ToolText
) -> dict[str, Any]:
    """A whole chat completion with the calls in its text moved to ``message.tool_calls`` and
    its reasoning to ``message.reasoning_content`` (absent when it did not reason)."""
    choice = resp["choices"][0]
    message = choice.get("message") or {}
    text = message.get("content")
    if not isinstance(text, str) or message.get("tool_calls"):
        return resp
    got = read(text, names, reader_for)
    if got.calls:
        message["content"] = got.content
        message["tool_calls"] = [c.to_openai() for c in got.calls]
        choice["finish_reason"] = "tool_calls"
    elif reader_for is not ToolText:
        message["content"] = got.content  # the reply the format's text carries (decoded)
    if got.reasoning:
        message["reasoning_content"] = got.reasoning
    return resp


def _tool_delta(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """OpenAI's shape: the call's id, type and name first, then its arguments."""
    return [
        {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        },
        {"index": index, "function": {"arguments": call.arguments}},
    ]


def stream_with_calls(
    chunks: Iterable[dict[str, Any]], names: Iterable[str], reader_for: ReaderFor = ToolText
) -> Iterator[dict[str, Any]]:
    """Chat chunks with the calls in their content turned into ``delta.tool_calls`` chunks
    (and what the reader hands out as reasoning into ``delta.reasoning_content`` chunks)."""
    reader = reader_for(frozenset(names))
    emitted = 0
    # Content that is only whitespace so far waits for text: an answer whose content is only
    # whitespace around its calls has none (``read``), so its stream must send none either.
    blank = ""
    texted = False

    def render(base: dict[str, Any], pieces: list[Piece]) -> Iterator[dict[str, Any]]:
        nonlocal emitted, blank, texted
        for kind, value in pieces:
            deltas: list[dict[str, Any]]
            if kind == "content":
                if not texted and not value.strip():
                    blank += value
                    continue
                if not texted:
                    value, blank, texted = blank + value, "", True
                deltas = [{"content": value}]
            elif kind == "reasoning":
                deltas = [{"reasoning_content": value}]
            else:
                deltas = [{"tool_calls": [d]} for d in _tool_delta(emitted, value)]
                emitted += 1
            for delta in deltas:
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                yield {**base, "choices": [choice]}

    try:
        for chunk in chunks:
            choices = chunk.get("choices") or []
            if not choices:
                yield chunk
                continue
            choice = choices[0]
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if choice.get("finish_reason") is not None:
                yield from render(chunk, reader.finish())
                if blank and not emitted:
                    # No call: the whitespace is the answer's content after all.
                    rest, blank, texted = blank, "", True
                    yield from render(chunk, [("content", rest)])
                if emitted:
                    choice["finish_reason"] = "tool_calls"
                yield chunk
            elif isinstance(text, str) and not delta.get("tool_calls"):
                yield from render(chunk, reader.feed(text))
            else:
                yield chunk
    finally:
        _close(chunks)


def _close(chunks: Iterable[dict[str, Any]]) -> None:
    # Leaving early must stop the generation under it at once (the engine frees the slot).
    close = getattr(chunks, "close", None)
    if close is not None:
        close()


def normalized_calls(chunks: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """llama-cpp-python's forced-tool stream repeats the call's id, type and name in every
    chunk (and a legacy ``function_call``): OpenAI clients concatenate what they get, so only
    the first chunk of each call keeps them."""
    seen: set[int] = set()
    try:
        for chunk in chunks:
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    continue
                delta.pop("function_call", None)
                for tc in delta.get("tool_calls") or []:
                    i = tc.get("index", 0)
                    if i in seen:
                        tc.pop("id", None)
                        tc.pop("type", None)
                        (tc.get("function") or {}).pop("name", None)
                    seen.add(i)
            yield chunk
    finally:
        _close(chunks)
