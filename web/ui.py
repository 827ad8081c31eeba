"""The admin dashboard at ``/admin/ui``: static files (HTML, JS, CSS) and the settings schema.

Everything served here is public and holds no secrets: the page asks for the admin key, keeps it
in the tab's sessionStorage and sends it on each call it makes to the admin API (which checks
it), so this blueprint needs no authentication of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Blueprint, Response, jsonify, send_from_directory

from residency.settings import key_meta

STATIC = Path(__file__).parent / "static" / "ui"

bp = Blueprint("ui", __name__, url_prefix="/admin/ui")

# Scripts, styles and calls from this origin only: a script injected into the page could read
# the admin key from sessionStorage, so nothing inline or from elsewhere may run.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@bp.after_request
def _headers(resp: Response) -> Response:
    resp.headers["Content-Security-Policy"] = _CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    # An upgraded box serves its new page at once (the files are tiny).
    resp.headers["Cache-Control"] = "no-cache"
    return resp


@bp.get("")
@bp.get("/")
def index() -> Any:
    return send_from_directory(STATIC, "index.html")


@bp.get("/settings.json")
def settings_schema() -> Any:
    """Every plain key with its default, whether it applies live, and its help text: the form
    edits the live ones (``GET /admin/config`` has the values, not this)."""
    return jsonify({"keys": key_meta()})


@bp.get("/<any('app.js', 'style.css'):name>")
def asset(name: str) -> Any:
    return send_from_directory(STATIC, name)
