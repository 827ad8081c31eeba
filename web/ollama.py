"""Ollama's API translated to chat completions and back: pure functions, no Flask, no Redis.

A ``/api/chat`` or ``/api/generate`` request becomes a chat completions body (``to_chat``,
``generate_to_chat``; a ``raw`` generate a completions body), validated and served like any
other (``web.ollama_api``); the answer, whole or streamed, is written back in Ollama's shape
(``chat_answer``, ``generate_answer``, ``Lines``). Where Ollama and chat completions differ:

- ``options`` holds the sampling fields (``num_predict`` is ``max_tokens``); those that change
  nothing here (``num_ctx``, ``num_gpu``…) are accepted and named as ignored.
- ``format`` (``"json"`` or a JSON schema) is ``response_format``; ``think`` (a boolean or
  ``"low"``/``"medium"``/``"high"``) is ``reasoning_effort``, and the answer's reasoning comes
  back as ``thinking``.
- A tool call's ``function.arguments`` is an object, not a JSON string, and calls carry no ids:
  a ``tool`` message answers the earliest call not yet answered (by ``tool_name`` when given).
- ``images`` are base64 strings beside a message's text: they become ``image_url`` data URLs.
- Durations are nanoseconds: from the model process's ``timings`` (the wait for a slot and a
  load is ``load_duration``) and the web tier's own clock (``total_duration``).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from residency.errors import ApiError, bad_request
from web.image_inputs import sniff
from web.validation import wrong_type

#: The Ollama API version whose shape this box speaks (clients check it for features).
VERSION = "0.12.0"

#: ``options`` that map onto a chat completions field.
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
#: The chat field each Ollama field becomes, for naming it back in an error.
_FIELD_OF = {v: f"options.{k}" for k, v in OPTIONS.items()} | {
    "response_format": "format",
    "reasoning_effort": "think",
    "messages": "messages",
    "tools": "tools",
    "prompt": "prompt",
}
#: Calls one assistant message may carry: each later ``tool`` message looks its call up among
#: them, so the count bounds that work (a body of 2,048 messages stays cheap to translate).
MAX_CALLS = 128
THINK = {True: "medium", False: "none", "low": "low", "medium": "medium", "high": "high"}
_CHAT_FIELDS = frozenset(
    {"model", "messages", "tools", "format", "options", "stream", "think", "keep_alive"}
)
_GENERATE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "suffix",
        "images",
        "format",
        "options",
        "system",
        "template",
        "context",
        "stream",
        "raw",
        "keep_alive",
        "think",
    }
)
#: What a chat's answer is cut at when a tool call is made: Ollama says "stop".
_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "function_call": "stop"}


@dataclass
class Request:
    """What an Ollama generation request asks besides its chat body."""

    chat: dict[str, Any]  # a chat (or, ``raw``, a completions) body
    stream: bool
    raw: bool = False
    unload: bool = False  # keep_alive 0: unload once done (honoured for the admin token only)
    empty: bool = False  # no messages / no prompt: Ollama's load or unload idiom
    ignored: list[str] = field(default_factory=list)


def _stream(body: Mapping[str, Any]) -> bool:
    s = body.get("stream")
    if s is None:
        return True  # Ollama streams unless told not to
    if not isinstance(s, bool):
        raise wrong_type("stream", "a boolean", s)
    return s


def keep_alive_zero(v: Any) -> bool:
    """Whether ``keep_alive`` asks for an unload now: 0, "0", or a zero duration ("0s", "0m")."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int | float):
        return v == 0
    if isinstance(v, str):
        digits = v.strip().rstrip("hmsun")  # Go durations: 0s, 0m, 0h, 0ms, 0us, 0ns
        try:
            return float(digits) == 0
        except ValueError:
            return False
    return False


def _options(body: Mapping[str, Any], chat: dict[str, Any], ignored: list[str]) -> None:
    opts = body.get("options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise wrong_type("options", "an object", opts)
    for name, value in opts.items():
        to = OPTIONS.get(name)
        if to is None:
            ignored.append(f"options.{name}")
        elif value is None:
            continue
        elif to == "max_tokens" and isinstance(value, int) and value < 0:
            continue  # -1 (no limit) and -2 (fill the context): the model's cap applies
        else:
            chat[to] = value


def _format(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return
    if fmt == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        chat["response_format"] = {"type": "json_object", "schema": fmt}
    else:
        raise bad_request(
            f"'format' must be \"json\" or a JSON schema object, got {json.dumps(fmt)[:64]}",
            "format",
        )


def _think(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    think = body.get("think")
    if think is None:
        return
    if not isinstance(think, bool | str) or think not in THINK:
        raise bad_request(
            f'\'think\' must be true, false, "low", "medium" or "high", got '
            f"{json.dumps(think)[:64]}",
            "think",
        )
    chat["reasoning_effort"] = THINK[think]


def _keep_alive(body: Mapping[str, Any], ignored: list[str]) -> bool:
    if "keep_alive" not in body or body["keep_alive"] is None:
        return False
    if keep_alive_zero(body["keep_alive"]):
        return True
    ignored.append("keep_alive")  # residency's own rules (ttl_s, idle eviction) decide
    return False


def image_url(b64: Any, param: str) -> dict[str, Any]:
    """An Ollama image (base64, no header) as a chat ``image_url`` part; its media type is read
    from its first bytes (the pipeline checks the whole image by its signature again)."""
    if not isinstance(b64, str):
        raise wrong_type(param, "a base64 string", b64)
    try:
        head = base64.b64decode(b64[:24], validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"'{param}' is not base64", param, "invalid_image_url") from None
    media = sniff(head) or "image/png"
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{b64}"}}


def _images(images: Any, param: str) -> list[dict[str, Any]]:
    if images is None:
        return []
    if not isinstance(images, list):
        raise wrong_type(param, "an array of base64 strings", images)
    return [image_url(b, f"{param}[{i}]") for i, b in enumerate(images)]


def _content(text: str, images: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if not images:
        return text
    return [{"type": "text", "text": text}, *images] if text else images


def _arguments(args: Any, param: str) -> str:
    if args is None:
        return "{}"
    if isinstance(args, str):
        return args  # some clients send the JSON text; it is what chat completions wants
    if not isinstance(args, dict):
        raise wrong_type(param, "an object", args)
    return json.dumps(args)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise wrong_type("messages", "an array", raw)
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (call id, function name) not yet answered
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise wrong_type(p, "an object", m)
        role = m.get("role")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise wrong_type(f"{p}.content", "a string", content)
        msg: dict[str, Any] = {
            "role": role,
            "content": _content(content, _images(m.get("images"), f"{p}.images")),
        }
        thinking = m.get("thinking")
        if role == "assistant" and isinstance(thinking, str) and thinking:
            msg["reasoning_content"] = thinking
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or len(calls) > MAX_CALLS:
                raise bad_request(
                    f"'{p}.tool_calls' must be an array of at most {MAX_CALLS} calls on an "
                    "assistant message",
                    f"{p}.tool_calls",
                )
            msg["tool_calls"] = []
            pending = []
            for j, tc in enumerate(calls):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(
                        f"'{p}.tool_calls[{j}].function.name' must be a string",
                        f"{p}.tool_calls[{j}].function.name",
                    )
                call_id = f"call_{i}_{j}"
                args = _arguments(fn.get("arguments"), f"{p}.tool_calls[{j}].function.arguments")
                msg["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": args},
                    }
                )
                pending.append((call_id, fn["name"]))
        if role == "tool":
            name = m.get("tool_name") or m.get("name")
            at = next((k for k, (_, n) in enumerate(pending) if n == name), 0)
            if pending:
                msg["tool_call_id"] = pending.pop(at)[0]
            if isinstance(name, str):
                msg["name"] = name
        out.append(msg)
    return out


def _unknown(body: Mapping[str, Any], known: frozenset[str], ignored: list[str]) -> None:
    ignored.extend(k for k in body if k not in known)


def to_chat(body: Mapping[str, Any]) -> Request:
    """An ``/api/chat`` body as a chat completions request."""
    ignored: list[str] = []
    _unknown(body, _CHAT_FIELDS, ignored)
    stream = _stream(body)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body.get("messages"))}
    tools = body.get("tools")
    if tools:
        chat["tools"] = tools
    _options(body, chat, ignored)
    _format(body, chat)
    _think(body, chat)
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    unload = _keep_alive(body, ignored)
    return Request(chat, stream, unload=unload, empty=not chat["messages"], ignored=ignored)


def _text_field(body: Mapping[str, Any], key: str) -> str:
    v = body.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise wrong_type(key, "a string", v)
    return v


def generate_to_chat(body: Mapping[str, Any]) -> Request:
    """An ``/api/generate`` body as a chat request (the model's own template renders it), or,
    ``raw``, as a completion of the prompt as given. A custom ``template``, a ``suffix``
    (fill-in-the-middle) and a ``context`` from an earlier answer are not served: 400 naming
    the field, rather than an answer that silently ignored it."""
    ignored: list[str] = []
    _unknown(body, _GENERATE_FIELDS, ignored)
    stream = _stream(body)
    for key, what in (
        ("template", "a prompt template other than the model's own"),
        ("suffix", "fill-in-the-middle (suffix)"),
    ):
        if _text_field(body, key):
            raise bad_request(f"'{key}': {what} is not served by this box", key, "unsupported")
    context = body.get("context")
    if context not in (None, []):
        raise bad_request(
            "'context': continuing from an earlier answer's token context is not served by "
            "this box; send the conversation to /api/chat instead",
            "context",
            "unsupported",
        )
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise wrong_type("raw", "a boolean", raw)
    prompt = _text_field(body, "prompt")
    system = _text_field(body, "system")
    images = _images(body.get("images"), "images")
    chat: dict[str, Any] = {"model": body.get("model")}
    if raw:
        if images:
            raise bad_request("'images' cannot be sent with 'raw': true", "images", "unsupported")
        if system:
            raise bad_request("'system' cannot be sent with 'raw': true", "system", "unsupported")
        chat["prompt"] = prompt
    else:
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if prompt or images:
            messages.append({"role": "user", "content": _content(prompt, images)})
        chat["messages"] = messages
    _options(body, chat, ignored)
    _format(body, chat)
    if raw and body.get("think") is not None:
        raise bad_request("'think' cannot be sent with 'raw': true", "think", "unsupported")
    _think(body, chat)
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    unload = _keep_alive(body, ignored)
    empty = not prompt and not images
    return Request(chat, stream, raw=bool(raw), unload=unload, empty=empty, ignored=ignored)


def renamed(e: ApiError) -> ApiError:
    """A chat validation error naming the Ollama field it came from."""
    param, message = e.param, e.message
    if param is not None:
        head, dot, rest = param.partition(".")
        base = head.split("[")[0]
        new = _FIELD_OF.get(base)
        if new is not None and new != base:
            full = new + head[len(base) :] + dot + rest
            message = message.replace(f"'{param}'", f"'{full}'").replace(f"'{base}'", f"'{new}'")
            param = full
    return ApiError(
        e.status, message, type=e.type, param=param, code=e.code, retry_after=e.retry_after
    )


# --- answers ----------------------------------------------------------------------------------


def created_at(now: float | None = None) -> str:
    t = time.time() if now is None else now
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def _ns(ms: Any) -> int:
    return int(float(ms) * 1_000_000) if isinstance(ms, int | float) else 0


def durations(
    usage: Mapping[str, Any] | None, timings: Mapping[str, Any] | None, total_ns: int
) -> dict[str, int]:
    """Ollama's counts and durations (nanoseconds) from a chat answer's ``usage`` and
    ``timings``; ``total_ns``: the web tier's own measure of the whole request."""
    u, t = usage or {}, timings or {}
    return {
        "total_duration": total_ns,
        "load_duration": _ns(t.get("queue_ms")),
        "prompt_eval_count": int(u.get("prompt_tokens") or 0),
        "prompt_eval_duration": _ns(t.get("prompt_ms")),
        "eval_count": int(u.get("completion_tokens") or 0),
        "eval_duration": _ns(t.get("predicted_ms")),
    }


def _object_arguments(args: Any) -> dict[str, Any]:
    if isinstance(args, dict):
        return args
    try:
        got = json.loads(args or "{}")
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def tool_calls(calls: Any) -> list[dict[str, Any]]:
    """Chat tool calls in Ollama's shape: arguments as an object."""
    out = []
    for i, tc in enumerate(calls or []):
        fn = tc.get("function") or {}
        out.append(
            {
                "function": {
                    "index": i,
                    "name": fn.get("name") or "",
                    "arguments": _object_arguments(fn.get("arguments")),
                }
            }
        )
    return out


def done_reason(finish: Any) -> str:
    return _DONE_REASONS.get(str(finish), "stop") if finish else "stop"


def chat_answer(resp: Mapping[str, Any], model: str, total_ns: int) -> dict[str, Any]:
    """A whole chat completion as ``/api/chat``'s answer."""
    choice = (resp.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    message: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
    if msg.get("reasoning_content"):
        message["thinking"] = msg["reasoning_content"]
    if msg.get("tool_calls"):
        message["tool_calls"] = tool_calls(msg["tool_calls"])
    return {
        "model": model,
        "created_at": created_at(),
        "message": message,
        "done": True,
        "done_reason": done_reason(choice.get("finish_reason")),
        **durations(resp.get("usage"), resp.get("timings"), total_ns),
    }


def generate_answer(resp: Mapping[str, Any], model: str, total_ns: int) -> dict[str, Any]:
    """A whole chat completion (or completion, ``raw``) as ``/api/generate``'s answer."""
    choice = (resp.get("choices") or [{}])[0]
    msg = choice.get("message")
    text = (msg.get("content") if isinstance(msg, dict) else choice.get("text")) or ""
    out: dict[str, Any] = {"model": model, "created_at": created_at(), "response": text}
    if isinstance(msg, dict) and msg.get("reasoning_content"):
        out["thinking"] = msg["reasoning_content"]
    return {
        **out,
        "done": True,
        "done_reason": done_reason(choice.get("finish_reason")),
        **durations(resp.get("usage"), resp.get("timings"), total_ns),
    }


def empty_answer(model: str, generate: bool, unloading: bool) -> dict[str, Any]:
    """The answer to a request with nothing to generate (Ollama's load and unload idiom)."""
    reason = "unload" if unloading else "load"
    body: dict[str, Any] = (
        {"response": ""} if generate else {"message": {"role": "assistant", "content": ""}}
    )
    return {"model": model, "created_at": created_at(), **body, "done": True, "done_reason": reason}


class Lines:
    """Chat (or completion) chunks in, Ollama's stream objects out: one per chunk with text or
    reasoning (``done: false``), the tool calls whole once their arguments are complete (a
    chunk carries only a piece of them), then the last object (``done: true``) with the reason
    and the counts and durations."""

    def __init__(self, model: str, generate: bool, started_ns: int) -> None:
        self.model = model
        self.generate = generate
        self._started = started_ns
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: Any = None
        self._usage: dict[str, Any] | None = None
        self._timings: dict[str, Any] | None = None

    def _object(self, text: str, thinking: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.generate:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        else:
            out["message"] = {"role": "assistant", "content": text}
            if thinking:
                out["message"]["thinking"] = thinking
        out["done"] = False
        return out

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self._timings = chunk["timings"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text, thought = delta.get("content") or "", delta.get("reasoning_content") or ""
                for tc in delta.get("tool_calls") or []:
                    self._tool_piece(tc)
            else:
                text, thought = choice.get("text") or "", ""
            if text or thought:
                out.append(self._object(text, thought or None))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def _tool_piece(self, tc: Mapping[str, Any]) -> None:
        call = self._calls.setdefault(int(tc.get("index", 0)), {"name": "", "arguments": ""})
        fn = tc.get("function") or {}
        call["name"] += fn.get("name") or ""
        call["arguments"] += fn.get("arguments") or ""

    def keepalive(self) -> dict[str, Any]:
        """An object with no text: a quiet stream's sign of life (a model loading)."""
        return self._object("", None)

    def end(self, now_ns: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._calls and not self.generate:
            calls = [{"function": self._calls[k]} for k in sorted(self._calls)]
            last = self._object("", None)
            last["message"]["tool_calls"] = tool_calls(calls)
            out.append(last)
        final = self._object("", None)
        final["done"] = True
        final["done_reason"] = done_reason(self._finish)
        final.update(durations(self._usage, self._timings, now_ns - self._started))
        return [*out, final]


def error_body(e: ApiError) -> dict[str, Any]:
    """Ollama's error object (an answer's body, or a stream's last line)."""
    return {"error": e.message}


def line(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"


def on_path(path: str) -> bool:
    """Whether ``path`` is Ollama's API (its errors are ``{"error": "..."}``)."""
    return path.startswith("/api/")


# -- pulls -----------------------------------------------------------------------------------

_HF_NAME = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/([^/\s:]+/[^/\s:]+)(?::(\S+))?$")


def pull_source(model: Any) -> str:
    """The box's pull source for an Ollama model name: ``hf.co/ORG/REPO[:QUANT]`` (Ollama's
    way to name a Hugging Face GGUF repo) as ``hf:ORG/REPO[:QUANT]``, a GGUF URL as it is.
    Ollama's library names (``llama3.2:1b``) come from its own registry, not served here."""
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a model to pull", param="model")
    m = _HF_NAME.match(model)
    if m is not None:
        return f"hf:{m.group(1)}" + (f":{m.group(2)}" if m.group(2) else "")
    if model.startswith(("http://", "https://")) and model.lower().split("?")[0].endswith(".gguf"):
        return model
    raise ApiError(
        400,
        f"'{model}' is a name of Ollama's library, which this box does not pull from: pull a "
        "Hugging Face GGUF repo as hf.co/ORG/REPO[:QUANT], or a .gguf URL",
        param="model",
        code="invalid_source",
    )


def pull_status(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A pull's record (``residency.pull_store.public``) as Ollama's status line."""
    state = rec.get("state")
    if state == "failed" or state == "cancelled":
        return {"error": str(rec.get("error") or f"the pull was {state}")}
    if state == "done":
        return {"status": "success"}
    if state == "verifying":
        return {"status": "verifying sha256 digest"}
    if state == "downloading":
        line: dict[str, Any] = {"status": f"pulling {rec.get('file') or rec.get('name')}"}
        if rec.get("bytes_total"):
            line["total"] = rec["bytes_total"]
        line["completed"] = rec.get("bytes_done") or 0
        return line
    return {"status": "waiting for the host's earlier pulls"}
