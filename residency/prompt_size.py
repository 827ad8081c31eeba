"""How large a request's prompt is, before any tokenizer sees it: the measure a quota reservation
counts (web), the router predicts prefill from, and the model process measures its prefill pace
in (the same function on both sides, so the pace applies to the prediction's unit)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: The request fields whose text becomes the prompt (what a reservation counts).
PROMPT_FIELDS = ("messages", "prompt", "input", "tools", "functions", "query", "documents")


#: What a reservation counts one image as: its bytes say nothing of the positions it fills (a
#: 300 KB photo fills 256 of Gemma 3's), and counted as text they would reserve a day's quota
#: for one picture. More than the projectors served here give an image (LLaVA-style tiling
#: stays under 3,000).
IMAGE_TOKENS = 4096


def prompt_bytes(params: Mapping[str, Any]) -> int:
    """An upper bound of the tokens ``params``' prompt takes: the UTF-8 bytes of its prompt
    fields as JSON (every token of a byte-level vocabulary is at least one byte, and the JSON
    around each message outweighs the few tokens its chat template adds), each chat image
    part counted as ``IMAGE_TOKENS`` instead of its URL."""
    parts = {k: params[k] for k in PROMPT_FIELDS if k in params}
    images = 0
    messages = parts.get("messages")
    if isinstance(messages, list) and any(isinstance(m, Mapping) for m in messages):
        kept: list[Any] = []
        for m in messages:
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, list):
                text = [p for p in content if not _is_image(p)]
                images += len(content) - len(text)
                m = {**m, "content": text}
            kept.append(m)
        parts["messages"] = kept
    body = json.dumps(parts, ensure_ascii=False, separators=(",", ":")).encode()
    return len(body) + images * IMAGE_TOKENS


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_url"
