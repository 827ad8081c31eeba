"""Reading request bodies: the size limit and strict JSON."""

from __future__ import annotations

import json
from typing import Any, NoReturn

from flask import g, request

from residency.errors import ApiError, bad_request


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body is larger than the limit of {limit} bytes (server.max_request_bytes)",
        code="request_too_large",
    )


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def read_json() -> dict[str, Any]:
    """The body as a JSON object. The size limit was set on the request by the app's
    before_request hook; Werkzeug enforces it while reading, also for bodies without a
    Content-Length (chunked), and raises 413. The body's size is kept in ``g.body_bytes`` so
    that it can be checked again once fresh settings are known (see ``check_size``)."""
    raw = request.get_data(cache=False)
    g.body_bytes = len(raw)
    check_size(g.get("body_limit"))
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


def check_size(limit: int | None) -> None:
    """413 if the body read exceeds ``limit``. Called after reading, and again by the API once
    the request's round trip brought fresh settings (the limit used while reading came from the
    cache, and a lowered ``server.max_request_bytes`` must apply at once)."""
    if limit is not None and g.get("body_bytes", 0) > limit:
        raise too_large(limit)
