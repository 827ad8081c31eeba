"""Whether a chat request's images can reach the model that serves it (pure: no Redis, no
llama.cpp).

A local model sees images only through a vision projector loaded beside it (``[models.X]
mmproj``). A chat request holding an ``image_url`` part (chat; Responses' ``input_image`` and
Messages' ``image`` blocks arrive as such parts) for a model without one is refused with 400
naming the model, rather than answered from its text with the images dropped. A remote model's
upstream decides for itself: its request is forwarded whole.

Web can refuse at resolve time, once it knows the entry (``refuse_images``), before a load or a
queue place is spent on it; the model process refuses it anyway (a request routed or submitted
by any other path), so no image is ever dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from residency.errors import ApiError
from residency.settings import ModelSpec


def sees(spec: ModelSpec) -> bool:
    """Whether the model ``spec`` describes takes images."""
    return spec.remote or spec.mmproj is not None


def first_image(messages: Any) -> tuple[int, int] | None:
    """``(i, j)`` of the first image part (``messages[i].content[j]``), None without one."""
    if not isinstance(messages, list):
        return None
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                return i, j
    return None


def refuse_images(params: Mapping[str, Any], model: str, spec: ModelSpec) -> None:
    """Raise the client's 400 when chat ``params`` hold an image that ``model`` cannot see."""
    at = first_image(params.get("messages"))
    if at is None or sees(spec):
        return
    i, j = at
    raise ApiError(
        400,
        f"model '{model}' cannot read images (it has no vision projector); send the request "
        "to a model that takes images, or send text only",
        param=f"messages[{i}].content[{j}]",
        code="model_not_multimodal",
    )
