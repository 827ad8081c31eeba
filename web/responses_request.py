"""A Responses API request (``POST /v1/responses``) translated to a chat completions body: pure
functions, no Flask and no Redis.

The box serves the Responses API on the chat pipeline (same queues, policies, limits, quotas
and usage): ``to_chat`` checks the Responses fields, naming the bad one in a 400 as the client
sent it (``input[2].call_id``, ``text.format.schema``), and returns the chat body that
``web.validation.validate_chat`` then takes, plus the parameters the answer repeats.

The server is stateless: nothing is stored, so ``previous_response_id`` and ``conversation``
are refused (the client sends the whole conversation in ``input``). Fields that change nothing
here are accepted and ignored, and named in ``Translated.ignored`` (the answer's
``x-residency-ignored`` header): ``client_metadata``, ``include`` (nothing it names exists
here: no encrypted reasoning, no hosted tool results), ``reasoning`` options but ``effort``
(which becomes chat's ``reasoning_effort``; a reasoning model's text is shown whole, never
summarized) and hosted tools (web search, file search...; this box runs none: they are
dropped, unless ``tool_choice`` names one, which is a 400). Any other unknown top-level field
is refused, so a client learns that a feature it relies on is not there. Inside ``input``
items, keys that only describe an earlier answer (``id``, ``status``, ``annotations``...) are
ignored, so a client can send a response's ``output`` items back as they came; a ``reasoning``
item becomes the ``reasoning_content`` of the assistant turn it came before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from residency.errors import ApiError, bad_request
from web import validation
from web.validation import wrong_type

NOT_STORED = (
    "this server does not store responses; send the whole conversation in `input` "
    "(earlier messages, function_call and function_call_output items)"
)

#: Fields accepted and used (or, for the bookkeeping ones, accepted and repeated in the answer).
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "store",
        "previous_response_id",
        "conversation",
        "reasoning",
        "include",
        "truncation",
        "background",
        "service_tier",
        "client_metadata",
    }
)
#: Top-level fields accepted and ignored: they change nothing this server does.
IGNORED_FIELDS = frozenset({"client_metadata"})
ROLES = ("user", "assistant", "system", "developer")
#: What ``reasoning.effort`` may ask for: chat's ``reasoning_effort`` values.
EFFORTS = validation.REASONING_EFFORTS
MAX_METADATA = 16


@dataclass(frozen=True)
class Translated:
    """``chat``: the chat completions body; ``echo``: the request's parameters as a Response
    object repeats them; ``stream``: whether the client asked for a stream; ``ignored``: the
    fields accepted and ignored."""

    chat: dict[str, Any]
    echo: dict[str, Any]
    stream: bool
    ignored: tuple[str, ...] = ()


def _unsupported(param: str, what: str) -> ApiError:
    return bad_request(f"'{param}': {what}", param, "unsupported")


def _string(obj: Mapping[str, Any], key: str, param: str, *, required: bool = True) -> str | None:
    v = obj.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str):
        if v is None:
            raise bad_request(f"'{param}' is required", param, "missing_required")
        raise wrong_type(param, "a string", v)
    return v


def _check_fields(body: Mapping[str, Any]) -> None:
    unknown = sorted(k for k in body if k not in FIELDS)
    if unknown:
        raise bad_request(
            f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
            "not supported by this server's Responses API",
            unknown[0],
            "unknown_parameter",
        )


def _stateless(body: Mapping[str, Any]) -> None:
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise bad_request(NOT_STORED, key, "unsupported")
    if body.get("background") not in (None, False):
        raise _unsupported("background", "background responses need storage; send false")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise wrong_type("store", "a boolean", store)


def _effort(body: Mapping[str, Any], ignored: list[str]) -> str | None:
    """``reasoning.effort`` (None: not asked for). The other ``reasoning`` options change
    nothing here (a model's reasoning is shown whole, never summarized): named in
    ``ignored``."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise wrong_type("reasoning", "an object", reasoning)
    ignored += [f"reasoning.{k}" for k, v in reasoning.items() if v is not None and k != "effort"]
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad_request(
            f"'reasoning.effort' must be one of {', '.join(EFFORTS)}, got {str(effort)[:64]!r}",
            "reasoning.effort",
            "invalid_value",
        )
    return str(effort)


def _refused_options(body: Mapping[str, Any], ignored: list[str]) -> None:
    """Options with no meaning for the models served here: ignored (and named in ``ignored``)
    when they change nothing, else empty is fine and anything else 400."""
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
            raise wrong_type("include", "an array of strings", include)
        # What it names (encrypted reasoning, hosted tool results...) never exists here.
        if include:
            ignored.append("include")
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", "only 'disabled' is supported (nothing is truncated)")
    for key in ("user", "safety_identifier", "prompt_cache_key", "service_tier"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise wrong_type(key, "a string", body[key])
    opts = body.get("stream_options")
    if opts is not None:
        # include_obfuscation pads events against length side channels; nothing to pad here.
        if not isinstance(opts, dict):
            raise wrong_type("stream_options", "an object", opts)
        if set(opts) - {"include_obfuscation"}:
            raise _unsupported("stream_options", "only 'include_obfuscation' is accepted")


def _metadata(body: Mapping[str, Any]) -> dict[str, str]:
    md = body.get("metadata")
    if md is None:
        return {}
    if not isinstance(md, dict):
        raise wrong_type("metadata", "an object of strings", md)
    if len(md) > MAX_METADATA:
        raise bad_request(
            f"'metadata' may hold at most {MAX_METADATA} pairs, got {len(md)}", "metadata"
        )
    for k, v in md.items():
        if not isinstance(v, str):
            raise wrong_type(f"metadata.{k[:64]}", "a string", v)
    return dict(md)


# --- input ------------------------------------------------------------------------------------


def _part(part: Any, param: str, role: str) -> dict[str, Any]:
    """A Responses content part as a chat content part."""
    if not isinstance(part, dict):
        raise wrong_type(param, "an object", part)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _string(part, "text", f"{param}.text")}
    if kind == "refusal" and role == "assistant":
        return {"type": "text", "text": _string(part, "refusal", f"{param}.refusal")}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise _unsupported(
                f"{param}.image_url", "images are taken as a URL or data URL in 'image_url'"
            )
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(
        f"'{param}.type' must be 'input_text', 'output_text' or 'input_image', got {kind!r}"
        " (files and audio are not supported)",
        f"{param}.type",
    )


def _content(content: Any, param: str, role: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(param, "a string or an array of content parts", content)
    if not content:
        raise bad_request(f"'{param}' must not be an empty array", param)
    if len(content) > validation.MAX_CONTENT_PARTS:
        raise bad_request(
            f"'{param}' may hold at most {validation.MAX_CONTENT_PARTS} parts, got {len(content)}",
            param,
            "array_above_max_length",
        )
    return [_part(p, f"{param}[{j}]", role) for j, p in enumerate(content)]


def _tool_output(item: Mapping[str, Any], param: str) -> str:
    out = item.get("output")
    if isinstance(out, str):
        return out
    if not isinstance(out, list):
        raise wrong_type(param, "a string or an array of input_text parts", out)
    texts = []
    for j, part in enumerate(out):
        p = _part(part, f"{param}[{j}]", "tool")
        if p["type"] != "text":
            raise _unsupported(f"{param}[{j}]", "a function call's output must be text")
        texts.append(p["text"])
    return "\n".join(texts)


def _reasoning_text(item: Mapping[str, Any], p: str) -> str:
    """The text of a ``reasoning`` item: its ``reasoning_text`` parts, else its summary."""
    texts: list[str] = []
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise wrong_type(f"{p}.{key}", f"an array of {part_type} parts", parts)
        if len(parts) > validation.MAX_CONTENT_PARTS:
            raise bad_request(
                f"'{p}.{key}' may hold at most {validation.MAX_CONTENT_PARTS} parts, "
                f"got {len(parts)}",
                f"{p}.{key}",
                "array_above_max_length",
            )
        for j, part in enumerate(parts):
            pp = f"{p}.{key}[{j}]"
            if not isinstance(part, dict):
                raise wrong_type(pp, "an object", part)
            if part.get("type") != part_type:
                raise bad_request(
                    f"'{pp}.type' must be '{part_type}', got {part.get('type')!r}", f"{pp}.type"
                )
            texts.append(str(_string(part, "text", f"{pp}.text")))
        if texts:
            break  # the reasoning itself when it is there; its summary otherwise
    return "\n".join(texts)


class _Conversation:
    """Chat messages built item by item: consecutive function calls become one assistant
    message's ``tool_calls`` (attached to the assistant text just before them, as one turn).
    A ``reasoning`` item waits for the assistant turn that follows it (a message or a call) and
    becomes its ``reasoning_content``; one that no assistant turn follows (a user turn comes
    first, or the input ends) is dropped: the model reads its earlier reasoning only beside
    what it answered."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.call_ids: set[str] = set()
        self._open_turn = False  # the last message is an assistant turn calls may join
        self._thoughts: list[str] = []  # reasoning items waiting for their assistant turn

    def reasoning(self, item: Mapping[str, Any], p: str) -> None:
        text = _reasoning_text(item, p)
        if text:
            self._thoughts.append(text)

    def _give_reasoning(self, message: dict[str, Any]) -> None:
        if self._thoughts:
            had = message.get("reasoning_content")
            message["reasoning_content"] = "\n".join([*([had] if had else []), *self._thoughts])
            self._thoughts = []

    def message(self, item: Mapping[str, Any], p: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(
                f"'{p}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{p}.role"
            )
        if item.get("content") is None:
            raise bad_request(f"'{p}.content' is required", f"{p}.content", "missing_required")
        content = _content(item["content"], f"{p}.content", role)
        self.messages.append({"role": role, "content": content})
        self._open_turn = role == "assistant"
        if self._open_turn:
            self._give_reasoning(self.messages[-1])
        else:
            self._thoughts = []

    def call(self, item: Mapping[str, Any], p: str) -> None:
        call_id = _string(item, "call_id", f"{p}.call_id")
        assert call_id is not None
        if not call_id:
            raise bad_request(f"'{p}.call_id' must not be empty", f"{p}.call_id")
        name = _string(item, "name", f"{p}.name")
        args = _string(item, "arguments", f"{p}.arguments")
        self.call_ids.add(call_id)
        tc = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        if not self._open_turn:
            self.messages.append({"role": "assistant", "content": None})
            self._open_turn = True
        self.messages[-1].setdefault("tool_calls", []).append(tc)
        self._give_reasoning(self.messages[-1])

    def output(self, item: Mapping[str, Any], p: str) -> None:
        call_id = _string(item, "call_id", f"{p}.call_id")
        if call_id not in self.call_ids:
            raise bad_request(
                f"'{p}.call_id' {call_id!r} answers no function_call item before it in 'input'",
                f"{p}.call_id",
            )
        content = _tool_output(item, f"{p}.output")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        self._open_turn = False
        self._thoughts = []


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    conv = _Conversation()
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise wrong_type("instructions", "a string", instructions)
        conv.messages.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if inp is None:
        raise bad_request("'input' is required", "input", "missing_required")
    if isinstance(inp, str):
        conv.messages.append({"role": "user", "content": inp})
        return conv.messages
    if not isinstance(inp, list):
        raise wrong_type("input", "a string or an array of input items", inp)
    if not inp:
        raise bad_request("'input' must hold at least one item", "input")
    if len(inp) > validation.MAX_MESSAGES:
        raise bad_request(
            f"'input' may hold at most {validation.MAX_MESSAGES} items, got {len(inp)}",
            "input",
            "array_above_max_length",
        )
    for i, item in enumerate(inp):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(p, "an object", item)
        kind = item.get("type", "message")  # a message may leave out its type
        if kind == "message":
            conv.message(item, p)
        elif kind == "function_call":
            conv.call(item, p)
        elif kind == "function_call_output":
            conv.output(item, p)
        elif kind == "reasoning":
            conv.reasoning(item, p)
        elif kind == "item_reference":
            raise bad_request(NOT_STORED, f"{p}.type", "unsupported")
        else:
            raise bad_request(
                f"'{p}.type' {kind!r} is not supported: input items may be messages, "
                "function_call, function_call_output and reasoning",
                f"{p}.type",
                "unsupported",
            )
    return conv.messages


# --- tools ------------------------------------------------------------------------------------


def _tools(body: Mapping[str, Any], ignored: list[str]) -> list[dict[str, Any]]:
    """The function tools, in the Responses form (as the answer repeats them). Hosted tools
    (any other type) are dropped and named in ``ignored``: this box runs none, and a model may
    answer without them (``_tool_choice`` refuses a request that names one)."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise wrong_type("tools", "an array", tools)
    if len(tools) > validation.MAX_TOOLS:
        raise bad_request(
            f"'tools' may hold at most {validation.MAX_TOOLS} items, got {len(tools)}",
            "tools",
            "array_above_max_length",
        )
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise wrong_type(p, "an object", t)
        kind = t.get("type")
        if not isinstance(kind, str):
            raise wrong_type(f"{p}.type", "a string", kind)
        if kind != "function":
            ignored.append(f"{p} ({kind})")
            continue
        name = _string(t, "name", f"{p}.name")
        if any(o["name"] == name for o in out):
            raise bad_request(f"'{p}.name' {name!r} is given twice", f"{p}.name")
        tool: dict[str, Any] = {"type": "function", "name": name}
        desc = _string(t, "description", f"{p}.description", required=False)
        tool["description"] = desc
        params = t.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise wrong_type(f"{p}.parameters", "an object", params)
            validation.check_schema(f"{p}.parameters", params)
        tool["parameters"] = params
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise wrong_type(f"{p}.strict", "a boolean", strict)
        tool["strict"] = strict
        out.append(tool)
    return out


def _chat_tool(t: Mapping[str, Any]) -> dict[str, Any]:
    fn = {"name": t["name"]}
    for key in ("description", "parameters"):
        if t.get(key) is not None:
            fn[key] = t[key]
    return {"type": "function", "function": fn}


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]]) -> Any:
    """The tool_choice in its Responses form (None: not given). A forced call's parameters are
    checked here against what the grammar enforces, so the error names ``tools[i]``."""
    choice = body.get("tool_choice")
    if choice is None:
        return None
    names = [t["name"] for t in tools]
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(
                f"'tool_choice' must be 'auto', 'none', 'required' or an object, got {choice!r}",
                "tool_choice",
            )
        if choice == "required":
            if not tools:
                raise bad_request("'tool_choice' 'required' needs 'tools'", "tool_choice")
            for i, t in enumerate(tools):
                _enforceable(i, t)
        return choice
    if not isinstance(choice, dict):
        raise wrong_type("tool_choice", "a string or an object", choice)
    kind = choice.get("type")
    if kind != "function":
        raise bad_request(
            f"'tool_choice.type' {kind!r} is not supported: this server runs only function "
            "tools (no hosted tools such as web_search or file_search); name a function tool "
            "as {'type': 'function', 'name': ...}",
            "tool_choice.type",
            "unsupported_tool",
        )
    name = _string(choice, "name", "tool_choice.name")
    if name not in names:
        raise bad_request(
            f"'tool_choice.name' {name!r} is not among the function tools in 'tools'",
            "tool_choice.name",
        )
    i = names.index(name)
    _enforceable(i, tools[i])
    return {"type": "function", "name": name}


def _enforceable(i: int, tool: Mapping[str, Any]) -> None:
    if tool.get("parameters") is not None:
        validation.check_enforceable(f"tools[{i}].parameters", tool["parameters"])


def _chat_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# --- text.format ------------------------------------------------------------------------------


def _text(body: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The text config as the answer repeats it, and the chat ``response_format`` (None for
    plain text)."""
    text = body.get("text")
    if text is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(text, dict):
        raise wrong_type("text", "an object", text)
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise bad_request(f"unknown field 'text.{extra[0]}'", f"text.{extra[0]}")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise bad_request("'text.verbosity' must be 'low', 'medium' or 'high'", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return {**text, "format": {"type": "text"}}, None
    if not isinstance(fmt, dict):
        raise wrong_type("text.format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return dict(text), None
    if kind == "json_object":
        return dict(text), {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise wrong_type("text.format.schema", "an object", schema)
        name = _string(fmt, "name", "text.format.name")
        for key in ("strict", "description"):
            want = "a boolean" if key == "strict" else "a string"
            v = fmt.get(key)
            if v is not None and not isinstance(v, bool if key == "strict" else str):
                raise wrong_type(f"text.format.{key}", want, v)
        validation.check_schema("text.format.schema", schema)
        validation.check_enforceable("text.format.schema", schema)
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        return dict(text), rf
    raise bad_request(
        f"'text.format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "text.format.type",
    )


# --- the whole request ------------------------------------------------------------------------


def _stream(body: Mapping[str, Any]) -> bool:
    s = body.get("stream")
    if s is None:
        return False
    if not isinstance(s, bool):
        raise wrong_type("stream", "a boolean", s)
    return s


def to_chat(body: Mapping[str, Any]) -> Translated:
    """The chat completions body for a Responses request, or a 400 naming the bad field."""
    ignored: list[str] = [k for k in sorted(IGNORED_FIELDS) if k in body]
    _check_fields(body)
    _stateless(body)
    effort = _effort(body, ignored)
    _refused_options(body, ignored)
    model = body.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", "model", "missing_required")
    metadata = _metadata(body)
    messages = _messages(body)
    tools = _tools(body, ignored)
    choice = _tool_choice(body, tools)
    text, response_format = _text(body)
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise wrong_type("parallel_tool_calls", "a boolean", ptc)
    stream = _stream(body)

    chat: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    if stream:
        # The last chat chunk then carries the usage the final event reports.
        chat["stream_options"] = {"include_usage": True}
    if tools:
        chat["tools"] = [_chat_tool(t) for t in tools]
    if choice is not None and tools:
        chat["tool_choice"] = _chat_choice(choice)
    if ptc is not None and tools:
        chat["parallel_tool_calls"] = ptc
    if response_format is not None:
        chat["response_format"] = response_format
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if effort is not None:
        chat["reasoning_effort"] = effort
    mot = body.get("max_output_tokens")
    if mot is not None:
        if isinstance(mot, bool) or not isinstance(mot, int):
            raise wrong_type("max_output_tokens", "an integer", mot)
        if not 1 <= mot <= validation.MAX_INT32:
            raise bad_request(
                f"'max_output_tokens' must be between 1 and {validation.MAX_INT32}, got {mot}",
                "max_output_tokens",
                "invalid_value",
            )
        chat["max_tokens"] = mot

    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": mot,
        "metadata": metadata,
        "parallel_tool_calls": True if ptc is None else ptc,
        "previous_response_id": None,
        "reasoning": None if effort is None else {"effort": effort, "summary": None},
        "store": False,  # whatever was asked: nothing is stored
        "temperature": body.get("temperature"),
        "text": text,
        "tool_choice": "auto" if choice is None else choice,
        "tools": tools,
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return Translated(chat, echo, stream, tuple(ignored))
