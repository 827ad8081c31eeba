"""Error responses, shared by the app's handlers and the blueprints: in the OpenAI envelope,
or in Anthropic's on the Messages API's paths."""

from __future__ import annotations

from flask import Response, has_request_context, jsonify, request

from residency.errors import ApiError, bad_request
from residency.settings import SettingsError
from web import anthropic, ollama


def error_response(e: ApiError, extra: dict[str, object] | None = None) -> Response:
    """``e`` as a response. Under the Messages API's paths it is in Anthropic's envelope
    whatever raised it, routed or not (an unknown path or method there gets a 404 or 405 its
    clients can parse); under Ollama's (``/api/``) it is Ollama's ``{"error": "..."}``."""
    if has_request_context() and anthropic.on_path(request.path):
        resp = jsonify(anthropic.error_body(e))
    elif has_request_context() and ollama.on_path(request.path):
        resp = jsonify(ollama.error_body(e))
    else:
        resp = jsonify({**e.envelope(), **(extra or {})})
    resp.status_code = e.status
    if e.retry_after is not None:
        resp.headers["Retry-After"] = str(e.retry_after)
    return resp


def settings_error(e: SettingsError) -> Response:
    """400 naming every bad key: in the message, in ``problems``, and the first one in
    ``param`` (where OpenAI clients look)."""
    message = "invalid settings: " + "; ".join(f"{k}: {v}" for k, v in e.problems.items())
    err = bad_request(message, next(iter(e.problems), None), "invalid_settings")
    return error_response(err, {"problems": e.problems})
