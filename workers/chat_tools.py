"""What a chat request's ``tools`` mean for one loaded model (pure: no llama.cpp).

A model takes tools in one of two ways:

* ``TEMPLATE``: its chat template (the GGUF's ``tokenizer.chat_template``, used when
  ``chat_format`` is unset) references ``tools``; the definitions are rendered into the prompt
  and the calls are parsed from the answer's text (``workers.toolcalls``);
* ``HANDLER``: ``chat_format`` names one of llama-cpp-python's function-calling handlers,
  which render the tools and return ``tool_calls`` themselves.

Any other model is told about the tools the way llama.cpp's server does for such a template
(``workers.generic_tools``): a system message describes them, and a grammar makes the answer a
JSON call or reply. Its messages' tool calls and results are written as text too.

A grammar built from a tool's parameters drops bounds too large to compile
(``residency.grammar_limits``); with ``tool_choice`` ``auto`` it is only the shape of an answer
the model may give, so a pattern too costly to enforce is dropped too, where a forced call
(checked by web) keeps it or was refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from residency.errors import ApiError
from residency.grammar_limits import unbounded
from residency.tool_schema import call_schema, parameters
from workers import generic_tools

TEMPLATE = "template"
HANDLER = "handler"

#: llama-cpp-python chat formats that handle tools themselves.
FUNCTION_CALLING_FORMATS = (
    "chatml-function-calling",
    "functionary",
    "functionary-v1",
    "functionary-v2",
)
#: Handlers that refuse to stream an answer that may or may not be a call.
NO_AUTO_STREAM = ("chatml-function-calling",)

_USES_TOOLS = re.compile(r"\btools\b")


def support(chat_format: str | None, templates: Mapping[str, str]) -> str | None:
    """How a model whose chat handler is ``chat_format`` takes tools (None: it cannot).
    ``templates``: llama-cpp-python's handler names for the GGUF's templates
    (``chat_template.default``, ``chat_template.<name>``) → their Jinja text."""
    if chat_format in FUNCTION_CALLING_FORMATS:
        return HANDLER
    template = templates.get(chat_format or "")
    if template is not None and _USES_TOOLS.search(template):
        return TEMPLATE
    return None


def describe(chat_format: str | None) -> str:
    return f"chat format '{chat_format}'" if chat_format else "chat format"


@dataclass
class Plan:
    """How to run one chat request: the arguments for ``create_chat_completion``, the names
    of the calls to parse from its text (empty: none), a JSON schema its answer must follow
    (``tool_choice: "required"``), the forced tool whose parameters become the grammar, whether
    a stream's tool-call chunks need OpenAI's shape, and the generic format's tools (a model
    whose template takes none)."""

    params: dict[str, Any]
    parse: frozenset[str] = frozenset()
    schema: dict[str, Any] | None = None
    forced: tuple[str, dict[str, Any]] | None = None  # (param path, parameters schema)
    normalize: bool = False
    names: list[str] = field(default_factory=list)
    generic: generic_tools.Generic | None = None


def _compiled(tool: dict[str, Any], loosen: bool) -> dict[str, Any]:
    """``tool`` with its parameters as a grammar is built from them."""
    fn = tool["function"]
    if not isinstance(fn.get("parameters"), dict):
        return tool
    return {**tool, "function": {**fn, "parameters": unbounded(fn["parameters"], loosen)}}


def plan(params: dict[str, Any], how: str | None, chat_format: str | None, stream: bool) -> Plan:
    params = dict(params)
    parallel = params.pop("parallel_tool_calls", None) is True
    if how is None and isinstance(params.get("messages"), list):
        params["messages"] = generic_tools.history_as_text(params["messages"])
    tools = params.get("tools")
    choice = params.get("tool_choice")
    if not tools:
        return Plan({k: v for k, v in params.items() if k != "tool_choice"})
    names = [t["function"]["name"] for t in tools]
    if how == HANDLER:
        if stream and choice in (None, "auto") and chat_format in NO_AUTO_STREAM:
            raise ApiError(
                400,
                f"{describe(chat_format)} cannot stream an answer with tool_choice 'auto'; "
                "send stream=false, or name a function in 'tool_choice'",
                param="stream",
                code="unsupported",
            )
        # The handler builds its grammars from any of the tools' parameters.
        loosen = choice in (None, "auto")
        params["tools"] = [_compiled(t, loosen) for t in tools]
        return Plan(params, normalize=stream, names=names)
    if choice == "none":
        rest = {k: v for k, v in params.items() if k not in ("tools", "tool_choice")}
        return Plan(rest)
    if (choice == "required" or how is None) and params.get("response_format") is not None:
        what = "'required'" if choice == "required" else "tools on this model"
        raise ApiError(
            400,
            f"'tool_choice': {what} cannot be combined with 'response_format' (the answer is "
            "a tool call, or a reply in a JSON of its own); send 'tool_choice': 'none' or no "
            "'response_format'",
            param="tool_choice",
            code="unsupported",
        )
    if how is None:
        g = generic_tools.generic(tools, choice, parallel)
        rest = {k: v for k, v in params.items() if k not in ("tools", "tool_choice")}
        text = generic_tools.instructions(tools, g)
        rest["messages"] = generic_tools.with_instructions(rest["messages"], text)
        return Plan(rest, names=names, generic=g)
    if isinstance(choice, dict):
        i = names.index(choice["function"]["name"])
        path = f"tools[{i}].function.parameters"
        tools = [_compiled(t, False) if j == i else t for j, t in enumerate(tools)]
        forced = (path, parameters(tools[i]))
        return Plan({**params, "tools": tools}, forced=forced, normalize=stream, names=names)
    if choice == "required":
        rest = {k: v for k, v in params.items() if k != "tool_choice"}
        return Plan(rest, parse=frozenset(names), schema=call_schema(tools), names=names)
    return Plan(params, parse=frozenset(names), names=names)


#: A probe conversation: an assistant turn that called a tool with these arguments (a JSON
#: string, as OpenAI clients send them back), and its result.
PROBE_ARGUMENTS = '{"probekey": 1}'
PROBE_CALL: list[dict[str, Any]] = [
    {"role": "user", "content": "probeuser"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_probe",
                "type": "function",
                "function": {"name": "probefn", "arguments": PROBE_ARGUMENTS},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_probe", "content": "proberesult"},
]


def encodes_arguments(rendered: str | None) -> bool:
    """Whether a template, given ``PROBE_CALL``, wrote the call's arguments as a JSON string
    of JSON (``"{\\"probekey\\": 1}"``): Llama 3.1's, gpt-oss's and others pass them through
    ``tojson`` whatever they are, written for arguments given as an object. Such a model must
    be given its history's arguments as objects, or it reads its own earlier calls as
    strings and imitates them (llama-server decides the same from a probe render)."""
    return rendered is not None and '\\"probekey\\"' in rendered


def object_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant tool call's JSON-string arguments as the object they
    hold (arguments that are not a JSON object stay as sent)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not isinstance(calls, list):
            out.append(m)
            continue
        new = []
        for c in calls:
            fn = c.get("function") if isinstance(c, Mapping) else None
            args = fn.get("arguments") if isinstance(fn, Mapping) else None
            if isinstance(args, str):
                try:
                    obj = json.loads(args)
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and isinstance(fn, Mapping):
                    c = {**c, "function": {**fn, "arguments": obj}}
            new.append(c)
        out.append({**m, "tool_calls": new})
    return out
