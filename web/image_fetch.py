"""Fetching the images a chat request names by http(s) URL, for a local model, guarded as the
remote forwarder is (``web.remote_target``, ``web.pinned_http``): the URL is anyone's, and web
fetches it from inside the box's network.

Every address the URL's host resolves to is checked — loopback, link-local and unspecified
addresses refused unless ``images.allow_local_urls``, the private ranges unless
``images.allow_private_urls``, metadata services and multicast always — and the connection
goes to the address checked, never to a second lookup (DNS rebinding). A redirect is followed
at most ``MAX_REDIRECTS`` times, each target checked the same way before it is connected to.
Nothing of the box goes along: no proxy variables, no ``.netrc``, no cookies, no key.

Each refusal is cheap. An answer that is not 200, or whose ``Content-Type`` is not an image
type, is refused before its body is read; a body larger than ``images.max_bytes`` by its
``Content-Length`` too, else as soon as the bytes read pass the cap (read as they came: a
compressed body is not an image). All of one request's fetches end at one deadline
(``images.fetch_timeout_s``), however slowly an answer drips: a read timeout alone would not do
it (a byte every few seconds resets it), so a watchdog shuts the connection's socket down at the
deadline, which ends whatever read, TLS handshake included, waits on it.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
import urllib3

from web import remote_target
from web.image_inputs import FORMATS, MEDIA_TYPES, Limits, Unusable, size_text, too_large
from web.pinned_http import pinned_session

MAX_REDIRECTS = 3
CONNECT_TIMEOUT_S = 5.0
#: How much of a body is read at a time.
CHUNK = 64 << 10
HEADERS = {
    "User-Agent": "residency-image-fetch",
    "Accept": ", ".join(sorted(MEDIA_TYPES)),
    "Accept-Encoding": "identity",
}

#: How a URL's host name is resolved (tests answer for it: see ``remote_target.Resolver``).
RESOLVE: remote_target.Resolver = remote_target.system_resolver

#: The setting that lets a refused class of address through, by the remote forwarder's name
#: for it (``remote_target.refusal``).
_SETTINGS = {
    "server.allow_local_remotes": "images.allow_local_urls",
    "server.allow_private_remotes": "images.allow_private_urls",
}

#: A connection as the watchdog knows it: its descriptor, family, and both ends.
_Conn = tuple[int, int, Any, Any]


def _shut(conn: _Conn) -> None:
    fd, family, local, peer = conn
    try:
        dup = socket.fromfd(fd, family, socket.SOCK_STREAM)
    except OSError:
        return  # closed meanwhile
    try:
        # The descriptor may have been closed and given to another socket since: only the
        # connection it was (the same two ends) is shut down.
        if dup.getsockname() == local and dup.getpeername() == peer:
            dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


class _Watchdog:
    """Shuts down every connection it was told of (``connected``) at ``deadline``, unless it
    was stopped first. A socket shut down ends the read waiting on it, in a thread or a
    greenlet alike."""

    def __init__(self, deadline: float) -> None:
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._stopped = False
        self.fired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def connected(self, sock: socket.socket) -> None:
        conn = (sock.fileno(), sock.family, sock.getsockname(), sock.getpeername())
        with self._lock:
            self._conns.append(conn)
            if self.fired:
                _shut(conn)

    def forget(self) -> None:
        """The connections so far are closed by their owner: none of them is shut any more."""
        with self._lock:
            self._conns = []

    def _fire(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self.fired = True
            for conn in self._conns:
                _shut(conn)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._conns = []
        self._timer.cancel()


class Fetcher:
    """The fetches of one request: call it with each URL (``web.image_inputs.Fetch``); all of
    them end by one deadline, counted from the first. Use it as a context manager: leaving it
    stops its watchdog."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._deadline = 0.0
        self._watchdog: _Watchdog | None = None

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()

    def _timed_out(self) -> Unusable:
        return Unusable(
            f"fetching the request's images took longer than {self._limits.fetch_timeout_s:g}s",
            "failed_to_download_image",
        )

    def __call__(self, url: str) -> bytes:
        if self._watchdog is None:
            self._deadline = time.monotonic() + self._limits.fetch_timeout_s
            self._watchdog = _Watchdog(self._deadline)
        for _hop in range(MAX_REDIRECTS + 1):
            location = self._hop(url, self._watchdog)
            if isinstance(location, bytes):
                return location
            url = location
        raise Unusable(f"it redirects more than {MAX_REDIRECTS} times", "failed_to_download_image")

    def _hop(self, url: str, watchdog: _Watchdog) -> bytes | str:
        """The image ``url`` answers, or where it redirects to."""
        ip = self._target(url)
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._timed_out()
        session = pinned_session(ip, on_connect=watchdog.connected)
        try:
            resp = session.get(
                url,
                headers=HEADERS,
                stream=True,
                allow_redirects=False,
                timeout=(min(CONNECT_TIMEOUT_S, left), left),
            )
            try:
                if resp.is_redirect:
                    return urljoin(url, resp.headers["Location"])
                data = self._body(resp)
            finally:
                resp.close()
        except (
            requests.RequestException,
            urllib3.exceptions.HTTPError,
            http.client.HTTPException,
            OSError,
        ) as e:
            if watchdog.fired:
                raise self._timed_out() from None
            raise Unusable(
                f"fetching it failed ({e.__class__.__name__})", "failed_to_download_image"
            ) from None
        finally:
            watchdog.forget()
            session.close()
        if watchdog.fired:  # a body cut short by the deadline may have ended like a whole one
            raise self._timed_out()
        return data

    def _target(self, url: str) -> str:
        """The address to connect to for ``url``, once every address of its host passed."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise Unusable(
                "an image URL must be http(s) (it redirected elsewhere)", "invalid_image_url"
            )
        host = parts.hostname
        if not host:
            raise Unusable("the URL names no host", "invalid_image_url")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            addresses = RESOLVE(host, port)
        except (OSError, UnicodeError, ValueError):
            addresses = []
        if not addresses:
            raise Unusable(f"its host {host[:100]!r} does not resolve", "failed_to_download_image")
        bad = remote_target.first_refused(addresses, self._limits.allowed)
        if bad is not None:
            address, reason, setting = bad
            ours = _SETTINGS.get(setting or "")
            how = f" (an operator allows such addresses with {ours})" if ours else ""
            raise Unusable(
                f"its host resolves to {address}, {reason}: not fetched{how}", "image_url_refused"
            )
        return remote_target.parse(addresses[0]).compressed

    def _body(self, resp: requests.Response) -> bytes:
        if resp.status_code != 200:
            raise Unusable(
                f"the server answered HTTP {resp.status_code}", "failed_to_download_image"
            )
        ctype = (resp.headers.get("Content-Type") or "").partition(";")[0].strip().lower()
        if ctype not in MEDIA_TYPES:
            raise Unusable(
                f"the server answered Content-Type {ctype[:100]!r}, not an image ({FORMATS})",
                "unsupported_image_media_type",
            )
        cap = self._limits.max_bytes
        length = resp.headers.get("Content-Length", "")
        if length.isdigit() and (len(length) > 18 or int(length) > cap):
            raise too_large(cap)
        got: list[bytes] = []
        n = 0
        for chunk in resp.raw.stream(CHUNK, decode_content=False):
            n += len(chunk)
            if n > cap:
                raise Unusable(
                    f"the image is larger than {size_text(cap)} (its answer went on past it)",
                    "image_too_large",
                )
            got.append(chunk)
        return b"".join(got)
