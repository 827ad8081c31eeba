"""How one loaded model writes its answers: where its reasoning is, and how its tool calls look
(pure: no llama.cpp).

Decided once at load from ``[models.X] reasoning`` and ``tool_format`` and the chat template
that renders its prompts (``decide``); each chat request then gets the reader of its answer's
text (``AnswerFormat.reader_for``): the reasoning split first (``workers.reasoning.Split``),
then the calls parsed from what is left (``workers.tool_formats``), or harmony's reader, which
does both. The markers of both formats are listed for the runtime (``AnswerFormat.markers``):
one that is a control token of the model's vocabulary would otherwise render as nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers import reasoning, tool_formats
from workers.reasoning import NONE, Style
from workers.toolcalls import Plain, ReaderFor


@dataclass(frozen=True)
class AnswerFormat:
    """``reasoning``: how its reasoning is split off (``reasoning.NONE`` with ``reasoning =
    "none"``); ``shown``: the reasoning markers its template or setting names, kept as text
    even when nothing is split; ``tools``: its tool-call format (None: its template takes no
    tools)."""

    reasoning: Style = NONE
    shown: Style = NONE
    tools: str | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        out = list(self.shown.markers)
        if self.shown.harmony:
            out += tool_formats.MARKERS[tool_formats.HARMONY]
        if self.tools is not None:
            out += tool_formats.MARKERS[self.tools]
        return tuple(dict.fromkeys(out))

    def reader_for(
        self, names: frozenset[str], tools: list[dict[str, Any]], inside: bool
    ) -> ReaderFor | None:
        """The reader of a free-text answer to a request whose calls to ``names`` (its
        ``tools``) are parsed (none: it parses no calls); None when the text is the answer
        as it is. ``inside``: its prompt left the answer inside a reasoning block."""
        fmt = self.tools if names else None
        if self.reasoning.harmony or fmt == tool_formats.HARMONY:
            return tool_formats.reader_for(tool_formats.HARMONY, tools, self.reasoning.harmony)
        calls = tool_formats.reader_for(fmt, tools) if fmt is not None else None
        if not self.reasoning.open:
            return calls
        split, inner = self.reasoning, calls or Plain
        return lambda n: reasoning.Split(split, inner(n), inside)


def decide(
    reasoning_setting: str, tool_setting: str, template: str | None, takes_tools: bool
) -> AnswerFormat:
    """The answer format of a model served with ``template`` (None: a built-in chat format)
    whose template takes tools (``takes_tools``) or not."""
    split = reasoning.style(reasoning_setting, template)
    shown = reasoning.style("auto", template) if reasoning_setting == "none" else split
    tools = tool_formats.choose(tool_setting, template) if takes_tools else None
    return AnswerFormat(split, shown, tools)
