"""A chat request's images made ready for a local model before it is queued: every
``image_url`` part becomes a ``data:`` URL of a PNG, JPEG, WebP, GIF or BMP image of at most
``images.max_bytes``, and a request holds at most ``images.max_per_request`` of them. Pure but
for the fetch it is handed (``web.image_fetch``).

A data URL is checked where it stands: base64, an image media type, its size read from its
length before a byte is decoded, then its bytes, which must be one of those formats by their
signature (a declared type proves nothing) and declare a size the model process may decode
(``residency.image_header``: a WebP image, which it cannot decode, is refused here too). An
http(s) URL is fetched and what it answered checked the same way, then passed on as a data
URL, so the model process never opens a URL.
Any other scheme is refused: a model process must never be handed a ``file:`` URL to read.

Every refusal is a 400 naming the part's URL (``messages[i].content[j].image_url.url``), and
each is cheap: the count is checked before anything is decoded or fetched (10,000 image parts
cost one pass over the request), a data URL too large by its length is never decoded. A remote
model's request is forwarded whole and never comes here: its upstream fetches and judges its
images.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from residency import image_header
from residency.errors import ApiError, bad_request
from residency.settings import ImageSettings
from web import remote_target

#: The media types an image may be declared as (a data URL's, a fetched answer's
#: ``Content-Type``); "image/jpg" and "image/x-ms-bmp" are names some servers use.
MEDIA_TYPES = frozenset(
    {
        "image/png",
        "image/jpeg",
        "image/jpg",
        "image/webp",
        "image/gif",
        "image/bmp",
        "image/x-ms-bmp",
    }
)
FORMATS = "PNG, JPEG, WebP, GIF or BMP"
#: How far into a data URL its header (``data:image/png;base64``) may run.
_MAX_HEADER = 256


class Unusable(Exception):
    """An image that is not taken: ``why`` says so to the client, ``code`` is the error's."""

    def __init__(self, why: str, code: str) -> None:
        super().__init__(why)
        self.why = why
        self.code = code


@dataclass(frozen=True)
class Limits:
    """What one request's images may be (``[images]``)."""

    max_images: int
    max_bytes: int
    fetch_timeout_s: float
    max_request_bytes: int
    allowed: remote_target.Allowed

    @classmethod
    def of(cls, s: ImageSettings) -> Limits:
        allowed = remote_target.Allowed(local=s.allow_local_urls, private=s.allow_private_urls)
        return cls(s.max_per_request, s.max_bytes, s.fetch_timeout_s, s.max_request_bytes, allowed)


#: ``url -> bytes``: the image an http(s) URL answered (raises ``Unusable``).
Fetch = Callable[[str], bytes]


def sniff(data: bytes) -> str | None:
    """The image format ``data`` holds by its signature, as a media type; None for none of
    PNG, JPEG, WebP, GIF and BMP."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:2] == b"BM":
        return "image/bmp"
    return None


def size_text(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n % (1 << 20) == 0 else f"{n} bytes"


def too_large(max_bytes: int) -> Unusable:
    return Unusable(f"the image is larger than {size_text(max_bytes)}", "image_too_large")


def checked(data: bytes, max_bytes: int) -> str:
    """The media type of an image's bytes, once they are within the cap, an image, and one the
    model process would decode."""
    if len(data) > max_bytes:
        raise too_large(max_bytes)
    kind = sniff(data)
    if kind is None:
        raise Unusable(f"its bytes are not a {FORMATS} image", "invalid_image")
    # What the model process would refuse (a format its decoder lacks; more pixels than it may
    # hold, which a small file can declare) is refused here, before a queue place is spent.
    why = image_header.problem(data)
    if why is not None:
        raise Unusable(f"it is {why}", "invalid_image")
    return kind


def check_data_url(url: str, max_bytes: int) -> None:
    """Raise ``Unusable`` unless ``url`` is a base64 data URL of an image within the cap."""
    comma = url.find(",", 0, _MAX_HEADER)
    if comma < 0:
        raise Unusable("a data URL must read data:<type>;base64,<data>", "invalid_image_url")
    media, *params = (p.strip().lower() for p in url[len("data:") : comma].split(";"))
    if "base64" not in params:
        raise Unusable("a data URL must be base64 (data:<type>;base64,<data>)", "invalid_image_url")
    if media not in MEDIA_TYPES:
        raise Unusable(
            f"its type {media[:64]!r} is not an image taken here ({FORMATS})",
            "unsupported_image_media_type",
        )
    payload = url[comma + 1 :]
    # The decoded size, from the length alone: a data URL too large is never decoded.
    if (len(payload) * 3) // 4 - payload[-2:].count("=") > max_bytes:
        raise too_large(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise Unusable("its data is not valid base64", "invalid_base64_image") from None
    checked(data, max_bytes)


def data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def image_parts(messages: Any) -> list[tuple[int, int]]:
    """``(i, j)`` of every image part (``messages[i].content[j]``), in order."""
    out: list[tuple[int, int]] = []
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            out += [
                (i, j)
                for j, part in enumerate(content)
                if isinstance(part, dict) and part.get("type") == "image_url"
            ]
    return out


def _url(part: dict[str, Any]) -> str:
    iu = part.get("image_url")
    return str(iu.get("url") if isinstance(iu, dict) else iu)


def _refused(param: str, e: Unusable) -> ApiError:
    return bad_request(f"'{param}': {e.why}", param, e.code)


def inline(params: dict[str, Any], limits: Limits, fetch: Fetch) -> None:
    """Make the images of chat ``params`` ready for a local model, in place: each
    ``image_url`` part's URL checked (data URL) or fetched and replaced by a data URL (http,
    https). The messages and parts changed are copies: the request's own stay as they were."""
    messages = params.get("messages")
    at = image_parts(messages)
    if not at:
        return
    assert isinstance(messages, list)
    if len(at) > limits.max_images:
        i, j = at[limits.max_images]
        raise bad_request(
            f"a request may hold at most {limits.max_images} images, got {len(at)}",
            f"messages[{i}].content[{j}]",
            "too_many_images",
        )
    out = list(messages)
    fetched = 0  # bytes of fetched images: they are queued with the request, in Redis
    for i, j in at:
        param = f"messages[{i}].content[{j}].image_url.url"
        part = out[i]["content"][j]
        url = _url(part)
        scheme = url[: url.find(":", 0, 16) + 1].lower()
        try:
            if scheme == "data:":
                check_data_url(url, limits.max_bytes)
                continue
            if scheme not in ("http:", "https:"):
                raise Unusable(
                    "an image is taken as a data: URL or an http(s) URL", "invalid_image_url"
                )
            data = fetch(url)
            kind = checked(data, limits.max_bytes)
            fetched += len(data)
            if fetched > limits.max_request_bytes:
                raise Unusable(
                    f"a request's fetched images may hold {size_text(limits.max_request_bytes)} "
                    "together (images.max_request_bytes); send fewer or smaller ones",
                    "image_too_large",
                )
        except Unusable as e:
            raise _refused(param, e) from None
        iu = part.get("image_url")
        # Named for the format its bytes hold, whatever the server declared (jpg, x-ms-bmp...).
        new = {**(iu if isinstance(iu, dict) else {}), "url": data_url(kind, data)}
        content = list(out[i]["content"])
        content[j] = {**part, "image_url": new}
        out[i] = {**out[i], "content": content}
    params["messages"] = out
