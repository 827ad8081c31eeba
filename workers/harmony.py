"""gpt-oss's harmony format: an answer as channel messages (pure: no llama.cpp).

The generation prompt ends with ``<|start|>assistant``; the model then writes messages such as

    <|channel|>analysis<|message|>The user asks for the weather…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Oslo"}<|start|>assistant<|channel|>final<|message|>It is sunny.

(one line in the text; a call's header is cut here to fit).

A message's header (up to ``<|message|>``) names its channel and, for a call, its recipient
(``to=functions.NAME``, before or after the channel). ``analysis`` is the model's reasoning;
``final``, and ``commentary`` without a recipient (a preamble to the user), are content; a
message to ``functions.NAME`` is a call of that tool with the message as its JSON arguments.
A message ends at ``<|end|>``, or where the next one starts; the last one at the end of the
generation: ``<|call|>`` and ``<|return|>`` end it, and they are end-of-generation tokens that
never reach the text.

``Harmony`` reads an answer as it is generated (``workers.toolcalls.Reader``): reasoning and
content are handed out as they come, a call when its message ends. A call to a tool that is not
among the request's, or whose arguments are not a JSON object, is content, its message's text
unchanged; so is text outside any message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from workers.toolcalls import Piece, ToolCall, new_call_id, partial_marker

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CONSTRAIN = "<|constrain|>"
CALL = "<|call|>"
RETURN = "<|return|>"

#: The format's marker texts (control tokens in gpt-oss's vocabulary: rendered as text).
MARKERS = (CHANNEL, MESSAGE, START, END, CONSTRAIN)

#: Where a message's body ends (the first two start the next message: they stay in the text).
_BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)
_LONGEST_END = max(map(len, _BODY_ENDS))
#: A header longer than this without ``<|message|>`` is not one (handed out as content).
MAX_HEADER = 512

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")

#: Between two analysis messages of one answer.
BLOCK_SEPARATOR = "\n\n"

_OUTSIDE, _HEADER, _BODY = range(3)


class Harmony:
    """``reasoning``: the analysis channel is reasoning (else content, as ``reasoning =
    "none"`` asks)."""

    def __init__(self, names: Iterable[str], reasoning: bool = True) -> None:
        self.names = frozenset(names)
        self.reasoning = reasoning
        self._buf = ""
        self._state = _OUTSIDE
        self._header = ""
        self._kind = "content"  # in a body: "reasoning", "content" or "call"
        self._call = ""  # the tool a call's body is for
        self._reasoned = False  # an analysis message handed out reasoning already
        self._fresh = False  # no text of this body handed out yet
        # Where a held call body's end may start: the text before was searched, so each
        # token's search covers its own text, not the whole call again.
        self._scan = 0
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._state == _OUTSIDE:
                # Text outside a message is content, but not the whitespace before a message
                # (or at the end): a trailing run of it is held until that is known.
                starts = [i for i in (self._buf.find(START), self._buf.find(CHANNEL)) if i >= 0]
                if not starts:
                    keep = partial_marker(self._buf, START, CHANNEL)
                    ready = self._buf[: len(self._buf) - keep]
                    kept = ready.rstrip()
                    self._buf = self._buf[len(kept) :]
                    return out + ([("content", kept)] if kept else [])
                i = min(starts)
                kept = self._buf[:i].rstrip()
                if kept:
                    out.append(("content", kept))
                self._buf = self._buf[i:]
                self._state = _HEADER
                continue
            if self._state == _HEADER:
                j = self._buf.find(MESSAGE)
                if j < 0 and len(self._buf) < MAX_HEADER + len(MESSAGE):
                    return out  # the header may still end
                if j < 0 or j > MAX_HEADER:
                    # Not a header: its opening marker is text, and the rest is read again.
                    marker = START if self._buf.startswith(START) else CHANNEL
                    out.append(("content", marker))
                    self._buf = self._buf[len(marker) :]
                    self._state = _OUTSIDE
                    continue
                self._open(self._buf[:j])
                self._buf = self._buf[j + len(MESSAGE) :]
                continue
            end, marker = _first(self._buf, _BODY_ENDS, self._scan)
            if end < 0:
                if self._kind == "call":
                    self._scan = max(0, len(self._buf) - _LONGEST_END + 1)
                    return out
                keep = partial_marker(self._buf, *_BODY_ENDS)
                ready = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(ready) :]
                return out + self._text(ready)
            body = self._buf[:end]
            consumed = end if marker in (START, CHANNEL) else end + len(marker)
            self._buf = self._buf[consumed:]
            out += self._close(body)

    def _open(self, header: str) -> None:
        self._header = header
        self._state = _BODY
        self._fresh = True
        self._scan = 0
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            self._kind = "call"
            self._call = recipient.group(1).removeprefix("functions.")
        elif channel and channel.group(1) == "analysis" and self.reasoning:
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _text(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self._kind == "reasoning" and self._fresh and self._reasoned:
            text = BLOCK_SEPARATOR + text
        self._fresh = False
        if self._kind == "reasoning":
            self._reasoned = True
        return [(self._kind, text)]

    def _close(self, body: str) -> list[Piece]:
        """The message whose body (the rest of it, for reasoning and content) is ``body``
        ended."""
        self._state = _OUTSIDE
        if self._kind != "call":
            return self._text(body)
        call = self._decode(body)
        if call is None:
            return [("content", self._header + MESSAGE + body)]
        self.calls += 1
        return [("call", call)]

    def _decode(self, body: str) -> ToolCall | None:
        if self._call not in self.names:
            return None
        try:
            args = json.loads(body)
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        return ToolCall(self._call, json.dumps(args, ensure_ascii=False), new_call_id())

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if self._state == _HEADER:
            self._state = _OUTSIDE
            return [("content", rest)]
        if self._state == _BODY:
            return self._close(rest)
        kept = rest.rstrip()
        return [("content", kept)] if kept else []


def _first(buf: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """Where the first of ``markers`` starts in ``buf`` (from ``start``), and which (-1, ""
    when none does)."""
    best, which = -1, ""
    for m in markers:
        i = buf.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which
