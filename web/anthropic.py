"""The Anthropic Messages API as a translation of chat completions (pure: no Flask, no Redis).

A Messages request becomes a chat completions body (``to_chat``), which then goes the way of
every chat request: validation, resolution, scopes, quotas, queues, policies and limits. Its
answer comes back in Anthropic's shapes: a whole chat response as a message (``to_message``),
a stream of chat chunks as Anthropic's events (``StreamEvents``), an ``ApiError`` in Anthropic's
error envelope (``error_body``).

A user turn's ``image`` blocks become chat ``image_url`` parts (a base64 source as a data
URL), so an image meets the same rule as in chat: a model that cannot see refuses it with 400
naming the model (``residency.vision``). ``thinking`` becomes chat's ``reasoning_effort``
(``thinking_effort``), an assistant turn's ``thinking`` blocks its ``reasoning_content``, and
the answer's ``reasoning_content`` a ``thinking`` block before its text (with an empty
``signature``: nothing here signs, and a block sent back is taken as it comes). What has no
counterpart here is refused with a 400 naming the field (documents, images inside tool results
or assistant turns, server tools, unknown top-level fields); ``metadata`` is accepted and
ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from residency.errors import ApiError, bad_request
from web.validation import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, wrong_type

#: Top-level fields accepted and ignored: they change nothing this box does. There is one
#: service tier, and a conversation is never edited on the server (``context_management``
#: clears old tool results only past thresholds this box does not keep; the client's whole
#: conversation reaches the model).
IGNORED_FIELDS = frozenset({"context_management", "service_tier"})
#: Top-level fields of POST /v1/messages; anything else is refused by name.
MESSAGE_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
        "metadata",
        "output_config",
        "thinking",
        *IGNORED_FIELDS,
    }
)
#: Top-level fields of POST /v1/messages/count_tokens (``thinking`` too: a template may render
#: a prompt that asks for no reasoning differently).
COUNT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "output_config",
        "thinking",
        *IGNORED_FIELDS,
    }
)
#: ``thinking.type`` values; "adaptive" and "between_tools" leave the effort to the model.
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
#: Anthropic's least ``thinking.budget_tokens``.
MIN_THINKING_BUDGET = 1024
#: ``budget_tokens`` below each bound asks for that ``reasoning_effort``; from the last bound
#: on, "high".
THINKING_EFFORTS = ((4096, "low"), (16384, "medium"))
#: ``output_config`` keys accepted and ignored (no model here has an effort setting).
IGNORED_OUTPUT_CONFIG = frozenset({"effort"})

_TOOL_CHOICES = ("auto", "any", "tool", "none")
#: Content blocks that need a model that sees more than text.
_MEDIA = ("image", "document")

# Anthropic's error types by HTTP status (their API's own pairs); anything else is api_error.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def _unknown(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    extra = sorted(k for k in body if k not in allowed)
    if extra:
        others = f" (nor {', '.join(extra[1:])})" if len(extra) > 1 else ""
        raise bad_request(
            f"{extra[0]}: Extra inputs are not permitted{others}; this endpoint takes "
            + ", ".join(sorted(allowed)),
            extra[0],
            "unknown_field",
        )


# --- request ----------------------------------------------------------------------------------


def to_chat(
    body: Mapping[str, Any], *, count: bool = False, ignored: list[str] | None = None
) -> dict[str, Any]:
    """The chat completions body a Messages request (``count``: a count_tokens request)
    stands for. Checks what is Anthropic's own (roles, blocks, tools, tool_choice); the chat
    validation checks the rest (numbers, limits, schemas) on the result. The fields accepted
    and ignored are appended to ``ignored``."""
    _unknown(body, COUNT_FIELDS if count else MESSAGE_FIELDS)
    if ignored is None:
        ignored = []
    ignored += [k for k in sorted(IGNORED_FIELDS) if k in body]
    chat: dict[str, Any] = {"model": body.get("model")}
    if not count:
        if body.get("max_tokens") is None:
            raise bad_request("'max_tokens' is required", "max_tokens", "missing_required")
        chat["max_tokens"] = body["max_tokens"]
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("'messages' is required", "messages", "missing_required")
    if not isinstance(msgs, list):
        raise wrong_type("messages", "an array", msgs)
    if not msgs:
        raise bad_request("'messages' must hold at least one message", "messages")
    if len(msgs) > MAX_MESSAGES:
        raise bad_request(
            f"'messages' may hold at most {MAX_MESSAGES} items, got {len(msgs)}",
            "messages",
            "array_above_max_length",
        )
    out = _system(body.get("system"))
    for i, m in enumerate(msgs):
        out += _message(i, m)
    chat["messages"] = out
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise wrong_type("stop_sequences", "an array of strings", stops)
        if stops:
            chat["stop"] = stops
    stream = body.get("stream")
    if stream is not None:
        if not isinstance(stream, bool):
            raise wrong_type("stream", "a boolean", stream)
        chat["stream"] = stream
        if stream:
            # Anthropic's last event carries the usage: ask for OpenAI's usage chunk.
            chat["stream_options"] = {"include_usage": True}
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise wrong_type("metadata", "an object", meta)
    fmt = _output_config(body.get("output_config"), ignored)
    if fmt is not None:
        chat["response_format"] = fmt
    effort = thinking_effort(body.get("thinking"), ignored)
    if effort is not None:
        chat["reasoning_effort"] = effort
    tools = body.get("tools")
    server_tools: dict[str, str] = {}
    if tools is not None:
        chat["tools"] = _tools(tools, server_tools, ignored)
        if not chat["tools"]:
            del chat["tools"]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice, server_tools)
        if "tools" not in chat and chat["tool_choice"] in ("auto", "none"):
            del chat["tool_choice"]  # every tool was a server tool, dropped
    return chat


def _output_config(config: Any, ignored: list[str]) -> dict[str, Any] | None:
    """``output_config``: its ``format`` (structured output: a JSON schema the answer follows)
    as the chat ``response_format``; ``effort`` ignored; anything else refused by name."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise wrong_type("output_config", "an object", config)
    for k in sorted(config):
        if k in IGNORED_OUTPUT_CONFIG:
            ignored.append(f"output_config.{k}")
        elif k != "format":
            raise bad_request(
                f"unknown field 'output_config.{k}'; output_config takes format and effort",
                f"output_config.{k}",
                "unknown_field",
            )
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise wrong_type("output_config.format", "an object", fmt)
    if fmt.get("type") != "json_schema":
        raise bad_request(
            f"'output_config.format.type' must be 'json_schema', got {fmt.get('type')!r}",
            "output_config.format.type",
        )
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise wrong_type("output_config.format.schema", "an object", schema)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def thinking_effort(thinking: Any, ignored: list[str]) -> str | None:
    """``thinking`` as chat's ``reasoning_effort``: enabled with a budget asks for "low",
    "medium" or "high" by its size, disabled for "none"; adaptive (or none given) asks for
    nothing, so the model reasons as it would. ``display`` is accepted and ignored: reasoning
    is always shown."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise wrong_type("thinking", "an object", thinking)
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise bad_request(
            f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}, got {kind!r}",
            "thinking.type",
        )
    allowed = {"type", "display"} | ({"budget_tokens"} if kind == "enabled" else set())
    for k in sorted(thinking):
        if k not in allowed:
            raise bad_request(
                f"thinking.{k}: Extra inputs are not permitted", f"thinking.{k}", "unknown_field"
            )
    if thinking.get("display") is not None:
        ignored.append("thinking.display")
    if kind == "disabled":
        return "none"
    if kind != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise wrong_type("thinking.budget_tokens", "an integer", budget)
    if budget < MIN_THINKING_BUDGET:
        raise bad_request(
            f"'thinking.budget_tokens' must be at least {MIN_THINKING_BUDGET}, got {budget}",
            "thinking.budget_tokens",
            "invalid_value",
        )
    return next((effort for bound, effort in THINKING_EFFORTS if budget < bound), "high")


def _text(block: Mapping[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise wrong_type(f"{param}.text", "a string", text)
    return text


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """``content`` as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise wrong_type(param, "a string or an array of content blocks", content)
    if not content:
        raise bad_request(f"'{param}' must not be an empty array", param)
    if len(content) > MAX_CONTENT_PARTS:
        raise bad_request(
            f"'{param}' may hold at most {MAX_CONTENT_PARTS} items, got {len(content)}",
            param,
            "array_above_max_length",
        )
    for j, b in enumerate(content):
        if not isinstance(b, dict):
            raise wrong_type(f"{param}[{j}]", "an object", b)
    return content


def _no_media(kind: Any, param: str) -> None:
    if kind in _MEDIA:
        where = "" if kind == "document" else " here (images are taken in a user turn's content)"
        raise bad_request(
            f"'{param}' is an {kind} block; {kind}s are not taken{where}",
            f"{param}.type",
            "unsupported",
        )


def _system(system: Any, param: str = "system") -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    texts = []
    for j, b in enumerate(_blocks(system, param)):
        if b.get("type") != "text":
            raise bad_request(
                f"'{param}[{j}].type' must be 'text', got {b.get('type')!r}",
                f"{param}[{j}].type",
            )
        texts.append(_text(b, f"{param}[{j}]"))
    return [{"role": "system", "content": "\n".join(texts)}]


def _message(i: int, m: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's ``tool_result`` blocks become
    ``tool`` messages (in their place among its text), an assistant turn's ``tool_use``
    blocks its ``tool_calls``."""
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise wrong_type(p, "an object", m)
    role = m.get("role")
    if role not in ("user", "assistant", "system"):
        raise bad_request(
            f"'{p}.role' must be 'user', 'assistant' or 'system', got {role!r}", f"{p}.role"
        )
    if m.get("content") is None:
        raise bad_request(f"'{p}.content' is required", f"{p}.content", "missing_required")
    if role == "system":
        # Claude Code sends instructions mid-conversation this way; the model process places
        # a system message as the model's template allows.
        return _system(m["content"], f"{p}.content")
    blocks = _blocks(m["content"], f"{p}.content")
    if role == "assistant":
        return [_assistant(blocks, f"{p}.content")]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # text and image parts of the user turn being read
    for j, b in enumerate(blocks):
        bp = f"{p}.content[{j}]"
        kind = b.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text(b, bp)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b, bp)}})
        elif kind == "tool_result":
            if parts:
                out.append(_user(parts))
                parts = []
            out.append(_tool_result(b, bp))
        else:
            _no_media(kind, bp)
            raise bad_request(
                f"'{bp}.type' must be 'text', 'image' or 'tool_result' in a user message, got "
                f"{kind!r}",
                f"{bp}.type",
            )
    if parts:
        out.append(_user(parts))
    return out


def _user(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat user turn: its text as one string when it holds no image (what chat templates
    expect), else its parts in order."""
    if all(p["type"] == "text" for p in parts):
        return {"role": "user", "content": "\n".join(p["text"] for p in parts)}
    return {"role": "user", "content": parts}


def _image_url(b: Mapping[str, Any], bp: str) -> str:
    """An image block's source as chat's ``image_url``: a URL, or base64 data as a data URL."""
    src = b.get("source")
    if not isinstance(src, dict):
        raise wrong_type(f"{bp}.source", "an object", src)
    kind = src.get("type")
    if kind == "url":
        if not isinstance(src.get("url"), str):
            raise wrong_type(f"{bp}.source.url", "a string", src.get("url"))
        return str(src["url"])
    if kind == "base64":
        for key in ("media_type", "data"):
            if not isinstance(src.get(key), str):
                raise wrong_type(f"{bp}.source.{key}", "a string", src.get(key))
        return f"data:{src['media_type']};base64,{src['data']}"
    raise bad_request(
        f"'{bp}.source.type' must be 'base64' or 'url', got {kind!r}", f"{bp}.source.type"
    )


def _tool_result(b: Mapping[str, Any], bp: str) -> dict[str, Any]:
    call_id = b.get("tool_use_id")
    if not isinstance(call_id, str):
        raise wrong_type(f"{bp}.tool_use_id", "a string", call_id)
    content = b.get("content")
    texts: list[str] = []
    if content is not None:
        for k, part in enumerate(_blocks(content, f"{bp}.content")):
            kp = f"{bp}.content[{k}]"
            _no_media(part.get("type"), kp)
            if part.get("type") == "tool_reference":
                texts.append(_tool_reference(part, kp))
                continue
            if part.get("type") != "text":
                raise bad_request(
                    f"'{kp}.type' must be 'text' or 'tool_reference', got {part.get('type')!r}",
                    f"{kp}.type",
                )
            texts.append(_text(part, kp))
    is_error = b.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise wrong_type(f"{bp}.is_error", "a boolean", is_error)
    text = "\n".join(texts)
    # Chat templates have no field for a failed call: the model reads it in the text.
    if is_error:
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_reference(part: Mapping[str, Any], param: str) -> str:
    """A ``tool_reference`` block (what a tool-search tool answers, Claude Code's ToolSearch
    among them): it names a tool the model may now call. Every tool the request sends is
    offered to the model already (``defer_loading`` changes nothing here), so the model reads
    the reference as text."""
    name = part.get("tool_name")
    if not isinstance(name, str) or not name:
        raise wrong_type(f"{param}.tool_name", "a non-empty string", name)
    return f"Tool available: {name}"


def _assistant(blocks: list[dict[str, Any]], param: str) -> dict[str, Any]:
    """An assistant turn: its text as the content, its ``tool_use`` blocks as tool calls, its
    ``thinking`` blocks as ``reasoning_content``. A ``redacted_thinking`` block is dropped:
    its data is another service's encrypted reasoning, which no model here can read."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        bp = f"{param}[{j}]"
        kind = b.get("type")
        _no_media(kind, bp)
        if kind == "text":
            texts.append(_text(b, bp))
        elif kind == "thinking":
            thought = b.get("thinking")
            if not isinstance(thought, str):
                raise wrong_type(f"{bp}.thinking", "a string", thought)
            thoughts.append(thought)
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            for key in ("id", "name"):
                if not isinstance(b.get(key), str):
                    raise wrong_type(f"{bp}.{key}", "a string", b.get(key))
            args = b.get("input")
            if not isinstance(args, dict):
                raise wrong_type(f"{bp}.input", "an object", args)
            calls.append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(args)},
                }
            )
        else:
            raise bad_request(
                f"'{bp}.type' must be 'text', 'tool_use', 'thinking' or 'redacted_thinking' in "
                f"an assistant message, got {kind!r}",
                f"{bp}.type",
            )
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        out["tool_calls"] = calls
    elif out["content"] is None:
        out["content"] = ""
    if thoughts:
        out["reasoning_content"] = "\n".join(thoughts)
    return out


def _tools(tools: Any, server_tools: dict[str, str], ignored: list[str]) -> list[dict[str, Any]]:
    """The client tools as chat tools. Server tools (any other ``type``: web search, code
    execution...) are dropped and named in ``ignored`` and ``server_tools`` (name -> type):
    this box runs none, and a model may answer without them (``_tool_choice`` refuses a
    request that names one)."""
    if not isinstance(tools, list):
        raise wrong_type("tools", "an array", tools)
    if len(tools) > MAX_TOOLS:
        raise bad_request(
            f"'tools' may hold at most {MAX_TOOLS} items, got {len(tools)}",
            "tools",
            "array_above_max_length",
        )
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise wrong_type(p, "an object", t)
        kind = t.get("type")
        if kind not in (None, "custom"):
            if not isinstance(kind, str):
                raise wrong_type(f"{p}.type", "a string", kind)
            server_tools[str(t.get("name") or kind)] = kind
            ignored.append(f"{p} ({kind})")
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise wrong_type(f"{p}.name", "a non-empty string", t.get("name"))
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise wrong_type(f"{p}.input_schema", "an object", schema)
        fn: dict[str, Any] = {"name": t["name"], "parameters": schema}
        desc = t.get("description")
        if desc is not None:
            if not isinstance(desc, str):
                raise wrong_type(f"{p}.description", "a string", desc)
            fn["description"] = desc
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, server_tools: Mapping[str, str]) -> Any:
    if not isinstance(choice, dict):
        raise wrong_type("tool_choice", "an object", choice)
    kind = choice.get("type")
    if kind not in _TOOL_CHOICES:
        raise bad_request(
            f"'tool_choice.type' must be one of {', '.join(_TOOL_CHOICES)}, got {kind!r}",
            "tool_choice.type",
        )
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise wrong_type("tool_choice.name", "a string", choice.get("name"))
        if choice["name"] in server_tools:
            raise bad_request(
                f"'tool_choice.name' {choice['name']!r} is a server tool "
                f"({server_tools[choice['name']]}): server tools are not run on this box",
                "tool_choice.name",
                "unsupported_tool",
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def renamed(e: ApiError) -> ApiError:
    """An error of the chat validation, naming the Messages field it came from."""
    param = e.param
    message = e.message
    if param is not None and (param == "stop" or param.startswith("stop[")):
        new = "stop_sequences" + param[len("stop") :]
        message, param = message.replace(f"'{param}'", f"'{new}'"), new
    elif param is not None and param.startswith("tools[") and ".function.parameters" in param:
        new = param.replace(".function.parameters", ".input_schema")
        message, param = message.replace(param, new), new
    elif param == "tool_choice":
        message = message.replace("'tool_choice.function.name'", "'tool_choice.name'")
    return ApiError(
        e.status, message, type=e.type, param=param, code=e.code, retry_after=e.retry_after
    )


# --- response ---------------------------------------------------------------------------------


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str | None) -> str:
    """Anthropic's form of a call id (``toolu_``); ids are opaque, so one sent back in a
    ``tool_result`` needs no translation."""
    if not call_id:
        return f"toolu_{uuid.uuid4().hex[:24]}"
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        got = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def stop_reason(finish: str | None, stop_sequence: str | None, tool_use: bool) -> str:
    if tool_use or finish in ("tool_calls", "function_call"):
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    if finish == "stop" and stop_sequence:
        return "stop_sequence"
    return "end_turn"


def thinking_block(text: str) -> dict[str, Any]:
    # The signature proves a block came from Anthropic's model; a client sends it back as it
    # came, and nothing here checks it: empty says there is none.
    return {"type": "thinking", "thinking": text, "signature": ""}


def to_message(resp: Mapping[str, Any], model: str) -> dict[str, Any]:
    """A whole chat completion as a Messages response."""
    choice = (resp.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = msg.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append(thinking_block(reasoning))
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(tc.get("id")),
                "name": fn.get("name", ""),
                "input": _input(fn.get("arguments")),
            }
        )
    seq = choice.get("stop_sequence")
    reason = stop_reason(
        choice.get("finish_reason"), seq, any(b["type"] == "tool_use" for b in content)
    )
    usage = resp.get("usage") or {}
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq if reason == "stop_sequence" else None,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens", 0)),
            "output_tokens": int(usage.get("completion_tokens", 0)),
        },
        # The model process's queue, prompt and decode time (llama-server's names): not
        # Anthropic's; the SDKs keep unknown fields aside.
        **({"timings": resp["timings"]} if isinstance(resp.get("timings"), dict) else {}),
    }


class StreamEvents:
    """Chat chunks in, Anthropic stream events out, in Anthropic's order: ``message_start``
    (before anything else), per content block ``content_block_start``, its deltas and
    ``content_block_stop`` (blocks one after another: reasoning deltas make a ``thinking``
    block, closed with its ``signature_delta``), then ``message_delta`` (the stop reason and
    the usage) and ``message_stop`` (``end``). A quiet stream gets ``ping`` events."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = message_id()
        self._started = False
        self._index = -1  # the block open now (or the last one)
        self._open: str | None = None  # its type, while open
        self._calls: dict[int, int] = {}  # a chunk's tool call index -> its block index
        self._finish: str | None = None
        self._stop_sequence: str | None = None
        self._usage: dict[str, int] = {}
        self._timings: dict[str, Any] | None = None

    def _start(self, input_tokens: int) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        out: list[dict[str, Any]] = []
        if self._open == "thinking":
            # Anthropic's thinking block always ends with its signature, just before its stop.
            signature = {"type": "signature_delta", "signature": ""}
            out.append({"type": "content_block_delta", "index": self._index, "delta": signature})
        self._open = None
        return [*out, {"type": "content_block_stop", "index": self._index}]

    def _open_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        return [*out, {"type": "content_block_start", "index": self._index, "content_block": block}]

    @property
    def started(self) -> bool:
        """Whether ``message_start`` went out (with the first chunk)."""
        return self._started

    def ping(self) -> list[dict[str, Any]]:
        # Before the first chunk (a model still loading, a queue) the message is not started:
        # ``message_start`` carries the prompt's tokens, which come with that chunk; the API
        # module keeps the stream alive with comment lines until then, as Anthropic's own
        # streams always begin with ``message_start``.
        return [{"type": "ping"}]

    def thought(self, text: str) -> list[dict[str, Any]]:
        """A thinking delta of the server's own before the model's answer (its model's load):
        the message starts without its prompt's tokens, which ``message_delta`` reports."""
        out = self._start(0)
        if self._open != "thinking":
            out += self._open_block(thinking_block(""))
        delta = {"type": "thinking_delta", "thinking": text}
        return [*out, {"type": "content_block_delta", "index": self._index, "delta": delta}]

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = self._start(int(chunk.get("prompt_tokens") or 0))
        if isinstance(chunk.get("timings"), dict):
            self._timings = dict(chunk["timings"])
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = {
                "input_tokens": int(usage.get("prompt_tokens", 0)),
                "output_tokens": int(usage.get("completion_tokens", 0)),
            }
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content")
            if isinstance(thought, str) and thought:
                if self._open != "thinking":
                    out += self._open_block(thinking_block(""))
                out.append(
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {"type": "thinking_delta", "thinking": thought},
                    }
                )
            text = delta.get("content")
            if text:
                if self._open != "text":
                    out += self._open_block({"type": "text", "text": ""})
                out.append(
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {"type": "text_delta", "text": text},
                    }
                )
            for tc in delta.get("tool_calls") or []:
                out += self._tool_delta(tc)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                self._stop_sequence = choice.get("stop_sequence")
        return out

    def _tool_delta(self, tc: Mapping[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        key = int(tc.get("index", 0))
        fn = tc.get("function") or {}
        if key not in self._calls:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": tool_use_id(tc.get("id")),
                "name": fn.get("name") or "",
                "input": {},
            }
            out += self._open_block(block)
            self._calls[key] = self._index
        args = fn.get("arguments")
        if args:
            out.append(
                {
                    "type": "content_block_delta",
                    "index": self._calls[key],
                    "delta": {"type": "input_json_delta", "partial_json": args},
                }
            )
        return out

    def end(self) -> list[dict[str, Any]]:
        """The stream ended: close the open block, say why it stopped and the usage."""
        out = [*self._start(0), *self._close()]
        reason = stop_reason(self._finish, self._stop_sequence, bool(self._calls))
        usage = {"output_tokens": self._usage.get("output_tokens", 0)}
        if "input_tokens" in self._usage:
            usage["input_tokens"] = self._usage["input_tokens"]
        out.append(
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": reason,
                    "stop_sequence": self._stop_sequence if reason == "stop_sequence" else None,
                },
                "usage": usage,
                **({"timings": self._timings} if self._timings is not None else {}),
            }
        )
        out.append({"type": "message_stop"})
        return out


def sse(event: Mapping[str, Any]) -> str:
    """One event on the wire: Anthropic names each event as its ``type``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


# --- errors -----------------------------------------------------------------------------------


def on_path(path: str) -> bool:
    """Whether ``path`` is the Messages API's (its errors use Anthropic's envelope)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_type(e: ApiError) -> str:
    kind = _ERROR_TYPES.get(e.status)
    if kind is not None:
        return kind
    return "invalid_request_error" if 400 <= e.status < 500 else "api_error"


def dotted(param: str) -> str:
    """A field's path as Anthropic writes it: ``messages[2].content[0]`` is
    ``messages.2.content.0``."""
    return param.replace("[", ".").replace("]", "")


def error_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's error envelope, worded as Anthropic words it: a field's error starts with
    the field's dotted path (``messages.2.role: ...``), which clients match on."""
    message = e.message
    if e.param:
        path = dotted(e.param)
        if not message.startswith(f"{path}:"):
            message = f"{path}: {message}"
    return {"type": "error", "error": {"type": error_type(e), "message": message}}
