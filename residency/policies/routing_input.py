"""What rules see of a request: the routing input, built tolerantly from a request body."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            part["text"]
            for part in content
            if isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ]
        return "\n".join(parts)
    return ""


def _string_metadata(body: Mapping[str, Any]) -> dict[str, str]:
    md = body.get("metadata")
    if not isinstance(md, Mapping):
        return {}
    return {k: v for k, v in md.items() if isinstance(k, str) and isinstance(v, str)}


@dataclass(frozen=True)
class RoutingInput:
    """What rules see of a request."""

    text: str  # text of the last user message: string content, or text parts joined by "\n"
    has_tools: bool  # the request has non-empty "tools" (or legacy "functions")
    has_images: bool  # any message (any role) has an image_url part
    metadata: dict[str, str] = field(default_factory=dict)  # OpenAI "metadata", strings only

    @property
    def byte_length(self) -> int:
        # surrogatepass: a lone surrogate (not valid Unicode) counts, rather than fails.
        return len(self.text.encode("utf-8", errors="surrogatepass"))

    @classmethod
    def from_chat(cls, body: Mapping[str, Any]) -> RoutingInput:
        """From a /v1/chat/completions body; tolerant of malformed parts (they count as
        absent), since request validation is the web tier's job, not routing's."""
        messages = body.get("messages")
        msgs = [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []
        text = ""
        for m in reversed(msgs):
            if m.get("role") == "user":
                text = _text_of(m.get("content"))
                break
        has_images = any(
            isinstance(part, Mapping) and part.get("type") == "image_url"
            for m in msgs
            if isinstance(m.get("content"), list)
            for part in m["content"]
        )
        tools = body.get("tools")
        functions = body.get("functions")
        has_tools = bool(isinstance(tools, list) and tools) or bool(
            isinstance(functions, list) and functions
        )
        return cls(text, has_tools, has_images, _string_metadata(body))

    @classmethod
    def from_completion(cls, body: Mapping[str, Any]) -> RoutingInput:
        """From a /v1/completions body: the prompt string (a list of strings is joined by
        newlines; token-id prompts have no text)."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(x, str) for x in prompt):
            text = "\n".join(prompt)
        else:
            text = ""
        return cls(text, False, False, _string_metadata(body))
