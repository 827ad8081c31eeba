"""Tools for a model whose chat template takes none (pure: no llama.cpp).

The way llama.cpp's server does it for such a template ("generic" format): the tools are
described in a system message, and a grammar makes the answer one JSON object, either a call

    {"tool_call": {"name": "<one of the tools>", "arguments": {...}}}

(``{"tool_calls": [...]}`` when the request allows parallel calls) or a reply to the user,
``{"response": "..."}``. ``tool_choice: "required"`` (or a named function) leaves only the call
(to that function). ``Reader`` turns the answer back into OpenAI's shape: the reply's text as
content (streamed as it is decoded), or ``tool_calls``.

Such a template cannot render tool calls and tool results either: ``history_as_text`` writes
them into the messages as the same JSON, as text the model can read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from residency.tool_schema import parameters
from workers.toolcalls import Piece, ToolCall, new_call_id

AUTO = "auto"
REQUIRED = "required"
NAMED = "named"


@dataclass(frozen=True)
class Generic:
    """One request's tools in the generic format: the tools' names and parameters schemas (only
    the named one's for ``NAMED``), how the answer may go, and whether a list of calls is
    allowed."""

    names: tuple[str, ...]
    arguments: tuple[dict[str, Any], ...]
    mode: str
    parallel: bool
    param: str  # the request's field the grammar comes from (its errors name it)


def generic(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> Generic:
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        i = [t["function"]["name"] for t in tools].index(name)
        path = f"tools[{i}].function.parameters"
        return Generic((name,), (parameters(tools[i]),), NAMED, parallel, path)
    names = tuple(t["function"]["name"] for t in tools)
    args = tuple(parameters(t) for t in tools)
    return Generic(names, args, REQUIRED if choice == REQUIRED else AUTO, parallel, "tools")


def _call_shape(parallel: bool, name: str) -> str:
    call = f'{{"name": {name}, "arguments": {{<its arguments>}}}}'
    return f'{{"tool_calls": [{call}, ...]}}' if parallel else f'{{"tool_call": {call}}}'


def instructions(tools: list[dict[str, Any]], g: Generic) -> str:
    """The system text that tells the model about the tools and the answer's JSON shape."""
    listed = [
        {
            "name": t["function"]["name"],
            **(
                {"description": t["function"]["description"]}
                if isinstance(t["function"].get("description"), str)
                else {}
            ),
            "parameters": parameters(t),
        }
        for t in tools
        if t["function"]["name"] in g.names
    ]
    lines = [
        "You can call these tools (name, description, JSON schema of the arguments):",
        *(json.dumps(t, ensure_ascii=False) for t in listed),
        "",
    ]
    if g.mode == NAMED:
        shape = _call_shape(g.parallel, json.dumps(g.names[0], ensure_ascii=False))
        lines.append(f"Answer with one JSON object only, calling {g.names[0]}: {shape}")
    elif g.mode == REQUIRED:
        shape = _call_shape(g.parallel, '"<tool name>"')
        lines.append(f"Answer with one JSON object only, calling a tool: {shape}")
    else:
        shape = _call_shape(g.parallel, '"<tool name>"')
        lines.append(
            f"Answer with one JSON object only: {shape} to call a tool, or "
            '{"response": "<your reply>"} to reply to the user'
        )
    return "\n".join(lines)


def with_instructions(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` added to the leading system message (after its own text), or
    in a new first system message when there is none to add it to."""
    if messages and messages[0].get("role") == "system":
        content = messages[0].get("content")
        if isinstance(content, str):
            return [{**messages[0], "content": f"{content}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _object(obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, **obj}


def answer_schema(
    g: Generic, arguments: tuple[dict[str, Any], ...] | None = None
) -> dict[str, Any]:
    """The JSON schema of the answer (``arguments``: the schemas the calls' arguments are held
    to, one per tool; the tools' own by default)."""
    args = g.arguments if arguments is None else arguments
    calls = [
        _object(
            {
                "properties": {"name": {"const": name}, "arguments": a},
                "required": ["name", "arguments"],
            }
        )
        for name, a in zip(g.names, args, strict=True)
    ]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if g.parallel:
        call = _object(
            {
                "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
                "required": ["tool_calls"],
            }
        )
    else:
        call = _object({"properties": {"tool_call": one}, "required": ["tool_call"]})
    if g.mode != AUTO:
        return call
    reply = _object({"properties": {"response": {"type": "string"}}, "required": ["response"]})
    return {"anyOf": [call, reply]}


# --- the history ------------------------------------------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return "" if content is None else json.dumps(content, ensure_ascii=False)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _calls_text(m: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """An assistant message's calls as the JSON the generic format answers, and each call's id
    → its function's name (a tool result names the call it answers by id)."""
    calls: list[Any] = []
    ids: dict[str, str] = {}
    raw = list(m.get("tool_calls") or [])
    if isinstance(m.get("function_call"), dict):
        raw.append({"function": m["function_call"]})
    for tc in raw:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            calls.append(tc)  # not a call's shape: shown as it came
            continue
        calls.append({"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))})
        if isinstance(tc.get("id"), str) and isinstance(fn.get("name"), str):
            ids[tc["id"]] = fn["name"]
    body = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
    return json.dumps(body, ensure_ascii=False), ids


def history_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the assistant's tool calls written into its text, and tool results
    (``role`` ``tool`` or ``function``) as a user message the model reads them in (a run of
    them as one, for templates that want user and assistant turns to alternate)."""
    if not any(
        m.get("role") in ("tool", "function") or m.get("tool_calls") or m.get("function_call")
        for m in messages
    ):
        return messages
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    results: list[str] = []

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results.clear()

    for m in messages:
        role = m.get("role")
        if role in ("tool", "function"):
            name = names.get(str(m.get("tool_call_id")), m.get("name"))
            result: dict[str, Any] = {"content": _text(m.get("content"))}
            if isinstance(name, str):
                result = {"name": name, **result}
            results.append(json.dumps({"tool_response": result}, ensure_ascii=False))
            continue
        flush()
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            text, ids = _calls_text(m)
            names.update(ids)
            before = _text(m.get("content"))
            rest = {k: v for k, v in m.items() if k not in ("tool_calls", "function_call")}
            out.append({**rest, "content": f"{before}\n{text}" if before.strip() else text})
            continue
        out.append(m)
    flush()
    return out


# --- the answer -------------------------------------------------------------------------------

# How a reply starts (the grammar's optional spaces between the tokens): once the text is this
# far, what follows is the reply's string, decoded as it comes.
_REPLY = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class Reader:
    """Reads a generic answer as it is generated (``workers.toolcalls.Reader``): a reply's text
    is handed out as content while it is decoded (an escape is held until it is whole); a call
    is held to the end of the answer, then handed out as calls. An answer that is neither (cut
    short by max_tokens, or not the grammar's) is handed out as content, unchanged, at its
    end."""

    def __init__(self, names: frozenset[str] | set[str] | tuple[str, ...]) -> None:
        self.names = frozenset(names)
        self._buf = ""
        self._reply = False  # inside the reply's string: _buf holds what is not decoded yet
        self._done = False  # the reply's string ended: the rest is the object's end
        self._high = ""  # a \uD800-\uDBFF escape waiting for its low half
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        if self._done:
            return []
        self._buf += text
        if not self._reply:
            m = _REPLY.match(self._buf)
            if m is None:
                return []
            self._reply = True
            self._buf = self._buf[m.end() :]
        return self._decode()

    def _decode(self) -> list[Piece]:
        out: list[str] = []
        buf, i, n = self._buf, 0, len(self._buf)
        while i < n:
            c = buf[i]
            if c == '"':
                self._done = True
                i = n
                break
            if c != "\\":
                out.append(self._flush_high() + c)
                i += 1
                continue
            if i + 1 >= n:
                break
            e = buf[i + 1]
            if e != "u":
                out.append(self._flush_high() + _ESCAPES.get(e, e))
                i += 2
                continue
            if i + 6 > n:
                break
            try:
                code = int(buf[i + 2 : i + 6], 16)
            except ValueError:
                out.append(self._flush_high() + buf[i : i + 6])
                i += 6
                continue
            i += 6
            if 0xD800 <= code < 0xDC00:
                out.append(self._flush_high())
                self._high = chr(code)
            elif 0xDC00 <= code < 0xE000 and self._high:
                high, self._high = ord(self._high), ""
                out.append(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
            else:
                out.append(self._flush_high() + chr(code))
        self._buf = buf[i:]
        text = "".join(out)
        return [("content", text)] if text else []

    def _flush_high(self) -> str:
        high, self._high = self._high, ""
        return high

    def finish(self) -> list[Piece]:
        """The generation ended: decide what is still held."""
        if self._reply:
            rest = self._flush_high()
            return [("content", rest)] if rest else []
        text, self._buf = self._buf, ""
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        calls = self._calls(obj)
        if calls:
            self.calls += len(calls)
            return [("call", c) for c in calls]
        if isinstance(obj, dict) and set(obj) == {"response"} and isinstance(obj["response"], str):
            return [("content", obj["response"])] if obj["response"] else []
        return [("content", text)] if text else []

    def _calls(self, obj: Any) -> list[ToolCall]:
        if not isinstance(obj, dict) or len(obj) != 1:
            return []
        if isinstance(obj.get("tool_call"), dict):
            raw = [obj["tool_call"]]
        elif isinstance(obj.get("tool_calls"), list) and obj["tool_calls"]:
            raw = obj["tool_calls"]
        else:
            return []
        calls = []
        for c in raw:
            if not isinstance(c, dict) or set(c) != {"name", "arguments"}:
                return []
            if c["name"] not in self.names or not isinstance(c["arguments"], dict):
                return []
            args = json.dumps(c["arguments"], ensure_ascii=False)
            calls.append(ToolCall(c["name"], args, new_call_id()))
        return calls
