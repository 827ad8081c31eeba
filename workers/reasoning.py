"""A model's reasoning, told apart from its answer (pure: no llama.cpp).

Models that think before they answer write the thinking in the same text as the answer,
between markers (``<think>…</think>``: DeepSeek-R1, Qwen3, QwQ; ``[THINK]…[/THINK]``:
Magistral) or in a channel of their own (gpt-oss's harmony ``analysis`` channel, read by
``workers.harmony``). ``[models.X] reasoning`` says which: ``"auto"`` reads it from the chat
template (``style``), ``"none"`` leaves everything in the answer, an opening marker names it.

``Split`` reads an answer as it is generated and hands the reasoning out as ("reasoning", text)
pieces, the rest to the reader of the request's tool calls behind it (``workers.toolcalls``'s
protocol), so the reasoning is never content and a call written after it is still parsed. Some
templates end the generation prompt inside an open block (DeepSeek-R1's distills, Qwen3's
thinking models end it with ``<think>\\n``): the answer then starts in reasoning, without an
opener (``ends_open``).

Also here: what a request's ``reasoning_effort`` becomes for a template that takes it
(``template_kwargs``), and the reasoning of earlier assistant turns, which a template that does
not render it must not see as their content (``history``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from residency.settings import reasoning_markers
from workers.toolcalls import Piece, Reader, partial_marker

#: ``reasoning_effort`` values a request may carry (web validates them).
EFFORTS = ("none", "minimal", "low", "medium", "high")

THINK = ("<think>", "</think>")
MISTRAL_THINK = ("[THINK]", "[/THINK]")
#: What in a chat template says the model writes harmony's channels (gpt-oss).
HARMONY_MARK = "<|channel|>"

#: Between two reasoning blocks of one answer (each block is trimmed).
BLOCK_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Style:
    """How one model's reasoning is told apart: between ``open`` and ``close``, in harmony's
    analysis channel, or not at all (both markers empty, not harmony)."""

    open: str = ""
    close: str = ""
    harmony: bool = False

    @property
    def splits(self) -> bool:
        return self.harmony or bool(self.open)

    @property
    def markers(self) -> tuple[str, ...]:
        """Its marker texts (harmony's are the tool format's, ``workers.harmony``)."""
        return (self.open, self.close) if self.open else ()


NONE = Style()
HARMONY = Style(harmony=True)


def detected(template: str | None) -> Style:
    """The style a chat template shows: the markers it mentions, or harmony's channels."""
    if not template:
        return NONE
    if THINK[0] in template:
        return Style(*THINK)
    if MISTRAL_THINK[0] in template:
        return Style(*MISTRAL_THINK)
    if HARMONY_MARK in template:
        return HARMONY
    return NONE


def style(setting: str, template: str | None) -> Style:
    """``[models.X] reasoning`` for a model whose chat template is ``template`` (None: it
    renders with a built-in format)."""
    if setting == "none":
        return NONE
    if setting == "auto":
        return detected(template)
    pair = reasoning_markers(setting)
    assert pair is not None  # validated with the settings
    return Style(*pair)


def ends_open(prompt: str, style: Style) -> bool:
    """Whether a rendered generation prompt leaves the answer inside an open reasoning block:
    it ends with the opener (whitespace aside), as DeepSeek-R1's and Qwen3's templates do."""
    return bool(style.open) and prompt.rstrip().endswith(style.open)


class Split:
    """Reads an answer's text as it is generated (``workers.toolcalls.Reader``): the text of
    each reasoning block is handed out as reasoning, trimmed of the whitespace around it, and
    the rest goes through ``inner`` (the request's tool-call reader), in order. A marker split
    across chunks is held until it is decided; the whitespace right after a closer, and before
    an opener that starts the answer, is not content. ``inside``: the prompt left the answer
    inside a block (an opener written anyway at its start is dropped). A block the generation
    ends in (cut by ``max_tokens``) is reasoning to its end."""

    def __init__(self, style: Style, inner: Reader, inside: bool = False) -> None:
        assert style.open and style.close
        self.open, self.close = style.open, style.close
        self.inner = inner
        self._buf = ""
        self._in = inside
        self._lead = True  # nothing handed out yet: whitespace before an opener is not content
        self._first = inside  # inside from the prompt: an opener may still come, once
        self._skip = False  # just after a closer: whitespace is not content
        self._rlead = True  # at a block's start: its leading whitespace is dropped
        self._rpend = ""  # a block's trailing whitespace, held until more reasoning follows
        self._blocks = 0  # blocks that handed out reasoning

    def _reasoning(self, text: str, final: bool) -> list[Piece]:
        if self._rlead:
            text = text.lstrip()
            if not text:
                return []
            self._rlead = False
            if self._blocks:
                text = BLOCK_SEPARATOR + text
            self._blocks += 1
        text = self._rpend + text
        kept = text.rstrip()
        self._rpend = "" if final else text[len(kept) :]
        return [("reasoning", kept)] if kept else []

    def _content(self, text: str) -> list[Piece]:
        if self._skip:
            text = text.lstrip()
            if not text:
                return []
            self._skip = False
        return self.inner.feed(text) if text else []

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in:
                if self._first:
                    head = self._buf.lstrip()
                    if not head or (len(head) < len(self.open) and self.open.startswith(head)):
                        return out  # may still be an opener the model wrote anyway
                    self._first = False
                    if head.startswith(self.open):
                        self._buf = head[len(self.open) :]
                end = self._buf.find(self.close)
                if end < 0:
                    keep = partial_marker(self._buf, self.close)
                    ready = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(ready) :]
                    return out + self._reasoning(ready, final=False)
                out += self._reasoning(self._buf[:end], final=True)
                self._buf = self._buf[end + len(self.close) :]
                self._in, self._skip, self._lead = False, True, False
                continue
            if self._lead:
                head = self._buf.lstrip()
                if not head or (len(head) < len(self.open) and self.open.startswith(head)):
                    return out  # the answer may still open with a block
                self._lead = False
                if head.startswith(self.open):
                    self._buf = head  # the whitespace before it is not content
            start = self._buf.find(self.open)
            if start >= 0:
                out += self._content(self._buf[:start])
                self._buf = self._buf[start + len(self.open) :]
                self._in, self._rlead, self._rpend = True, True, ""
                continue
            keep = partial_marker(self._buf, self.open)
            ready = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(ready) :]
            return out + self._content(ready)

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if self._in:
            if self._first and rest.strip() and self.open.startswith(rest.strip()):
                rest = ""  # only a partial opener: nothing was reasoned
            out = self._reasoning(rest, final=True)
        else:
            out = self._content(rest)
        return out + self.inner.finish()


def template_kwargs(effort: str | None, template: str | None) -> dict[str, Any]:
    """What a request's ``reasoning_effort`` (None: not given) tells a chat template that takes
    it: gpt-oss's ``reasoning_effort``, Qwen3's ``enable_thinking`` (false for "none"),
    DeepSeek V3.1's ``thinking``. Only the variables the template uses are passed: a template
    that takes none renders as it did."""
    if effort is None or not template:
        return {}
    out: dict[str, Any] = {}
    if uses_variable(template, "reasoning_effort"):
        out["reasoning_effort"] = effort
    if uses_variable(template, "enable_thinking"):
        out["enable_thinking"] = effort != "none"
    if uses_variable(template, "thinking"):
        out["thinking"] = effort != "none"
    return out


_JINJA_BLOCK = re.compile(r"\{[{%](.*?)[}%]\}", re.S)
_STRING = re.compile(r"'[^']*'|\"[^\"]*\"")


def uses_variable(template: str, name: str) -> bool:
    """Whether a Jinja template reads the top-level variable ``name`` (not an attribute of
    something else such as ``message.thinking``, nor a word inside a string)."""
    bare = re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")
    blocks = (_STRING.sub("", m.group(1)) for m in _JINJA_BLOCK.finditer(template))
    return any(bare.search(b) for b in blocks)


def _without_blocks(text: str, style: Style) -> str:
    """``text`` with its reasoning blocks (and the whitespace after each) taken out; an
    unclosed block runs to its end."""
    out: list[str] = []
    i = 0
    while True:
        start = text.find(style.open, i)
        if start < 0:
            out.append(text[i:])
            break
        out.append(text[i:start])
        end = text.find(style.close, start + len(style.open))
        if end < 0:
            break
        i = end + len(style.close)
        while i < len(text) and text[i].isspace():
            i += 1
    return "".join(out)


def history(
    messages: Iterable[Mapping[str, Any]], style: Style, template: str | None
) -> list[dict[str, Any]]:
    """Earlier assistant turns as the template should see them. A template that renders
    ``reasoning_content`` gets it as sent (an Anthropic thinking block, a Responses reasoning
    item, or a client's own turn); one that renders ``message.thinking`` (gpt-oss) gets it under
    that name; any other gets neither it nor the reasoning blocks in the turn's text, which it
    would render as what the assistant said."""
    keeps = "reasoning_content" in (template or "")
    as_thinking = not keeps and "message.thinking" in (template or "")
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        if msg.get("role") == "assistant" and not keeps:
            reasoning = msg.pop("reasoning_content", None)
            # gpt-oss's template refuses a call turn with both a text and a thinking.
            both = msg.get("tool_calls") and msg.get("content")
            if as_thinking and isinstance(reasoning, str) and reasoning and not both:
                msg.setdefault("thinking", reasoning)
            if style.open:
                msg["content"] = _content_without_blocks(msg.get("content"), style)
        out.append(msg)
    return out


def _content_without_blocks(content: Any, style: Style) -> Any:
    if isinstance(content, str):
        return _without_blocks(content, style)
    if isinstance(content, list):
        return [
            {**p, "text": _without_blocks(p["text"], style)}
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
    return content


class Tally(threading.local):
    """The reasoning tokens of the chat generation this thread serves (None: the model does
    not split reasoning, or nothing was counted yet): set by the runtime when a stream's
    reasoning is complete, read by the model process for the stream's usage chunk. Per thread:
    a request is served, its stream iterated included, in one thread."""

    tokens: int | None = None


TALLY = Tally()


def usage_details(usage: dict[str, Any], tokens: int) -> None:
    """``tokens`` reasoning tokens into a chat usage object, in OpenAI's place."""
    details = usage.get("completion_tokens_details")
    if not isinstance(details, dict):
        details = usage["completion_tokens_details"] = {}
    details["reasoning_tokens"] = tokens


def tallied(
    chunks: Iterable[dict[str, Any]], count: Callable[[str], int]
) -> Iterator[dict[str, Any]]:
    """A chat stream whose ``delta.reasoning_content`` is counted (``count``: text → tokens)
    into ``TALLY`` once the answer's last choice chunk has passed; closing it closes the stream
    under it."""
    TALLY.tokens = 0
    seen: list[str] = []
    it = iter(chunks)
    try:
        for chunk in it:
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                text = delta.get("reasoning_content")
                if isinstance(text, str):
                    seen.append(text)
                if choice.get("finish_reason") is not None:
                    TALLY.tokens = count("".join(seen)) if seen else 0
            yield chunk
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
