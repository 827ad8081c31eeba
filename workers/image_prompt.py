"""A chat request's images on their way into its prompt (pure: no llama.cpp).

A chat template renders text: it is given each message's content as one string, with a marker
where each image was (``prepare``), and the prompt it renders is cut at those markers
(``tokenize``): the text between them is tokenized as any prompt is, and each image becomes
what the projector makes of it (``workers.projector``). The marker holds a random nonce made
per request, so no text a user sends can pass for an image or shift one onto another's place.
A template that drops a message's content, or repeats it, would leave an image without its
place: that is the client's 400, never an image silently dropped.

Images arrive as ``data:`` URLs (web fetches an ``http(s)`` URL and passes on its bytes).
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from residency import image_header
from residency.errors import ApiError

T = TypeVar("T")

_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?(;[^,;]+)*;base64,", re.IGNORECASE)


@dataclass
class ImagePrompt(Generic[T]):
    """One request's images in order, the marker that stands for each in its rendered prompt,
    and, once tokenized, its images by their offset in the prompt's tokens."""

    marker: str
    images: list[bytes]
    params: list[str]  # where each image came from, for errors
    media: dict[int, T] = field(default_factory=dict)


def image_bytes(url: str, param: str) -> bytes:
    """The bytes of an image sent as a ``data:`` URL (base64), once its header says it is an
    image the projector reads, of a size it may decode (``residency.image_header``)."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ApiError(
            400,
            f"'{param}' must be a base64 data: URL of an image here (web fetches http(s) URLs "
            "before the request reaches the model)",
            param=param,
            code="invalid_image",
        )
    try:
        data = base64.b64decode(url[m.end() :], validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(
            400, f"'{param}' is not valid base64", param=param, code="invalid_image"
        ) from None
    why = image_header.problem(data)
    if why is not None:
        raise ApiError(400, f"'{param}' is {why}", param=param, code="invalid_image")
    return data


def has_images(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list) and any(
            isinstance(p, Mapping) and p.get("type") == "image_url" for p in content
        ):
            return True
    return False


def prepare(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], ImagePrompt[Any]]:
    """``messages`` with each content list made one string (parts joined by a line break, as
    web joins text parts) and each image part a marker; and the request's images, in order."""
    marker = f"<__residency_image_{secrets.token_hex(8)}__>"
    prompt: ImagePrompt[Any] = ImagePrompt(marker, [], [])
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        texts: list[str] = []
        for j, part in enumerate(content):
            if part.get("type") == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, Mapping) else iu
                param = f"messages[{i}].content[{j}].image_url.url"
                prompt.images.append(image_bytes(str(url), param))
                prompt.params.append(param)
                texts.append(marker)
            else:
                texts.append(str(part.get("text", "")))
        out.append({**m, "content": "\n".join(texts)})
    return out, prompt


def tokenize(
    prompt: ImagePrompt[T],
    text: bytes,
    add_bos: bool,
    plain: Callable[[bytes, bool], list[int]],
    image: Callable[[bytes, str], list[int | T]],
    n_tokens: Callable[[T], int],
    token: Callable[[T], int],
) -> list[int]:
    """The tokens of a rendered prompt ``text`` holding ``prompt``'s markers: ``plain`` tokenizes
    text (with a BOS first when asked), ``image`` turns an image's bytes into its token ids and
    image spans (each ``n_tokens`` long, each position holding ``token``); the spans are put in
    ``prompt.media`` by offset."""
    pieces = text.split(prompt.marker.encode("utf-8"))
    if len(pieces) != len(prompt.images) + 1:
        raise ApiError(
            400,
            f"the model's chat template rendered {len(pieces) - 1} of the request's "
            f"{len(prompt.images)} images (it drops or repeats a message's content); send the "
            "images in user messages",
            param="messages",
            code="invalid_image",
        )
    tokens = plain(pieces[0], add_bos)
    prompt.media.clear()
    for data, param, rest in zip(prompt.images, prompt.params, pieces[1:], strict=True):
        for item in image(data, param):
            if isinstance(item, int):
                tokens.append(item)
            else:
                prompt.media[len(tokens)] = item
                tokens.extend([token(item)] * n_tokens(item))
        tokens.extend(plain(rest, False))
    return tokens
