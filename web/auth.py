"""Who is asking: the API key of a request, resolved to a ``residency.auth.Principal``.

Runs before every request to ``/v1/*``, ``/health`` and ``/metrics`` and leaves the caller in
``flask.g.principal``. ``/health`` and ``/metrics`` take the admin token or a key with the
``monitor`` scope only (``[auth] public_health`` opens them).

A user key costs one script call (its record and its user's, read together: a revoke or a
removed user is seen by the next request of every web process) and a dictionary lookup (records
are parsed once per process, by their text); a named admin token one HGET; the box's admin key
(the token ``default``) and a request without a key none.

Whether keys are required is restart-only (``[auth]``), so it is read once per process.
"""

from __future__ import annotations

import hmac
import threading
import weakref

from flask import Response, g, jsonify, request
from werkzeug.datastructures import Headers

from residency import users
from residency.auth import ANONYMOUS, Principal
from residency.errors import ApiError
from web import anthropic
from web.responses import error_response
from web.state import State, state

#: Parsed principals by (key record, user record) text; bounded like the registry cache.
_CACHE: dict[tuple[str, str], tuple[Principal, str]] = {}
_CACHE_SIZE = 4096
_POLICY: weakref.WeakKeyDictionary[State, tuple[bool, bool]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def presented(headers: Headers) -> str | None:
    """The key a request carries: ``Authorization: Bearer KEY``, else ``x-api-key: KEY`` (what
    Anthropic clients send)."""
    auth = headers.get("Authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def admin_token_name(st: State, raw: str) -> str | None:
    """The admin token ``raw`` is (``default`` for the box's admin key), or None."""
    if _is_admin_key(st, raw):
        return users.DEFAULT_TOKEN
    if raw.startswith(users.TOKEN_PREFIX):
        return users.token_name(st.r, raw)
    return None


def resolve(st: State, raw: str) -> Principal | None:
    """The caller ``raw`` identifies, or None (unknown, revoked, malformed)."""
    parsed = users.split_key(raw)
    if parsed is None:
        name = admin_token_name(st, raw)
        return users.admin_principal(name) if name is not None else None
    key_id, secret = parsed
    found = st.scripts.principal(key_id)
    if found is None:
        return None  # never issued, or revoked
    rec, user_rec = found
    if user_rec is None:
        return None  # its user is gone (a removal revokes the user's keys in the same step)
    hit = _CACHE.get((rec, user_rec))
    if hit is None:
        key = users.ApiKey.loads(rec)
        hit = (users.user_principal(key, users.User.loads(user_rec)), key.hash)
        with _LOCK:
            if len(_CACHE) >= _CACHE_SIZE:
                _CACHE.clear()  # records come from admins, but stay bounded anyway
            _CACHE[(rec, user_rec)] = hit
    # The secret is checked on every request: the cache is keyed by the record, not the key.
    p, stored_hash = hit
    return p if users.secret_matches(secret, stored_hash) else None


def policy(st: State) -> tuple[bool, bool]:
    """(keys required, /health and /metrics public), read once per process."""
    got = _POLICY.get(st)
    if got is None:
        s = st.cached().settings
        got = _POLICY[st] = (s.auth.required, s.auth.public_health)
    return got


def unauthorized(message: str) -> Response:
    err = ApiError(401, message, code="invalid_api_key")
    # The Anthropic API's paths answer in its envelope (what its clients parse).
    if request.path.startswith("/v1/messages"):
        resp = jsonify(anthropic.error_body(err))
        resp.status_code = err.status
    else:
        resp = error_response(err)
    resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


def _protected(path: str) -> bool | None:
    """None: open; False: an API path; True: /health or /metrics."""
    if path.startswith(("/v1/", "/api/")) or path == "/v1":
        return False  # the OpenAI, Anthropic and Ollama APIs
    if path in ("/health", "/metrics"):
        return True
    return None


def authenticate() -> Response | None:
    """The app's first before-request hook (see ``create_app``)."""
    health = _protected(request.path)
    if health is None:
        return None
    st = state()
    required, public_health = policy(st)
    raw = presented(request.headers)
    # /health and /metrics name every model, host, device and (per_user) every user: unless
    # public, they need the admin token or a key with the monitor scope, keys required or not.
    required = required or (health and not public_health)
    if raw is not None and (required or users.looks_like_ours(raw) or _is_admin_key(st, raw)):
        p = resolve(st, raw)
        if p is None:
            return unauthorized("invalid API key: unknown, revoked or malformed")
        if health and not (public_health or p.may_monitor):
            raise ApiError(
                403,
                f"{request.path} needs the admin token or an API key with the monitor scope "
                "(`residency keys issue USER --monitor`)",
                type="permission_error",
                code="monitor_not_allowed",
            )
        g.principal = p
        return None
    if required and not (health and public_health):
        return unauthorized(
            "this box requires an API key: send 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>'); an admin issues keys with `residency keys issue`"
        )
    g.principal = ANONYMOUS
    return None


def _is_admin_key(st: State, raw: str) -> bool:
    key = st.admin_key()
    return bool(key) and hmac.compare_digest(raw.encode(), (key or "").encode())


def principal() -> Principal:
    """The caller of the current request (ANONYMOUS outside the authenticated paths)."""
    p = g.get("principal")
    return p if isinstance(p, Principal) else ANONYMOUS
