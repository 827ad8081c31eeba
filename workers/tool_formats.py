"""The text formats models write tool calls in, beside Hermes's (pure: no llama.cpp).

Each reader speaks ``workers.toolcalls.Reader``: it hands out content as it is generated and
each call once it is decided, and text that turns out not to be a call (bad JSON or XML, a
name that is not among the request's tools) as content, unchanged. The whole answer and the
stream go through the same reader, so a stream cut anywhere assembles to the whole answer.

* ``hermes`` (``workers.toolcalls.ToolText``): ``<tool_call>{"name", "arguments"}</tool_call>``
  blocks (Hermes, Qwen 2.5/3), or a whole-JSON answer;
* ``llama3`` (``Llama3``): ``<|python_tag|>{"name": …, "parameters": {…}}``, several separated
  by ``;``, or the whole answer one such JSON object (Llama 3.1 to 3.3);
* ``mistral`` (``Mistral``): ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{…}`` (Mistral Small 3.2, Magistral, Devstral; ``[CALL_ID]id`` may
  come before ``[ARGS]``);
* ``qwen3_coder`` (``Qwen3Coder``): ``<tool_call><function=NAME><parameter=P>VALUE</parameter>
  </function></tool_call>``; a value is text, turned into JSON by the type the tool's schema
  gives the parameter;
* ``harmony``: gpt-oss's channel messages (``workers.harmony``).

Llama 3's and Mistral's calls end the answer (their end-of-turn token follows them): the text
from the marker on is held to the end and decided whole. Qwen3-Coder's blocks are decided as
each one closes, like Hermes's.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterable, Mapping
from typing import Any

from residency.tool_schema import parameters
from workers import harmony
from workers.toolcalls import (
    Piece,
    ReaderFor,
    ToolCall,
    ToolText,
    as_call,
    new_call_id,
    partial_marker,
)

HERMES = "hermes"
LLAMA3 = "llama3"
MISTRAL = "mistral"
QWEN3_CODER = "qwen3_coder"
HARMONY = "harmony"

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
XML_OPEN = "<tool_call>"
XML_CLOSE = "</tool_call>"
FUNCTION = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER = "<parameter="
PARAMETER_CLOSE = "</parameter>"

#: The marker texts of each format: the ones that are control tokens in a model's vocabulary
#: are rendered as text (``workers.runtime``), or its reader would never see them.
MARKERS: dict[str, tuple[str, ...]] = {
    HERMES: (XML_OPEN, XML_CLOSE),
    LLAMA3: (PYTHON_TAG,),
    MISTRAL: (TOOL_CALLS, ARGS, CALL_ID),
    QWEN3_CODER: (XML_OPEN, XML_CLOSE),
    HARMONY: harmony.MARKERS,
}


def choose(setting: str, template: str | None) -> str:
    """``[models.X] tool_format`` for a model whose template (None: a built-in format) takes
    tools: "auto" reads the template, most specific mark first; Hermes's when it shows none
    (its reader also takes a whole-JSON answer)."""
    if setting != "auto":
        return setting
    t = template or ""
    if FUNCTION in t:
        return QWEN3_CODER
    if XML_OPEN in t:
        return HERMES
    if PYTHON_TAG in t or "ipython" in t:
        return LLAMA3
    if TOOL_CALLS in t:
        return MISTRAL
    if harmony.CHANNEL in t:
        return HARMONY
    return HERMES


def reader_for(fmt: str, tools: list[dict[str, Any]], reasoning: bool = True) -> ReaderFor:
    """The reader of ``fmt`` for one request's ``tools`` (``reasoning``: harmony's analysis
    channel is reasoning, else content)."""
    if fmt == LLAMA3:
        return Llama3
    if fmt == MISTRAL:
        return Mistral
    if fmt == QWEN3_CODER:
        schemas = {t["function"]["name"]: parameters(t) for t in tools}
        return lambda names: Qwen3Coder(names, schemas)
    if fmt == HARMONY:
        return lambda names: harmony.Harmony(names, reasoning)
    return ToolText


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class _HeldCalls(abc.ABC):
    """Content until the format's marker (held while a tail may still become it); from the
    marker on, the rest of the answer is held and decided at its end (``_calls``)."""

    marker = ""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self._buf = ""
        self._held = False  # the marker was seen: all the rest is decided at the end
        self.calls = 0

    def _start(self) -> bool:
        """Whether the answer, as far as it is known, is held whole from its start."""
        return False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        if self._held or self._start():
            return []
        i = self._buf.find(self.marker)
        if i >= 0:
            ready, self._buf = self._buf[:i], self._buf[i:]
            self._held = True
            return [("content", ready)] if ready else []
        keep = partial_marker(self._buf, self.marker)
        ready = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(ready) :]
        return [("content", ready)] if ready else []

    @abc.abstractmethod
    def _calls(self, rest: str) -> list[ToolCall] | None:
        """The calls ``rest`` (the text from the marker on) holds; None: it is not calls."""

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if self._held or self._start():
            calls = self._calls(rest)
            if calls:
                self.calls += len(calls)
                return [("call", c) for c in calls]
            return [("content", rest)] if rest else []
        return [("content", rest)] if rest.strip() else []


def _llama_call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    # Llama 3 writes ``"type": "function"`` beside the name at times.
    if isinstance(obj, dict) and obj.get("type", "function") == "function":
        obj = {k: v for k, v in obj.items() if k != "type"}
    return as_call(obj, names)


def json_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """JSON call objects one after another, separated by ``;`` (Llama 3 separates several so),
    or None when the text is anything else."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    i = _skip_space(text, 0)
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _llama_call(obj, names)
        if call is None:
            return None
        calls.append(call)
        i = _skip_space(text, i)
        if i < len(text) and text[i] == ";":
            i = _skip_space(text, i + 1)
        elif i < len(text):
            return None
    return calls or None


class Llama3(_HeldCalls):
    """Llama 3.x: ``<|python_tag|>`` then the calls, or an answer that starts with ``{`` (held
    to its end, as Hermes's reader holds one)."""

    marker = PYTHON_TAG

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__(names)
        self._whole: bool | None = None  # None: only whitespace seen so far

    def _start(self) -> bool:
        if self._whole is None:
            head = self._buf.lstrip()
            if not head:
                return True  # hold leading whitespace: it may precede a JSON answer
            self._whole = head.startswith("{")
        return self._whole

    def finish(self) -> list[Piece]:
        if self._whole is None:  # only whitespace: nothing
            self._buf = ""
            return []
        return super().finish()

    def _calls(self, rest: str) -> list[ToolCall] | None:
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG) :]
        return json_calls(rest, self.names)


class Mistral(_HeldCalls):
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{…}`` (each call
    after its own ``[TOOL_CALLS]``, or one after another)."""

    marker = TOOL_CALLS

    def _calls(self, rest: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for part in rest.split(TOOL_CALLS)[1:]:
            got = _mistral_part(part.strip(), self.names)
            if got is None:
                return None
            calls += got
        return calls or None


def _mistral_part(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    if text[:1] in ("[", "{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = []
        for item in items:
            # The id Mistral's history carries is its own; the call gets an OpenAI one.
            if isinstance(item, dict):
                item = {k: v for k, v in item.items() if k != "id"}
            call = as_call(item, names)
            if call is None:
                return None
            calls.append(call)
        return calls or None
    decoder = json.JSONDecoder()
    calls = []
    i = 0
    while i < len(text):
        j = text.find(ARGS, i)
        if j < 0:
            return None
        name = text[i:j].partition(CALL_ID)[0].strip()
        try:
            args, i = decoder.raw_decode(text, _skip_space(text, j + len(ARGS)))
        except ValueError:
            return None
        if name not in names or not isinstance(args, dict):
            return None
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id()))
        i = _skip_space(text, i)
    return calls or None


class Qwen3Coder:
    """Qwen3-Coder: ``<tool_call>`` blocks (or a bare ``<function=…>`` one) holding one function
    and its parameters as XML. ``schemas``: each tool's parameters schema, whose property types
    turn the values into JSON."""

    def __init__(self, names: Iterable[str], schemas: Mapping[str, Any] | None = None) -> None:
        self.names = frozenset(names)
        self.schemas = schemas or {}
        self._buf = ""
        self._close = ""  # inside a block: the text that ends it ("" outside one)
        self._close_from = 0  # where the closer may start: the text before was searched
        self._after_call = False  # only whitespace since the last call (not worth sending)
        self.calls = 0

    def _content(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self._after_call and not text.strip():
            return []
        self._after_call = False
        return [("content", text)]

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._close:
                end = self._buf.find(self._close, self._close_from)
                if end < 0:
                    self._close_from = max(0, len(self._buf) - len(self._close) + 1)
                    return out
                cut = end + len(self._close)
                block, self._buf = self._buf[:cut], self._buf[cut:]
                out += self._block(block)
                continue
            starts = [i for i in (self._buf.find(XML_OPEN), self._buf.find(FUNCTION)) if i >= 0]
            if starts:
                start = min(starts)
                out += self._content(self._buf[:start])
                self._buf = self._buf[start:]
                self._close = XML_CLOSE if self._buf.startswith(XML_OPEN) else FUNCTION_CLOSE
                self._close_from = 0
                continue
            keep = partial_marker(self._buf, XML_OPEN, FUNCTION)
            ready = self._buf[: len(self._buf) - keep]
            if ready.strip() or not self._after_call:
                self._buf = self._buf[len(ready) :]
                out += self._content(ready)
            return out

    def _block(self, block: str) -> list[Piece]:
        """A whole block (or one the generation ended in) as a call, else as content."""
        self._close = ""
        inner = block
        if inner.startswith(XML_OPEN):
            inner = inner[len(XML_OPEN) :]
            if inner.endswith(XML_CLOSE):
                inner = inner[: -len(XML_CLOSE)]
        call = xml_call(inner, self.names, self.schemas)
        if call is None:
            return self._content(block)
        self.calls += 1
        self._after_call = True
        return [("call", call)]

    def finish(self) -> list[Piece]:
        if self._close:
            # Ended inside a block (its end-of-turn token came before the closing tag).
            rest, self._buf = self._buf, ""
            return self._block(rest)
        rest, self._buf = self._buf, ""
        return self._content(rest) if rest.strip() else []


def xml_call(inner: str, names: frozenset[str], schemas: Mapping[str, Any]) -> ToolCall | None:
    """``<function=NAME><parameter=P>VALUE</parameter>…</function>`` as a call, or None when it
    is not one (a name not among ``names``, text outside the parameters)."""
    text = inner.strip()
    if not text.startswith(FUNCTION):
        return None
    gt = text.find(">")
    if gt < 0:
        return None
    name = text[len(FUNCTION) : gt].strip()
    if name not in names:
        return None
    body = text[gt + 1 :]
    end = body.find(FUNCTION_CLOSE)
    if end >= 0:
        if body[end + len(FUNCTION_CLOSE) :].strip():
            return None
        body = body[:end]
    props = _properties(schemas.get(name))
    args: dict[str, Any] = {}
    i = 0
    while True:
        i = _skip_space(body, i)
        if i >= len(body):
            break
        if not body.startswith(PARAMETER, i):
            return None
        gt = body.find(">", i)
        if gt < 0:
            return None
        key = body[i + len(PARAMETER) : gt].strip()
        start = gt + 1
        close = body.find(PARAMETER_CLOSE, start)
        after = body.find(PARAMETER, start)
        if close >= 0 and (after < 0 or close < after):
            value, i = body[start:close], close + len(PARAMETER_CLOSE)
        elif after >= 0:  # a closing tag left out before the next parameter
            value, i = body[start:after], after
        else:
            value, i = body[start:], len(body)
        if not key:
            return None
        args[key] = typed(_unwrapped(value), props.get(key))
    return ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id())


def _properties(schema: Any) -> Mapping[str, Any]:
    if isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
        return schema["properties"]
    return {}


def _unwrapped(value: str) -> str:
    """A parameter's value without the line break the format puts on each side of it."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _type_of(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    if isinstance(t, str):
        return t
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found = _type_of(sub)
            if found is not None and found != "null":
                return found
    return None


def typed(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema types it (number, integer, boolean,
    object, array; ``null`` for any of them); a string otherwise, or when the text is not
    such a value."""
    kind = _type_of(schema)
    if kind in (None, "string"):
        return value
    text = value.strip()
    if text == "null":
        return None
    if kind == "boolean":
        low = text.lower()
        return {"true": True, "false": False}.get(low, value)
    if kind in ("integer", "number"):
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return value
        return number if number == number and abs(number) != float("inf") else value
    if kind in ("object", "array"):
        try:
            return json.loads(text)
        except ValueError:
            return value
    return value
