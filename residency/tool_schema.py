"""The JSON schema of one call to any of a request's tools (pure).

A model process enforces ``tool_choice: "required"`` with a grammar built from this schema
(``workers.chat_tools``); web measures the same schema to refuse a union too large to build.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A chat tool's parameters schema (an object with no properties when it has none)."""
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A JSON schema for one call to any of ``tools``, in the bare-object form the parser
    reads: ``{"name": ..., "arguments": {...}}``."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": parameters(t),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
