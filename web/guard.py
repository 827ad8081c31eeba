"""No way in from a web page: the checks every request passes before anything else reads it.

A box bound to loopback is still reachable from every page the operator's browser opens. A page
can send a "simple" cross-origin POST (``text/plain``, no preflight) that generates, loads and
evicts, and with DNS rebinding (its own name resolving to 127.0.0.1) it can read the answers as
same-origin. So, in order:

1. ``Host`` must name this box: a loopback name (``localhost``, ``127.x``, ``[::1]``),
   ``server.host``, or one of ``server.allowed_hosts`` (any port); else 421
   ``misdirected_request``. A rebinding page's requests carry its own name.
2. A browser's ``Origin`` must be the box's own (the same host and port as ``Host``) or one of
   ``server.cors_origins``; else 403 ``origin_not_allowed``. A listed origin gets the CORS
   headers (and its preflights an answer); nothing else does.
3. A POST, PUT or PATCH with a body must say ``Content-Type: application/json`` (parameters
   such as ``charset`` are fine); else 415 ``unsupported_media_type``. A browser sends that
   type cross-origin only after a preflight, which step 2 refuses.

The decisions are pure functions of the headers and the settings (both lists are restart-only,
read once per process); ``check`` is the app's first before-request hook.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

from flask import Response, request

from residency.errors import ApiError
from residency.settings import Settings, is_loopback
from web.state import State, state

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_PORT_RE = re.compile(r"^[0-9]{1,5}$")
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: What a listed origin's preflight may ask for: the headers the API reads.
_CORS_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta"
_CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
_CORS_MAX_AGE_S = 600


@dataclass(frozen=True)
class Rules:
    """What one web process accepts: Host names (lowercase, IPv6 in brackets) besides the
    loopback ones, and foreign origins."""

    hosts: frozenset[str]
    origins: frozenset[str]

    @classmethod
    def of(cls, s: Settings) -> Rules:
        bind = s.server.host.lower()
        if ":" in bind and not bind.startswith("["):
            bind = f"[{bind}]"
        return cls(frozenset({bind, *s.server.allowed_hosts}), frozenset(s.server.cors_origins))


def split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port or None) of a ``Host`` header or an origin's authority, the name lowercase
    and an IPv6 address in brackets; None when it is malformed."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            return None
        name, rest = v[: end + 1], v[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:] if rest else None
    else:
        name, colon, port_text = v.partition(":")
        port = port_text if colon else None
    if not name or (port is not None and not _PORT_RE.match(port)):
        return None
    return name, (int(port) if port is not None else None)


def host_allowed(host: str, rules: Rules) -> bool:
    parsed = split_host(host)
    if parsed is None:
        return False
    name, _port = parsed
    return is_loopback(name) or name in rules.hosts


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) is the box's own as reached at ``host``
    (the request's ``Host``): the same name and port, a missing port being the scheme's."""
    scheme, sep, authority = origin.strip().lower().partition("://")
    if not sep or scheme not in _DEFAULT_PORTS:
        return False
    theirs, ours = split_host(authority), split_host(host)
    if theirs is None or ours is None or theirs[0] != ours[0]:
        return False
    default = _DEFAULT_PORTS[scheme]
    return (theirs[1] or default) == (ours[1] or default)


def origin_allowed(origin: str | None, host: str, rules: Rules) -> bool:
    """No ``Origin`` (not a browser's cross-origin call), the box's own, or a listed one.
    ``null`` (a sandboxed frame, a file) is never the box's own."""
    if origin is None:
        return True
    return same_origin(origin, host) or origin.strip().lower() in rules.origins


def is_json(content_type: str | None) -> bool:
    media = (content_type or "").partition(";")[0].strip().lower()
    return media == "application/json"


_RULES: weakref.WeakKeyDictionary[State, Rules] = weakref.WeakKeyDictionary()


def rules(st: State) -> Rules:
    """This process's rules, from the file and the environment (restart-only keys: no Redis
    round trip, so /livez answers while Redis is down)."""
    got = _RULES.get(st)
    if got is None:
        got = _RULES[st] = Rules.of(st.box.base_settings())
    return got


def _host_header() -> str:
    # HTTP/1.0 probes may send no Host: then the address the server was reached at counts.
    return request.headers.get("Host") or request.environ.get("SERVER_NAME", "")


def check() -> Response | None:
    """The app's first before-request hook (see ``create_app``)."""
    rs = rules(state())
    host = _host_header()
    if not host_allowed(host, rs):
        raise ApiError(
            421,
            f"this box does not answer to the host name {host[:100]!r}; an operator lists the "
            "names it is reached at in server.allowed_hosts",
            param="Host",
            code="misdirected_request",
        )
    origin = request.headers.get("Origin")
    if origin is not None and not origin_allowed(origin, host, rs):
        raise ApiError(
            403,
            f"requests from the web origin {origin[:100]!r} are not allowed; an operator lists "
            "the origins allowed to call this box in server.cors_origins",
            type="permission_error",
            param="Origin",
            code="origin_not_allowed",
        )
    if request.method == "OPTIONS" and origin is not None:
        return _preflight()
    if request.method in _BODY_METHODS and _has_body() and not is_json(request.content_type):
        raise ApiError(
            415,
            f"a {request.method} body must be sent with 'Content-Type: application/json' "
            f"(got {(request.content_type or 'none')[:100]!r})",
            param="Content-Type",
            code="unsupported_media_type",
        )
    return None


def _has_body() -> bool:
    # A call without a body (POST …/load) has no type to check: a page could send it, but every
    # route that acts on one needs the admin token, which a page cannot add without a preflight.
    chunked = "chunked" in (request.headers.get("Transfer-Encoding") or "").lower()
    return bool(request.content_length) or chunked


def _preflight() -> Response:
    resp = Response(status=204)
    resp.headers["Access-Control-Allow-Methods"] = _CORS_METHODS
    resp.headers["Access-Control-Allow-Headers"] = _CORS_HEADERS
    resp.headers["Access-Control-Max-Age"] = str(_CORS_MAX_AGE_S)
    return resp


def cors(resp: Response) -> Response:
    """After-request hook: a listed foreign origin may read the answer (``check`` refused every
    other foreign one; the box's own needs no header)."""
    origin = request.headers.get("Origin")
    if origin is not None and origin.strip().lower() in rules(state()).origins:
        resp.headers["Access-Control-Allow-Origin"] = origin.strip()
        resp.headers["Access-Control-Expose-Headers"] = (
            "Retry-After, x-residency-route, x-residency-ignored"
        )
        resp.headers.add("Vary", "Origin")
    return resp
