"""Reading request bodies: the size limit and strict JSON."""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

from flask import g, request

from residency.errors import ApiError, bad_request


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body is larger than the limit of {limit} bytes (server.max_request_bytes)",
        code="request_too_large",
    )


#: Deepest nesting of objects and arrays a request body may have (the body itself is level 1).
#: Legitimate bodies stay far below (a JSON schema in response_format nests two levels per
#: property level); deeper ones would only reach recursive code further on.
MAX_JSON_DEPTH = 64

# A JSON string escape of a UTF-16 surrogate: only with one can a decoded string hold a lone
# surrogate (strict UTF-8 decoding refuses encoded ones), so only then are strings walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(s: str) -> float:
    # 1e999 parses to inf; no JSON number is infinite, and json.dumps would write "Infinity"
    # (not JSON) to whatever reads the request next.
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:40]} is out of range")
    return v


def _path(where: tuple[Any, ...] | None) -> str:
    parts: list[str | int] = []
    while where is not None:
        where, key = where
        parts.append(key)
    out = ""
    for k in reversed(parts):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _valid_unicode(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_tree(body: Any, strings: bool = True) -> None:
    """400 naming the place where ``body`` nests deeper than MAX_JSON_DEPTH or, with
    ``strings``, holds a string that is not valid Unicode (a lone surrogate escape such as
    ``"\\ud800"``, which llama.cpp's tokenizer and Redis' UTF-8 encoding would fail on).
    Iterative on purpose: the point is not to recurse on what a client nested."""
    stack: list[tuple[Any, int, tuple[Any, ...] | None]] = [(body, 1, None)]
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(
                f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                _path(where),
                "invalid_json",
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if strings and isinstance(k, str) and not _valid_unicode(k):
                raise _bad_string((where, k))
            if isinstance(v, dict | list):
                stack.append((v, depth + 1, (where, k)))
            elif strings and isinstance(v, str) and not _valid_unicode(v):
                raise _bad_string((where, k))


def _bad_string(where: tuple[Any, ...]) -> ApiError:
    param = _path(where)
    return bad_request(
        f"'{param}' holds a lone UTF-16 surrogate escape, which is not valid Unicode",
        param,
        "invalid_json",
    )


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
        # Decoded here, strictly: json.loads on bytes would also guess UTF-16 and UTF-32.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8: {e}", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_no_constants, parse_float=_finite_float)
    except RecursionError:
        raise bad_request(
            f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    check_tree(body, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def check_size(limit: int | None) -> None:
    """413 if the body read exceeds ``limit``. Called after reading, and again by the API once
    the request's round trip brought fresh settings (the limit used while reading came from the
    cache, and a lowered ``server.max_request_bytes`` must apply at once)."""
    if limit is not None and g.get("body_bytes", 0) > limit:
        raise too_large(limit)
