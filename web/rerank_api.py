"""``POST /v1/rerank``: (query, document) pairs scored by a model of type ``rerank``.

It goes the way an embeddings request goes (``web.pipeline``): resolved to a registered model
(404 unknown, 403 outside the key's scopes, 400 for a model of another type), admitted against
the in-flight cap and the caller's quotas, queued for its model (the rerank pool, with its own
count limit), its tokens counted; a remote model gets the request at its ``/rerank``.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify

from residency.messages import Kind
from web import rerank
from web.body import read_json
from web.pipeline import admit_target, admitted, count_request, forward, named, resolve, submit
from web.state import state

bp = Blueprint("rerank", __name__, url_prefix="/v1")


bp.after_request(count_request)


@bp.post("/rerank")
def rerank_documents() -> Any:
    return admitted(_rerank)


def _rerank() -> Any:
    body = read_json()
    v = rerank.validate_rerank(body)
    st = state()
    t = resolve(st, v.model, Kind.RERANK, body)
    admit_target(st, t, Kind.RERANK, v)
    if t.entry.spec.remote:
        return jsonify(named(forward(t, "/rerank", body, v).json(), v.model))
    return jsonify(rerank.answer(submit(st, Kind.RERANK, v, t).result(), v))
