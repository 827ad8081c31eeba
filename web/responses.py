"""Error responses in the OpenAI envelope, shared by the app's handlers and the blueprints."""

from __future__ import annotations

from flask import Response, jsonify

from residency.errors import ApiError, bad_request
from residency.settings import SettingsError


def error_response(e: ApiError, extra: dict[str, object] | None = None) -> Response:
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
