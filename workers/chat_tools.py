"""What a chat request's ``tools`` mean for one loaded model (pure: no llama.cpp).

A model takes tools in one of two ways:

* ``TEMPLATE``: its chat template (the GGUF's ``tokenizer.chat_template``, used when
  ``chat_format`` is unset) references ``tools``; the definitions are rendered into the prompt
  and the calls are parsed from the answer's text (``workers.toolcalls``);
* ``HANDLER``: ``chat_format`` names one of llama-cpp-python's function-calling handlers,
  which render the tools and return ``tool_calls`` themselves.

Any other model cannot be told about tools, so ``tool_choice`` ``auto`` (or none given) is
refused with 400 rather than answered as if there were no tools. A named function or
``required`` works everywhere: the call is then enforced by a grammar.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from residency.errors import ApiError
from residency.tool_schema import call_schema, parameters

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


def no_tools(chat_format: str | None) -> ApiError:
    return ApiError(
        400,
        f"this model's {describe(chat_format)} cannot take tools: tools work with a GGUF chat "
        "template that references `tools` (leave `chat_format` unset to use it; e.g. Qwen, "
        "Hermes, Llama 3.1+) or chat_format "
        + ", ".join(FUNCTION_CALLING_FORMATS)
        + ". Without one, name a function in 'tool_choice' or send 'required' "
        "(the call is then enforced by a grammar), or send no tools",
        param="tools",
        code="tools_unsupported",
    )


@dataclass
class Plan:
    """How to run one chat request: the arguments for ``create_chat_completion``, the names
    of the calls to parse from its text (empty: none), a JSON schema its answer must follow
    (``tool_choice: "required"``), the forced tool whose parameters become the grammar, and
    whether a stream's tool-call chunks need OpenAI's shape."""

    params: dict[str, Any]
    parse: frozenset[str] = frozenset()
    schema: dict[str, Any] | None = None
    forced: tuple[str, dict[str, Any]] | None = None  # (param path, parameters schema)
    normalize: bool = False
    names: list[str] = field(default_factory=list)


def plan(params: dict[str, Any], how: str | None, chat_format: str | None, stream: bool) -> Plan:
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
        return Plan(params, normalize=stream, names=names)
    if choice == "none":
        rest = {k: v for k, v in params.items() if k not in ("tools", "tool_choice")}
        return Plan(rest)
    if isinstance(choice, dict):
        i = names.index(choice["function"]["name"])
        path = f"tools[{i}].function.parameters"
        return Plan(params, forced=(path, parameters(tools[i])), normalize=stream, names=names)
    if choice == "required":
        if params.get("response_format") is not None:
            raise ApiError(
                400,
                "'tool_choice': 'required' cannot be combined with 'response_format' "
                "(the answer is a tool call)",
                param="tool_choice",
                code="unsupported",
            )
        rest = {k: v for k, v in params.items() if k != "tool_choice"}
        if how is None:
            rest.pop("tools")  # the template would ignore them; the grammar carries the call
        return Plan(rest, parse=frozenset(names), schema=call_schema(tools), names=names)
    if how is None:
        raise no_tools(chat_format)
    return Plan(params, parse=frozenset(names), names=names)
