"""The rerank API's request and answer (Cohere/Jina shape): pure functions, no Flask, no Redis.

A request ``{model, query, documents: [str | {"text": str}], top_n?, return_documents?}`` is
checked here (a 400 naming the bad field) and sent on as ``{"query", "documents": [texts]}``;
the model process answers one score per document, in order, and ``answer`` sorts them (highest
first, ties in input order), cuts them to ``top_n`` and puts the documents back.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from residency.errors import bad_request
from web import validation
from web.validation import Validated

#: Documents one request may rank (Cohere's limit): each is a sequence the model decodes.
MAX_RERANK_DOCUMENTS = 1000


def _text(i: int, d: Any) -> str:
    p = f"documents[{i}]"
    if isinstance(d, Mapping):
        t = d.get("text")
        if not isinstance(t, str):
            raise bad_request(
                f"'{p}.text' must be a string, got {validation.type_name(t)}", f"{p}.text"
            )
        return t
    if not isinstance(d, str):
        raise bad_request(
            f"'{p}' must be a string or an object with 'text', got {validation.type_name(d)}",
            p,
            "invalid_type",
        )
    return d


def validate_rerank(body: Mapping[str, Any]) -> Validated:
    model = validation._model(body)
    query = body.get("query")
    if query is None:
        raise bad_request("'query' is required", "query", "missing_required")
    if not isinstance(query, str):
        raise bad_request(
            f"'query' must be a string, got {validation.type_name(query)}", "query", "invalid_type"
        )
    if not query.strip():
        raise bad_request("'query' must not be empty", "query")
    docs = body.get("documents")
    if docs is None:
        raise bad_request("'documents' is required", "documents", "missing_required")
    if not isinstance(docs, list):
        raise bad_request(
            f"'documents' must be an array, got {validation.type_name(docs)}",
            "documents",
            "invalid_type",
        )
    if not docs:
        raise bad_request("'documents' must not be empty", "documents")
    validation._max_items("documents", docs, MAX_RERANK_DOCUMENTS)
    texts = [_text(i, d) for i, d in enumerate(docs)]
    top_n = body.get("top_n")
    if top_n is not None and (not validation._is_int(top_n) or top_n < 1):
        raise bad_request(f"'top_n' must be an integer of at least 1, got {top_n!r}", "top_n")
    ret = body.get("return_documents")
    if ret is None:
        ret = True
    if not isinstance(ret, bool):
        raise bad_request(
            f"'return_documents' must be a boolean, got {validation.type_name(ret)}",
            "return_documents",
            "invalid_type",
        )
    return Validated(
        model,
        {"query": query, "documents": texts},
        False,
        {"top_n": top_n, "return_documents": ret},
    )


def answer(reply: Mapping[str, Any], v: Validated) -> dict[str, Any]:
    """The client's answer from the model process's ``reply`` (one score per document)."""
    texts: list[str] = v.params["documents"]
    scores = [float(s) for s in reply["scores"]]
    if len(scores) != len(texts):
        raise ValueError(f"{len(scores)} scores for {len(texts)} documents")
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    top_n = v.options.get("top_n")
    if top_n is not None:
        order = order[:top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if v.options.get("return_documents", True):
            item["document"] = {"text": texts[i]}
        results.append(item)
    usage = reply.get("usage") or {}
    tokens = int(usage.get("total_tokens", usage.get("prompt_tokens", 0)))
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "object": "list",
        "model": v.model,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
