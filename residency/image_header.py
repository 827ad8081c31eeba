"""An image file's format and pixel size, read from its header alone (pure: no imaging library).

Why: a compressed image says nothing about the memory its decoding takes. A 10 MiB PNG of one
color can declare 40,000 x 40,000 pixels, 4.8 GB once decoded to RGB, and the decoder
(libmtmd's stb_image) allocates that before it looks at a pixel — in the model process that
serves every user of the model. So the size an image declares is read here and checked
against ``MAX_PIXELS`` and ``MAX_SIDE`` before any decoder sees it, at web (a cheap refusal,
before a queue place is spent) and again in the model process.

Read: the formats libmtmd decodes — PNG, JPEG, GIF, BMP — and WebP (recognized so that its
refusal can name it: this build of libmtmd decodes it only with ffmpeg, which it lacks).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

#: The most pixels an image may declare (32 Mpx: 96 MiB as decoded RGB; a 48 Mpx phone photo
#: must be scaled down first) and the longest side.
MAX_PIXELS = 32 * 1024 * 1024
MAX_SIDE = 16384

#: What the model process can decode.
DECODED = ("png", "jpeg", "gif", "bmp")


@dataclass(frozen=True)
class Header:
    format: str  # "png" | "jpeg" | "gif" | "bmp" | "webp"
    width: int
    height: int


def read(data: bytes) -> Header | None:
    """The format and size ``data`` declares; None when it is none of the formats read here,
    or its header is cut short or says nothing sensible."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            w, h = struct.unpack(">II", data[16:24])
            return _header("png", w, h)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            w, h = struct.unpack("<HH", data[6:10])
            return _header("gif", w, h)
        if data.startswith(b"BM") and len(data) >= 26:
            w, h = struct.unpack("<ii", data[18:26])
            return _header("bmp", w, abs(h))  # a negative height stores rows top-down
        if data.startswith(b"\xff\xd8"):
            return _jpeg(data)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp(data)
    except struct.error:
        return None
    return None


def _header(fmt: str, w: int, h: int) -> Header | None:
    return Header(fmt, w, h) if w > 0 and h > 0 else None


#: JPEG start-of-frame markers (each coding process); C4, C8 and CC are other tables.
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(data: bytes) -> Header | None:
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill bytes before a marker
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length follows these
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if length < 2:
            return None
        if marker in _SOF:
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return _header("jpeg", w, h)
        if marker == 0xDA:  # start of scan before any frame header
            return None
        i += 2 + length
    return None


def _webp(data: bytes) -> Header | None:
    kind = data[12:16]
    if kind == b"VP8 ":
        w, h = struct.unpack("<HH", data[26:30])
        return _header("webp", w & 0x3FFF, h & 0x3FFF)
    if kind == b"VP8L":
        (bits,) = struct.unpack("<I", data[21:25])
        return _header("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if kind == b"VP8X":
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return _header("webp", w, h)
    return None


def problem(data: bytes) -> str | None:
    """Why the model process would not decode ``data`` (None: it may): not an image it reads,
    or more pixels than it may hold."""
    h = read(data)
    if h is None:
        return "not an image the model can read (PNG, JPEG, GIF or BMP)"
    if h.format not in DECODED:
        return (
            f"a {h.format.upper()} image, which the model cannot read (send PNG, JPEG, GIF or BMP)"
        )
    if h.width > MAX_SIDE or h.height > MAX_SIDE or h.width * h.height > MAX_PIXELS:
        return (
            f"a {h.width}x{h.height} image, past the {MAX_PIXELS // (1024 * 1024)} Mpx "
            f"({MAX_SIDE} px a side) an image may have here; scale it down"
        )
    return None
