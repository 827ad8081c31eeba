"""An image's declared format and size, read from its header before any decoder sees it
(``residency.image_header``): what keeps a small file declaring a huge image away from the
model process."""

from __future__ import annotations

import struct

import pytest

from residency import image_header
from residency.image_header import MAX_PIXELS, MAX_SIDE, Header, problem, read
from tests.fixtures.images import png, png_declaring


def jpeg_declaring(w: int, h: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + b"\1\1\0\0\1\0\1\0\0"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, h, w, 3) + b"\1\x22\0\2\x11\1\3\x11\1"
    return b"\xff\xd8" + app0 + sof + b"\xff\xda"


def test_each_format_read_gives_its_declared_size() -> None:
    assert read(png(64, 48)) == Header("png", 64, 48)
    assert read(jpeg_declaring(640, 480)) == Header("jpeg", 640, 480)
    assert read(b"GIF89a" + struct.pack("<HH", 30, 20) + b"\0" * 8) == Header("gif", 30, 20)
    bmp = b"BM" + b"\0" * 16 + struct.pack("<ii", 100, -50) + b"\0" * 30
    assert read(bmp) == Header("bmp", 100, 50)  # rows stored top-down
    vp8x = b"RIFF\0\0\0\0WEBPVP8X" + b"\0" * 8 + (1999).to_bytes(3, "little") * 2
    assert read(vp8x) == Header("webp", 2000, 2000)


@pytest.mark.parametrize(
    "data",
    [b"", b"hello", b"\x89PNG\r\n\x1a\n", png_declaring(0, 10), b"\xff\xd8\xff\xda", b"GIF89a"],
)
def test_what_is_not_a_sensible_header_is_not_an_image(data: bytes) -> None:
    assert read(data) is None
    assert problem(data) is not None


def test_a_small_file_declaring_a_huge_image_is_refused_before_decoding() -> None:
    bomb = png_declaring(40000, 40000)
    assert len(bomb) < 100
    assert "40000x40000" in (problem(bomb) or "")
    assert problem(png_declaring(MAX_SIDE + 1, 10)) is not None
    assert problem(jpeg_declaring(MAX_SIDE, MAX_PIXELS // MAX_SIDE + 1)) is not None
    assert problem(png_declaring(MAX_SIDE, MAX_PIXELS // MAX_SIDE)) is None
    assert problem(png(64, 48)) is None


def test_webp_is_named_in_its_refusal() -> None:
    vp8l = b"RIFF\0\0\0\0WEBPVP8L" + b"\0" * 5 + struct.pack("<I", (9 << 14) | 9)
    assert read(vp8l) == Header("webp", 10, 10)
    assert "WEBP" in (problem(vp8l) or "")
    assert "webp" not in image_header.DECODED
