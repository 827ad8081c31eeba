"""Chat answers in OpenAI's published shape (pure: no llama.cpp, no Redis).

llama-cpp-python's chat handlers build the chat completion (and each stream chunk) from the
engine's text completion, in the shape of an older API: its message has no ``refusal``, and
its forced-tool deltas carry ``role``, ``tool_calls`` and ``function_call`` set to ``null``,
which OpenAI's schema types as a string, an array and an object. ``answer`` and ``chunks``
put what they build into the shape of ``CreateChatCompletionResponse`` and
``CreateChatCompletionStreamResponse``: what the official clients and strict validators
expect. Nothing here changes what was generated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

#: Message and delta fields whose ``null`` OpenAI's schema does not allow: absent instead.
_NOT_NULLABLE = ("tool_calls", "function_call", "role")


def _drop_nulls(d: dict[str, Any]) -> None:
    for key in _NOT_NULLABLE:
        if key in d and d[key] is None:
            del d[key]


def answer(resp: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion, shaped in place (and returned)."""
    for choice in resp.get("choices") or []:
        message = choice.get("message")
        if isinstance(message, dict):
            _drop_nulls(message)
            # Required: null when the model did not refuse (a local model never reports one).
            message.setdefault("refusal", None)
    return resp


def chunk(c: dict[str, Any]) -> dict[str, Any]:
    """One stream chunk, shaped in place (and returned)."""
    for choice in c.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            _drop_nulls(delta)
    return c


def chunks(stream: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A chat stream with each chunk shaped; closing it closes the stream under it (which
    ends the generation)."""
    it = iter(stream)
    try:
        for c in it:
            yield chunk(c)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
