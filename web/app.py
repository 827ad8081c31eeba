"""The Flask app factory: blueprints, the body size limit and JSON errors everywhere."""

from __future__ import annotations

import logging

import redis
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from residency.box import Box
from residency.errors import ApiError
from web import (
    admin_api,
    admin_pulls,
    admin_users,
    auth,
    bus,
    guard,
    messages_api,
    ollama_api,
    openai_api,
    openapi,
    ops,
    pipeline,
    replicated,
    rerank_api,
    responses_api,
    traces,
    ui,
)
from web.body import too_large
from web.responses import error_response
from web.state import EXTENSION, State, state

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def _from_http(e: HTTPException) -> ApiError:
    status = e.code or 500
    if status == 404:
        message = f"unknown path: {request.method} {request.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.path}"
    else:
        message = e.description or e.name
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ApiError(status, message, type=kind, code=_CODES.get(status))


def _register_errors(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api(e: ApiError) -> Response:
        return error_response(e)

    @app.errorhandler(RequestEntityTooLarge)
    def _too_large(e: RequestEntityTooLarge) -> Response:
        return error_response(too_large(g.get("body_limit") or request.max_content_length or 0))

    @app.errorhandler(HTTPException)
    def _http(e: HTTPException) -> Response:
        return error_response(_from_http(e))

    # Redis down or restarting: every route that needs it answers 503 with Retry-After
    # (/livez needs none and stays 200).
    @app.errorhandler(redis.ConnectionError)
    @app.errorhandler(redis.TimeoutError)
    def _storage(e: redis.RedisError) -> Response:
        log.warning("Redis unavailable on %s %s: %s", request.method, request.path, e)
        return error_response(bus.storage_unavailable(e))

    @app.errorhandler(Exception)
    def _internal(e: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error", type="server_error"))


def _limit_body() -> None:
    """Set the body limit before anything reads the body: Werkzeug then enforces it on read
    (chunked bodies included); a declared Content-Length over it is refused at once.

    The limit comes from the cached settings, without a Redis round trip (an API request's one
    round trip needs the model name from the body). A lowered limit is re-checked against fresh
    settings after that round trip; a raised one applies from the next request of the worker.
    """
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    limit = state().cached().settings.server.max_request_bytes
    g.body_limit = limit
    # One byte more than the limit: Werkzeug's reader stops silently *at* its maximum on a
    # chunked body (no 413), so read_json needs to see the extra byte to tell "too large".
    request.max_content_length = limit + 1
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)


def create_app(box: Box | None = None) -> Flask:
    """A web app for ``box`` (from the environment when None). No Redis connection is made
    here: the per-process state connects on the first request, after gunicorn forked."""
    app = Flask("residency.web")
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions[EXTENSION] = State(box or Box.from_env())
    _register_errors(app)
    # Before the other hooks: its server span covers them (nothing is added when it is off).
    traces.install(app)
    # A request a web page made for its own ends is refused before anything reads it; then
    # authentication: a caller without a valid key learns nothing else (not even 413).
    app.before_request(guard.check)
    app.before_request(auth.authenticate)
    app.before_request(_limit_body)
    # An admin change is answered once a replica holds it (Sentinel-backed bus only).
    app.after_request(replicated.confirm)
    app.after_request(guard.cors)
    app.after_request(pipeline.ignored_header)
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(responses_api.bp)
    app.register_blueprint(rerank_api.bp)
    app.register_blueprint(messages_api.bp)
    app.register_blueprint(ollama_api.bp)
    app.register_blueprint(admin_api.bp)
    app.register_blueprint(admin_users.bp)
    app.register_blueprint(admin_pulls.bp)
    app.register_blueprint(ops.bp)
    app.register_blueprint(ui.bp)
    app.register_blueprint(openapi.bp)
    return app
