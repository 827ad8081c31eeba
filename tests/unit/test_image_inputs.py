"""A chat request's images made ready for a local model (web.image_inputs) and fetched from
their URLs (web.image_fetch), against a real HTTP server on loopback: what is passed on (a
``data:`` URL of the image's own format), what is refused and how cheaply (too many, too large,
not an image, an address inside the network, a redirect there, a slow drip), each refusal a 400
naming the part's URL.

The server runs on 127.0.0.1, so the fetches that must succeed are allowed loopback
(``images.allow_local_urls``), as the guard's setting allows it; everything else about the
address policy is checked against what the server would have answered had it been reached.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import gzip
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from residency.errors import ApiError
from residency.settings import ImageSettings
from tests.fixtures.images import png, png_declaring
from web import image_fetch, image_inputs
from web.image_fetch import Fetcher
from web.image_inputs import Limits, Unusable, inline, sniff
from web.remote_target import Allowed

PNG = png(8, 6)
#: A JPEG's start and its frame header (8 x 6 pixels): what is read of it here.
JPEG = b"\xff\xd8\xff\xc0" + struct.pack(">HBHHB", 17, 8, 6, 8, 3) + bytes(9)
GIF = b"GIF89a" + struct.pack("<HH", 8, 6) + bytes(6)
#: A WebP's extended header, 8 x 6 pixels.
WEBP = (
    b"RIFF\x00\x00\x00\x00WEBPVP8X"
    + bytes(8)
    + (7).to_bytes(3, "little")
    + (5).to_bytes(3, "little")
)
BMP = b"BM" + bytes(16) + struct.pack("<ii", 8, 6)
CAP = 64 << 10  # the tests' images.max_bytes
#: A drip's pause between bytes: far below any read timeout, so only a deadline ends it.
DRIP_S = 0.05
DRIP_BYTES = 100


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


class Images:
    """An HTTP server whose path picks what it answers; it records each request's path and
    ``Host``."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.hosts: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.hits.append(self.path)
                outer.hosts.append(self.headers.get("Host", ""))
                # The fetcher may hang up: what a refusal does.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    outer.answer(self, self.path)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, ctype: str, body: bytes, **hdrs: str) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        for k, v in hdrs.items():
            h.send_header(k.replace("_", "-"), v)
        h.end_headers()
        h.wfile.write(body)

    def answer(self, h: BaseHTTPRequestHandler, path: str) -> None:
        redirects = {
            "/to-ok": "/ok.png",
            "/to-private": "http://10.255.255.1/x.png",
            "/to-metadata": "http://169.254.169.254/latest/meta-data",
            "/loop": "/loop",
            "/to-file": "file:///etc/passwd",
        }
        if path in redirects:
            h.send_response(302)
            h.send_header("Location", redirects[path])
            h.send_header("Content-Length", "0")
            h.end_headers()
        elif path == "/ok.png":
            self._send(h, 200, "image/png", PNG)
        elif path == "/photo":  # a JPEG a server calls image/jpg
            self._send(h, 200, "image/jpg; charset=binary", JPEG)
        elif path == "/page":
            self._send(h, 200, "text/html", b"<html>not an image</html>")
        elif path == "/svg-as-png":
            self._send(h, 200, "image/png", b"<svg xmlns='http://www.w3.org/2000/svg'/>")
        elif path == "/gzip":
            self._send(h, 200, "image/png", gzip.compress(PNG), Content_Encoding="gzip")
        elif path == "/missing":
            self._send(h, 404, "text/plain", b"no")
        elif path == "/big-declared":
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Content-Length", str(100 * CAP))
            h.end_headers()
            h.wfile.write(PNG)  # and never the rest: it must not be waited for
        elif path == "/big-stream":  # no length: the body goes on until it is cut
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(PNG)
            for _ in range(100):
                h.wfile.write(bytes(CAP // 4))
        elif path == "/drip-body":
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Content-Length", str(len(PNG) + DRIP_BYTES))
            h.end_headers()
            h.wfile.write(PNG)
            self._drip(h, b"\x00" * DRIP_BYTES)
        elif path == "/drip-head":
            h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Slow: ")
            self._drip(h, b"a" * DRIP_BYTES)
            h.wfile.write(f"\r\nContent-Length: {len(PNG)}\r\n\r\n".encode() + PNG)
        else:
            self._send(h, 500, "text/plain", b"unknown path")

    @staticmethod
    def _drip(h: BaseHTTPRequestHandler, data: bytes) -> None:
        for i in range(len(data)):
            h.wfile.write(data[i : i + 1])
            h.wfile.flush()
            time.sleep(DRIP_S)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def images() -> Iterator[Images]:
    srv = Images()
    yield srv
    srv.close()


def limits(**kw: Any) -> Limits:
    base: dict[str, Any] = {
        "max_images": 8,
        "max_bytes": CAP,
        "fetch_timeout_s": 10.0,
        "max_request_bytes": 8 * CAP,
        "allowed": Allowed(local=True),
    }
    return Limits(**{**base, **kw})


def fetch(url: str, lim: Limits | None = None) -> bytes:
    with Fetcher(lim or limits()) as f:
        return f(url)


def refused(url: str, lim: Limits | None = None) -> Unusable:
    with pytest.raises(Unusable) as e:
        fetch(url, lim)
    return e.value


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}


def image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def ready(messages: list[Any], lim: Limits | None = None) -> list[Any]:
    params = {"messages": messages}
    lim = lim or limits()
    with Fetcher(lim) as f:
        inline(params, lim, f)
    return list(params["messages"])


def refusal(messages: list[Any], lim: Limits | None = None) -> ApiError:
    with pytest.raises(ApiError) as e:
        ready(messages, lim)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


# --- what is taken ----------------------------------------------------------------------------


def test_the_settings_are_the_limits() -> None:
    got = Limits.of(ImageSettings())
    assert (got.max_images, got.max_bytes) == (8, 10 << 20)
    assert got.allowed == Allowed(local=False, private=False)  # nothing inside, by default
    s = ImageSettings(allow_local_urls=True, allow_private_urls=True, max_per_request=2)
    assert Limits.of(s).allowed == Allowed(local=True, private=True)
    assert Limits.of(s).max_images == 2


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (PNG, "image/png"),
        (JPEG, "image/jpeg"),
        (GIF, "image/gif"),
        (WEBP, "image/webp"),
        (BMP, "image/bmp"),
    ],
)
def test_each_format_is_known_by_its_signature(data: bytes, kind: str) -> None:
    assert sniff(data) == kind
    assert sniff(b"<svg/>") is None and sniff(b"") is None


def test_an_image_url_is_fetched_and_passed_on_as_a_data_url(images: Images) -> None:
    detail = {"type": "image_url", "image_url": {"url": images.url("/photo"), "detail": "low"}}
    bare = {"type": "image_url", "image_url": images.url("/ok.png")}  # chat allows a string
    data = image(data_url(GIF, "image/gif"))
    messages = [{"role": "system", "content": "look"}, user(detail, bare, data)]
    before = copy.deepcopy(messages)
    out = ready(messages)
    parts = out[1]["content"]
    # Named for the format its bytes hold (the server said image/jpg), its other keys kept.
    assert parts[1] == {
        "type": "image_url",
        "image_url": {"url": data_url(JPEG, "image/jpeg"), "detail": "low"},
    }
    assert parts[2] == image(data_url(PNG))
    assert parts[3] == data  # a data URL that checks out stays as it came
    assert out[0] is messages[0] and parts[0] == messages[1]["content"][0]
    assert messages == before  # the request's own messages are not changed
    assert images.hits == ["/photo", "/ok.png"]
    assert images.hosts[0] == f"127.0.0.1:{images.port}"


def test_a_requests_fetched_images_are_bounded_together(images: Images) -> None:
    # Queued with the request, in Redis: a flood of queued requests must not hold 8 full
    # images each.
    n = len(ready([user(image(images.url("/ok.png")))])[0]["content"][1]["image_url"]["url"])
    one = len(fetch(images.url("/ok.png")))
    lim = limits(max_request_bytes=2 * one)
    assert len(ready([user(*[image(images.url("/ok.png"))] * 2)], lim)[0]["content"]) == 3
    e = refusal([user(*[image(images.url("/ok.png"))] * 3)], lim)
    assert e.code == "image_too_large" and e.param == "messages[0].content[3].image_url.url"
    assert "images.max_request_bytes" in e.message
    assert n > one  # passed on as base64
    assert Limits.of(ImageSettings()).max_request_bytes == 10 << 20


def test_a_request_without_images_is_left_alone(images: Images) -> None:
    params: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    inline(params, limits(), Fetcher(limits()))
    assert params == {"messages": [{"role": "user", "content": "hi"}]}


# --- refused, and cheaply ---------------------------------------------------------------------


def test_too_many_images_are_refused_before_any_is_read(images: Images) -> None:
    # 10,000 image parts, in 40 messages of 250: one pass counts them, nothing is fetched.
    messages = [
        user(*[image(images.url(f"/ok.png?{m}-{k}")) for k in range(250)]) for m in range(40)
    ]
    e = refusal(messages)
    assert e.code == "too_many_images"
    assert e.param == "messages[0].content[9]"  # the first past the 8th
    assert "at most 8 images, got 10000" in e.message
    assert images.hits == []
    # Eight are fine.
    assert len(ready([user(*[image(images.url("/ok.png"))] * 8)])[0]["content"]) == 9


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("file:///etc/passwd", "invalid_image_url"),
        ("ftp://example.com/a.png", "invalid_image_url"),
        ("/relative.png", "invalid_image_url"),
        ("data:image/png,rawbytes", "invalid_image_url"),
        ("data:image/png;base64", "invalid_image_url"),
        (
            "data:text/html;base64," + base64.b64encode(b"<b>").decode(),
            "unsupported_image_media_type",
        ),
        ("data:image/png;base64,not*base64!", "invalid_base64_image"),
        ("data:image/png;base64," + base64.b64encode(b"just text").decode(), "invalid_image"),
        (data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/png"), "invalid_image"),
        # What the model process would not decode, refused before a queue place is spent: a
        # WebP, a few bytes declaring 40,000 x 40,000 pixels.
        (data_url(WEBP, "image/webp"), "invalid_image"),
        (data_url(png_declaring(40000, 40000)), "invalid_image"),
    ],
)
def test_what_is_not_an_image_url_or_an_image_is_refused_naming_it(url: str, code: str) -> None:
    e = refusal([{"role": "system", "content": "x"}, user(image(url))])
    assert (e.param, e.code) == ("messages[1].content[1].image_url.url", code)
    assert e.message.startswith("'messages[1].content[1].image_url.url': ")


def test_a_data_url_too_large_is_refused_by_its_length_before_it_is_decoded() -> None:
    # Not even base64: it is refused as too large, so it was never decoded.
    huge = "data:image/png;base64," + "!" * (4 * CAP)
    e = refusal([user(image(huge))])
    assert e.code == "image_too_large" and f"larger than {CAP} bytes" in e.message
    # At the cap it passes, one byte past it not.
    assert ready([user(image(data_url(PNG + bytes(CAP - len(PNG)))))])
    assert (
        refusal([user(image(data_url(PNG + bytes(CAP - len(PNG) + 1))))]).code == "image_too_large"
    )


def test_loopback_is_refused_unless_the_setting_allows_it(images: Images) -> None:
    strict = limits(allowed=Allowed())
    for host in ("127.0.0.1", "localhost"):
        e = refused(images.url("/ok.png", host), strict)
        assert e.code == "image_url_refused"
        assert "a loopback address" in e.why and "images.allow_local_urls" in e.why
    err = refusal([user(image(images.url("/ok.png")))], strict)
    assert (err.param, err.code) == ("messages[0].content[1].image_url.url", "image_url_refused")
    assert images.hits == []  # nothing was asked of it
    assert fetch(images.url("/ok.png"), limits(allowed=Allowed(local=True))) == PNG
    assert images.hits == ["/ok.png"]


def test_a_name_is_checked_at_every_address_and_connected_at_the_one_checked(
    images: Images, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = {"pics.test": ["127.0.0.1"], "mixed.test": ["127.0.0.1", "10.1.2.3"]}
    monkeypatch.setattr(image_fetch, "RESOLVE", lambda host, port: answers.get(host, []))
    assert fetch(images.url("/ok.png", "pics.test")) == PNG
    assert images.hosts == [f"pics.test:{images.port}"]  # the name kept, the address pinned
    # One address inside a private range is enough to refuse the name.
    e = refused(images.url("/ok.png", "mixed.test"))
    assert e.code == "image_url_refused" and "10.1.2.3" in e.why and "private" in e.why
    assert "images.allow_private_urls" in e.why
    e = refused(images.url("/ok.png", "nowhere.test"))
    assert e.code == "failed_to_download_image" and "does not resolve" in e.why
    assert images.hits == ["/ok.png"]


def test_a_redirect_is_followed_only_where_the_guard_lets_it(images: Images) -> None:
    assert fetch(images.url("/to-ok")) == PNG
    assert images.hits == ["/to-ok", "/ok.png"]
    e = refused(images.url("/to-private"))
    assert e.code == "image_url_refused" and "10.255.255.1" in e.why
    # A metadata service is never fetched, whatever the settings allow.
    e = refused(images.url("/to-metadata"), limits(allowed=Allowed(local=True, private=True)))
    assert e.code == "image_url_refused" and "metadata" in e.why
    assert "an operator allows" not in e.why
    e = refused(images.url("/to-file"))
    assert e.code == "invalid_image_url"
    e = refused(images.url("/loop"))
    assert e.code == "failed_to_download_image" and "redirects more than 3 times" in e.why


@pytest.mark.parametrize(
    ("path", "code", "says"),
    [
        ("/page", "unsupported_image_media_type", "'text/html'"),
        ("/svg-as-png", "invalid_image", "not a PNG"),
        ("/gzip", "invalid_image", "not a PNG"),  # read as it came: compressed is not an image
        ("/missing", "failed_to_download_image", "HTTP 404"),
    ],
)
def test_an_answer_that_is_not_an_image_is_refused(
    images: Images, path: str, code: str, says: str
) -> None:
    e = refusal([user(image(images.url(path)))])
    assert (e.param, e.code) == ("messages[0].content[1].image_url.url", code)
    assert says in e.message


def test_a_large_answer_is_refused_without_being_read_whole(images: Images) -> None:
    e = refused(images.url("/big-declared"))  # its Content-Length says so: not read at all
    assert e.code == "image_too_large"
    e = refused(images.url("/big-stream"))  # no length: read up to the cap and no further
    assert e.code == "image_too_large" and "went on past it" in e.why


@pytest.mark.parametrize("path", ["/drip-body", "/drip-head"])
def test_a_slow_drip_ends_at_the_deadline(images: Images, path: str) -> None:
    # A byte every DRIP_S resets any read timeout; only the fetch's deadline ends it, long
    # before the drip would (DRIP_BYTES * DRIP_S).
    e = refused(images.url(path), limits(fetch_timeout_s=0.5))
    assert e.code == "failed_to_download_image"
    assert "took longer than 0.5s" in e.why


def test_a_slow_drip_ends_at_the_deadline_in_a_gevent_worker_too() -> None:
    # gunicorn's gevent workers (the default) run a fetch in a greenlet, and the watchdog's
    # timer is one too: the shut-down socket must wake the greenlet that waits on it.
    script = textwrap.dedent(
        """
        from gevent import monkey

        monkey.patch_all()
        from tests.unit.test_image_inputs import Images, limits
        from web.image_fetch import Fetcher
        from web.image_inputs import Unusable

        srv = Images()
        for path in ("/drip-body", "/drip-head", "/ok.png"):
            try:
                with Fetcher(limits(fetch_timeout_s=0.5)) as fetch:
                    print(path, len(fetch(srv.url(path))))
            except Unusable as e:
                print(path, e.code)
        srv.close()
        """
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == [
        "/drip-body failed_to_download_image",
        "/drip-head failed_to_download_image",
        f"/ok.png {len(PNG)}",
    ]


def test_a_requests_fetches_share_one_deadline(images: Images) -> None:
    lim = limits(fetch_timeout_s=0.5)
    e = refusal([user(image(images.url("/ok.png")), image(images.url("/drip-body")))], lim)
    assert (e.param, e.code) == ("messages[0].content[2].image_url.url", "failed_to_download_image")
    assert images.hits == ["/ok.png", "/drip-body"]


def test_refusals_say_what_to_send(images: Images) -> None:
    e = refusal([user(image("gopher://x"))])
    assert "data: URL or an http(s) URL" in e.message
    assert image_inputs.FORMATS in refusal([user(image(images.url("/page")))]).message
    e = refusal([user(image(data_url(WEBP, "image/webp")))])
    assert "it is a WEBP image, which the model cannot read" in e.message
    e = refusal([user(image(data_url(png_declaring(40000, 40000))))])
    assert "it is a 40000x40000 image" in e.message
