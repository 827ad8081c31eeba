"""``POST /v1/rerank``: (query, document) pairs scored by a model of type ``rerank``.

It goes the way an embeddings request goes (``openai_api``): resolved to a registered model
(404 unknown, 403 outside the key's scopes, 400 for a model of another type), admitted against
the in-flight cap and the caller's quotas, queued for its model (the rerank pool, with its own
count limit), its tokens counted; a remote model gets the request at its ``/rerank``.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, g, jsonify, request

from residency.messages import Kind
from web import bus, rerank
from web.body import read_json
from web.openai_api import (
    UNKNOWN_LABEL,
    _admitted,
    _forward,
    _named,
    _quota,
    _resolve,
    _submit,
)
from web.state import state

bp = Blueprint("rerank", __name__, url_prefix="/v1")


@bp.after_request
def _count(resp: Response) -> Response:
    if request.method == "POST":
        bus.REQUESTS.labels(g.get("model_label", UNKNOWN_LABEL), str(resp.status_code)).inc()
    return resp


@bp.post("/rerank")
def rerank_documents() -> Any:
    return _admitted(_rerank)


def _rerank() -> Any:
    body = read_json()
    v = rerank.validate_rerank(body)
    st = state()
    t = _resolve(st, v.model, Kind.RERANK, body)
    _quota(st, t, Kind.RERANK, v)
    if t.entry.spec.remote:
        return jsonify(_named(_forward(t, "/rerank", body, v).json(), v.model))
    return jsonify(rerank.answer(_submit(st, Kind.RERANK, v, t).result(), v))
