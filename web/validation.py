"""Validation of OpenAI request bodies: pure functions, no Flask and no Redis.

Each ``validate_*`` takes the decoded JSON body and returns a ``Validated``: the model name, the
keyword arguments for llama-cpp-python (``create_chat_completion`` / ``create_completion``; for
embeddings ``{"input": [...]}``) and whether the client asked for a stream. Anything wrong raises
a 400 ``ApiError`` whose ``param`` names the field, e.g. ``messages[1].content``.

Only what the client sent is passed on (no defaults are injected): llama-cpp-python's own
defaults apply otherwise. OpenAI fields that have no meaning here (``user``, ``metadata``,
``store``…) are accepted and ignored, because the official clients send some of them on every
call (the API module names them in the ``x-residency-ignored`` header); those that would change
the answer and are not served (``audio``, a modality other than text, ``web_search_options``)
are refused by name. ``stream_options`` and ``parallel_tool_calls`` (with tools) travel in the
params to the model process, which takes them out before generating, as does
``reasoning_effort`` (how much a reasoning model may think). An assistant message of the
history may carry the model's earlier reasoning in ``reasoning_content``: a template that
renders reasoning gets it there, apart from the answer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from residency.errors import ApiError, bad_request
from residency.grammar_limits import (
    MAX_PATTERN_NESTING,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_REPEAT,
    costly_patterns,
    unbounded,
)
from residency.tool_schema import call_schema
from web.grammar_schema import unsupported

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# Caps on what one request may hold (docs/operations.md, "Limits on input"). Each bounds work a
# client could otherwise make unbounded in web or in a model process: llama.cpp checks every
# stop string against the text on every token, turns each JSON schema into a grammar (with one
# copy of an item per repetition), and indexes logits by the token ids of logit_bias.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_TOOLS = 128
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_EMBEDDING_INPUTS = 2048
#: Integers llama.cpp takes as C ints (max_tokens) or int64 (seed).
MAX_INT32 = 2**31 - 1
INT64 = (-(2**63), 2**63 - 1)
_MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id", "function_call")
#: What ``reasoning_effort`` may ask a reasoning model for ("none": no reasoning at all).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

# Sampling parameters shared by chat and completions: name -> (lo, hi, integer). The OpenAPI
# document (web.openapi) takes its bounds from here.
SAMPLING: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, False),
    "typical_p": (0.0, 1.0, False),
    "top_k": (0.0, 1e9, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "repeat_penalty": (0.0, 10.0, False),
}


@dataclass(frozen=True)
class Validated:
    model: str
    params: dict[str, Any]
    stream: bool
    #: Options the web layer itself applies to the answer (e.g. embeddings' encoding_format).
    options: dict[str, Any] = field(default_factory=dict)


def type_name(v: Any) -> str:
    """The JSON type of a parsed value, as an error message names it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _is_number(v: Any) -> bool:
    # bool is an int subclass in Python, but JSON true is not a number.
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def wrong_type(param: str, expected: str, got: Any) -> ApiError:
    return bad_request(f"'{param}' must be {expected}, got {type_name(got)}", param, "invalid_type")


def _max_items(param: str, items: list[Any], cap: int) -> None:
    if len(items) > cap:
        raise bad_request(
            f"'{param}' may hold at most {cap} items, got {len(items)}",
            param,
            "array_above_max_length",
        )


def _max_chars(param: str, s: str, cap: int) -> None:
    if len(s) > cap:
        raise bad_request(
            f"'{param}' may be at most {cap} characters long, got {len(s)}",
            param,
            "string_above_max_length",
        )


def check_schema(param: str, schema: dict[str, Any]) -> None:
    """400 when a JSON schema (response_format, tool parameters) is larger than
    MAX_SCHEMA_BYTES: what every schema is held to, whether or not a grammar is built from it
    (a tool's schema is also rendered into the prompt). Its bounds are checked only where a
    grammar is built (``check_enforceable``)."""
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(
            f"'{param}' is {size} bytes of JSON; a schema may be at most {MAX_SCHEMA_BYTES}",
            param,
            "schema_too_large",
        )


def check_enforceable(param: str, schema: dict[str, Any]) -> None:
    """For a schema a grammar is built from (response_format, a forced or ``required`` tool
    call): 400 naming the first part the sampling grammar would not enforce
    (``web.grammar_schema``), so a request is refused rather than answered unconstrained, and
    400 for a ``pattern`` whose nested repeats are too costly to sample. Counts past
    MAX_SCHEMA_REPEAT are not refused: the grammar drops them (``residency.grammar_limits``)."""
    err = unsupported(schema, param)
    if err is not None:
        raise bad_request(
            f"'{err.path}': {err.feature}; the schema is enforced by a grammar, which supports "
            "types, properties/required/additionalProperties, items/prefixItems/minItems/"
            "maxItems, enum, const, anyOf/oneOf, allOf of objects, local $ref, minLength/"
            "maxLength, anchored patterns and formats date, time, date-time and uuid",
            err.path,
            "unsupported_schema",
        )
    for path, _ in costly_patterns(schema, param):
        raise bad_request(
            f"'{path}' nests repeats inside repeats that multiply to more than "
            f"{MAX_PATTERN_NESTING} (e.g. (x{{0,100}}){{0,100}} is 10000; a bound past "
            f"{MAX_SCHEMA_REPEAT} counts as unbounded); llama.cpp's grammar would track every "
            "way of splitting the text between them on every token. Flatten the pattern, or "
            "bound the string with maxLength instead",
            path,
            "schema_too_large",
        )


def _model(body: Mapping[str, Any]) -> str:
    if "model" not in body or body["model"] is None:
        raise bad_request("you must provide a model parameter", "model", "missing_required")
    m = body["model"]
    if not isinstance(m, str):
        raise wrong_type("model", "a string", m)
    if not m.strip():
        raise bad_request("'model' must not be empty", "model")
    return m


def _stream(body: Mapping[str, Any], params: dict[str, Any] | None = None) -> bool:
    """Whether the client asked for a stream; with ``params``, its ``stream_options`` go there
    (only ``include_usage`` means something: a last chunk with the usage)."""
    s = body.get("stream")
    if s is None:
        s = False
    if not isinstance(s, bool):
        raise wrong_type("stream", "a boolean", s)
    opts = body.get("stream_options")
    if opts is None or params is None:
        return s
    if not isinstance(opts, dict):
        raise wrong_type("stream_options", "an object", opts)
    if not s:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true", "stream_options"
        )
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise wrong_type("stream_options.include_usage", "a boolean", usage)
    if usage:
        params["stream_options"] = {"include_usage": True}
    return s


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float, integer: bool) -> Any:
    v = body[key]
    if integer and not _is_int(v):
        raise wrong_type(key, "an integer", v)
    if not _is_number(v):
        raise wrong_type(key, "a number", v)
    if not lo <= v <= hi:
        bounds = f">= {lo:g}" if hi >= 1e9 else f"between {lo:g} and {hi:g}"
        raise bad_request(f"'{key}' must be {bounds}, got {v}", key, "invalid_value")
    return v


def _unserved(body: Mapping[str, Any]) -> None:
    """Fields that would change a chat answer in ways this box does not serve: 400, never an
    answer that silently lacks what was asked."""
    for key, what in (("audio", "audio output"), ("web_search_options", "web search")):
        if body.get(key) is not None:
            raise bad_request(f"'{key}': {what} is not served by this box", key, "unsupported")
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list):
            raise wrong_type("modalities", "an array", modalities)
        other = [m for m in modalities if m != "text"]
        if other:
            raise bad_request(
                f"'modalities': only 'text' is served by this box, got {other[0]!r}",
                "modalities",
                "unsupported",
            )


def _n(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is None:
        return
    if not _is_int(n):
        raise wrong_type("n", "an integer", n)
    if n != 1:
        raise bad_request(f"'n' must be 1 (only one choice per request), got {n}", "n")


def _max_tokens(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    """``max_completion_tokens`` is the newer name of ``max_tokens``; both may not disagree."""
    seen: dict[str, int] = {}
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v):
            raise wrong_type(key, "an integer", v)
        if not 1 <= v <= MAX_INT32:
            raise bad_request(
                f"'{key}' must be between 1 and {MAX_INT32}, got {v}", key, "invalid_value"
            )
        seen[key] = v
    if len(set(seen.values())) > 1:
        raise bad_request(
            "'max_tokens' and 'max_completion_tokens' disagree; send one of them",
            "max_completion_tokens",
        )
    if seen:
        params["max_tokens"] = next(iter(seen.values()))


def _stop(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    stop = body.get("stop")
    if stop is None:
        return
    if isinstance(stop, str):
        _max_chars("stop", stop, MAX_STOP_CHARS)
        params["stop"] = [stop]
        return
    if not isinstance(stop, list):
        raise wrong_type("stop", "a string or an array of strings", stop)
    _max_items("stop", stop, MAX_STOP)
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise wrong_type(f"stop[{i}]", "a string", s)
        _max_chars(f"stop[{i}]", s, MAX_STOP_CHARS)
    params["stop"] = list(stop)


def _seed(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    seed = body.get("seed")
    if seed is None:
        return
    if not _is_int(seed):
        raise wrong_type("seed", "an integer", seed)
    lo, hi = INT64
    if not lo <= seed <= hi:
        raise bad_request(f"'seed' must be a 64-bit integer, got {seed}", "seed", "invalid_value")
    params["seed"] = seed


def _logit_bias(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    lb = body.get("logit_bias")
    if lb is None:
        return
    if not isinstance(lb, dict):
        raise wrong_type("logit_bias", "an object of token id -> bias", lb)
    if len(lb) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens, got {len(lb)}",
            "logit_bias",
            "array_above_max_length",
        )
    out: dict[str, float] = {}
    for k, v in lb.items():
        p = f"logit_bias.{k[:32]}"
        # Digits only: int() would also take " 1", "+1" and "1_0", and must not see 5000 digits.
        if not (k.isascii() and k.isdigit() and len(k) <= 10) or int(k) > MAX_INT32:
            raise bad_request(f"'{p}': keys must be token ids (integers >= 0)", p)
        tok = int(k)
        if not _is_number(v) or not -100 <= v <= 100:
            raise bad_request(f"'{p}' must be a number between -100 and 100", p)
        out[str(tok)] = float(v)
    params["logit_bias"] = out


def _sampling(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    for key, (lo, hi, integer) in SAMPLING.items():
        if body.get(key) is not None:
            params[key] = _number(body, key, lo, hi, integer)
    _max_tokens(body, params)
    _stop(body, params)
    _seed(body, params)
    _logit_bias(body, params)


# --- chat -----------------------------------------------------------------------------------


def _content_parts(parts: list[Any], param: str) -> str | list[dict[str, Any]]:
    """Text-only part lists become one string: llama.cpp chat templates expect a string."""
    if not parts:
        raise bad_request(f"'{param}' must not be an empty array", param)
    _max_items(param, parts, MAX_CONTENT_PARTS)
    texts: list[str] = []
    for j, part in enumerate(parts):
        pp = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise wrong_type(pp, "an object", part)
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise wrong_type(f"{pp}.text", "a string", part.get("text"))
            texts.append(part["text"])
        elif kind == "image_url":
            iu = part.get("image_url")
            url = iu.get("url") if isinstance(iu, dict) else iu
            if not isinstance(url, str):
                raise wrong_type(f"{pp}.image_url.url", "a string", url)
        else:
            raise bad_request(
                f"'{pp}.type' must be 'text' or 'image_url', got {kind!r}", f"{pp}.type"
            )
    if len(texts) == len(parts):
        return "\n".join(texts)
    return parts


def _message(i: int, m: Any) -> dict[str, Any]:
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise wrong_type(p, "an object", m)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(
            f"'{p}.role' must be one of {', '.join(sorted(ROLES))}, got {role!r}", f"{p}.role"
        )
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = m.get("content")
    has_calls = role == "assistant" and bool(m.get("tool_calls") or m.get("function_call"))
    if content is None:
        if not has_calls:
            raise bad_request(f"'{p}.content' is required", f"{p}.content", "missing_required")
    elif isinstance(content, list):
        content = _content_parts(content, f"{p}.content")
    elif not isinstance(content, str):
        raise wrong_type(f"{p}.content", "a string or an array of content parts", content)
    out["content"] = content
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise wrong_type(f"{p}.name", "a string", m["name"])
    if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
        raise wrong_type(f"{p}.tool_calls", "an array", m["tool_calls"])
    if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
        raise wrong_type(f"{p}.tool_call_id", "a string", m["tool_call_id"])
    for key in _MESSAGE_KEYS:
        if m.get(key) is not None:
            out[key] = m[key]
    reasoning = m.get("reasoning_content")
    if reasoning is not None:
        # Only an answer has reasoning: on any other turn it could not be what the model
        # thought, and a template would render it as if it were.
        if role != "assistant":
            raise bad_request(
                f"'{p}.reasoning_content' is taken on assistant messages only, got role {role!r}",
                f"{p}.reasoning_content",
            )
        if not isinstance(reasoning, str):
            raise wrong_type(f"{p}.reasoning_content", "a string", reasoning)
        out["reasoning_content"] = reasoning
    return out


def _reasoning_effort(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    effort = body.get("reasoning_effort")
    if effort is None:
        return
    if not isinstance(effort, str):
        raise wrong_type("reasoning_effort", "a string", effort)
    if effort not in REASONING_EFFORTS:
        raise bad_request(
            f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, "
            f"got {effort[:64]!r}",
            "reasoning_effort",
            "invalid_value",
        )
    params["reasoning_effort"] = effort


def _tools(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise wrong_type("tools", "an array", tools)
        _max_items("tools", tools, MAX_TOOLS)
        for i, t in enumerate(tools):
            p = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad_request(f"'{p}' must be an object with type 'function'", p)
            fn = t.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"'{p}.function.name' must be a string", f"{p}.function.name")
            schema = fn.get("parameters")
            if schema is not None:
                if not isinstance(schema, dict):
                    raise wrong_type(f"{p}.function.parameters", "an object", schema)
                check_schema(f"{p}.function.parameters", schema)
        if tools:
            params["tools"] = tools
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                f"'tool_choice' must be 'none', 'auto', 'required' or an object, got {choice!r}",
                "tool_choice",
            )
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("'tool_choice.function.name' must be a string", "tool_choice")
        names = [t["function"]["name"] for t in params.get("tools", [])]
        if fn["name"] not in names:
            raise bad_request(
                f"'tool_choice' names {fn['name']!r}, which is not in 'tools'", "tool_choice"
            )
        _enforced_parameters(params["tools"], names.index(fn["name"]))
    else:
        raise wrong_type("tool_choice", "a string or an object", choice)
    if choice == "required":
        for i in range(len(params.get("tools", []))):
            _enforced_parameters(params["tools"], i)
        _required_union(params.get("tools", []))
    params["tool_choice"] = choice


def _parallel_tool_calls(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    """Passed on with tools: a model whose template takes no tools answers a list of calls
    only when it is true (``workers.generic_tools``)."""
    ptc = body.get("parallel_tool_calls")
    if ptc is None:
        return
    if not isinstance(ptc, bool):
        raise wrong_type("parallel_tool_calls", "a boolean", ptc)
    if params.get("tools"):
        params["parallel_tool_calls"] = ptc


def _required_union(tools: list[dict[str, Any]]) -> None:
    """``tool_choice: "required"`` is enforced by one grammar over every tool (an ``anyOf`` of
    their calls): that union is one schema, held to the size one schema may have."""
    size = len(json.dumps(unbounded(call_schema(tools)), separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(
            f"'tool_choice': 'required' makes one grammar of the {len(tools)} tools' calls, "
            f"{size} bytes of JSON schema; at most {MAX_SCHEMA_BYTES} are supported. Send "
            "fewer or smaller tools, or name one function in 'tool_choice'",
            "tool_choice",
            "schema_too_large",
        )


def _enforced_parameters(tools: list[dict[str, Any]], i: int) -> None:
    """A tool the answer is forced to call has its parameters enforced by a grammar."""
    schema = tools[i]["function"].get("parameters")
    if schema is not None:
        check_enforceable(f"tools[{i}].function.parameters", schema)


def _response_format(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    """llama-cpp-python knows only ``json_object`` (optionally with ``schema``); OpenAI's
    ``json_schema`` form is translated to it so that structured outputs are enforced."""
    rf = body.get("response_format")
    if rf is None:
        return
    if not isinstance(rf, dict):
        raise wrong_type("response_format", "an object", rf)
    kind = rf.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        out: dict[str, Any] = {"type": "json_object"}
        if rf.get("schema") is not None:
            if not isinstance(rf["schema"], dict):
                raise wrong_type("response_format.schema", "an object", rf["schema"])
            check_schema("response_format.schema", rf["schema"])
            check_enforceable("response_format.schema", rf["schema"])
            out["schema"] = rf["schema"]
        params["response_format"] = out
        return
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise bad_request(
                "'response_format.json_schema.schema' must be an object",
                "response_format.json_schema.schema",
            )
        check_schema("response_format.json_schema.schema", js["schema"])
        check_enforceable("response_format.json_schema.schema", js["schema"])
        params["response_format"] = {"type": "json_object", "schema": js["schema"]}
        return
    raise bad_request(
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format.type",
    )


def _logprobs_chat(body: Mapping[str, Any], params: dict[str, Any]) -> None:
    lp = body.get("logprobs")
    if lp is not None:
        if not isinstance(lp, bool):
            raise wrong_type("logprobs", "a boolean", lp)
        params["logprobs"] = lp
    if body.get("top_logprobs") is not None:
        params["top_logprobs"] = _number(body, "top_logprobs", 0, 20, True)


def validate_chat(body: Mapping[str, Any]) -> Validated:
    model = _model(body)
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("'messages' is required", "messages", "missing_required")
    if not isinstance(msgs, list):
        raise wrong_type("messages", "an array", msgs)
    if not msgs:
        raise bad_request("'messages' must hold at least one message", "messages")
    _max_items("messages", msgs, MAX_MESSAGES)
    params: dict[str, Any] = {"messages": [_message(i, m) for i, m in enumerate(msgs)]}
    _unserved(body)
    _n(body)
    _sampling(body, params)
    _tools(body, params)
    _parallel_tool_calls(body, params)
    _response_format(body, params)
    _logprobs_chat(body, params)
    _reasoning_effort(body, params)
    return Validated(model, params, _stream(body, params))


# --- completions ----------------------------------------------------------------------------


def validate_completion(body: Mapping[str, Any]) -> Validated:
    model = _model(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required")
    if isinstance(prompt, list):
        # A batch of prompts would need n choices; one prompt in a list is fine.
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise bad_request(
                "'prompt' must be a string (batches and token arrays are not supported)",
                "prompt",
                "unsupported",
            )
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise wrong_type("prompt", "a string", prompt)
    params: dict[str, Any] = {"prompt": prompt}
    _n(body)
    if body.get("best_of") not in (None, 1):
        raise bad_request("'best_of' must be 1", "best_of", "unsupported")
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise wrong_type("suffix", "a string", suffix)
        params["suffix"] = suffix
    echo = body.get("echo")
    if echo is not None:
        if not isinstance(echo, bool):
            raise wrong_type("echo", "a boolean", echo)
        params["echo"] = echo
    if body.get("logprobs") is not None:
        params["logprobs"] = _number(body, "logprobs", 0, 5, True)
    _sampling(body, params)
    return Validated(model, params, _stream(body, params))


# --- embeddings -----------------------------------------------------------------------------


def validate_embedding(body: Mapping[str, Any]) -> Validated:
    model = _model(body)
    inp = body.get("input")
    if inp is None:
        raise bad_request("'input' is required", "input", "missing_required")
    items = [inp] if isinstance(inp, str) else inp
    if not isinstance(items, list):
        raise wrong_type("input", "a string or an array of strings", inp)
    if not items:
        raise bad_request("'input' must not be empty", "input")
    _max_items("input", items, MAX_EMBEDDING_INPUTS)
    for i, s in enumerate(items):
        p = f"input[{i}]" if isinstance(inp, list) else "input"
        if _is_int(s) or isinstance(s, list):
            raise bad_request(
                "token arrays are not supported as embeddings input; send strings",
                p,
                "unsupported",
            )
        if not isinstance(s, str):
            raise wrong_type(p, "a string", s)
        if not s:
            raise bad_request(f"'{p}' must not be an empty string", p)
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise bad_request(
            f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "encoding_format"
        )
    if body.get("dimensions") is not None:
        raise bad_request(
            "'dimensions' is not supported: the model's native size is returned",
            "dimensions",
            "unsupported",
        )
    return Validated(model, {"input": list(items)}, False, {"encoding_format": fmt})
