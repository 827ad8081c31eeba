"""The OpenAI-compatible API: chat completions, completions, embeddings and the model list."""

from __future__ import annotations

import base64
import json
import logging
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import redis
from flask import Blueprint, Response, g, jsonify, request

from residency import errors, keys
from residency.errors import ApiError
from residency.messages import Kind
from residency.registry import Entry, all_entries
from web import bus, validation
from web.body import check_size, read_json
from web.state import State, state

log = logging.getLogger(__name__)

bp = Blueprint("openai", __name__, url_prefix="/v1")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_UNKNOWN = "unknown"  # metric label for requests that named no registered model


@bp.after_request
def _count(resp: Response) -> Response:
    if request.method == "POST":
        bus.REQUESTS.labels(g.get("model_label", _UNKNOWN), str(resp.status_code)).inc()
    return resp


def _resolve(st: State, model: str, kind: Kind) -> tuple[Entry, int, float]:
    """The registry entry for ``model`` (404 when unknown, 400 for the wrong type), the queue
    bound and the reply timeout — from one Redis round trip."""
    view, entry = st.lookup(model)
    if entry is None:
        raise errors.model_not_found(model)
    g.model_label = model
    want_embedding = kind is Kind.EMBEDDING
    if (entry.spec.type == "embedding") != want_embedding:
        what = "embeddings" if want_embedding else "text generation"
        raise errors.bad_request(
            f"model '{model}' is of type '{entry.spec.type}' and cannot serve {what}",
            "model",
            "wrong_model_type",
        )
    srv, pool = view.settings.server, view.settings.pool
    check_size(srv.max_request_bytes)
    return entry, pool.max_queue_per_model, srv.request_timeout_s


def _submit(kind: Kind, v: validation.Validated) -> bus.Call:
    st = state()
    _entry, bound, timeout_s = _resolve(st, v.model, kind)
    return bus.submit(
        st.r,
        st.scripts,
        kind=kind,
        model=v.model,
        params=v.params,
        stream=v.stream,
        bound=bound,
        timeout_s=timeout_s,
    )


def _named(obj: dict[str, Any], model: str) -> dict[str, Any]:
    # llama.cpp reports the GGUF path as the model; clients expect the name they asked for.
    if "model" in obj:
        obj["model"] = model
    return obj


def _sse(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _stream_response(call: bus.Call) -> Response:
    chunks = call.chunks()
    # Pull the first chunk before answering, so that an error that happens before any output
    # (queue full, load failed, timeout) reaches the client as a proper HTTP status.
    first = next(chunks, None)

    def events() -> Iterator[str]:
        finished = False
        try:
            if first is not None:
                yield _sse(_named(first, call.model))
                try:
                    for c in chunks:
                        yield _sse(_named(c, call.model))
                except ApiError as e:
                    yield _sse(e.envelope())
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            # GeneratorExit here means the client went away: stop the generation.
            if not finished:
                chunks.close()
                call.abandon()

    return Response(events(), mimetype="text/event-stream", headers=SSE_HEADERS)


def _generate(kind: Kind, validate: Callable[[Mapping[str, Any]], validation.Validated]) -> Any:
    v = validate(read_json())
    call = _submit(kind, v)
    if v.stream:
        return _stream_response(call)
    return jsonify(_named(call.result(), v.model))


@bp.post("/chat/completions")
def chat_completions() -> Any:
    return _generate(Kind.CHAT, validation.validate_chat)


@bp.post("/completions")
def completions() -> Any:
    return _generate(Kind.COMPLETION, validation.validate_completion)


def _base64(vec: list[float]) -> str:
    # OpenAI's base64 encoding: little-endian float32, what the official clients decode.
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


@bp.post("/embeddings")
def embeddings() -> Any:
    v = validation.validate_embedding(read_json())
    out = _named(_submit(Kind.EMBEDDING, v).result(), v.model)
    if v.options.get("encoding_format") == "base64":
        for item in out.get("data", []):
            if isinstance(item.get("embedding"), list):
                item["embedding"] = _base64(item["embedding"])
    return jsonify(out)


# --- models -----------------------------------------------------------------------------------


def _model_object(entry: Entry, state_: str | None) -> dict[str, Any]:
    return {
        "id": entry.name,
        "object": "model",
        "created": 0,
        "owned_by": "residency",
        "type": entry.spec.type,
        "state": state_ or "unloaded",
        "pinned": entry.spec.pinned,
    }


def _states(r: redis.Redis, names: list[str]) -> list[str | None]:
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.hget(keys.model(n), "state")
    return list(pipe.execute())


@bp.get("/models")
def list_models() -> Any:
    st = state()
    entries = sorted(all_entries(st.r).values(), key=lambda e: e.name)
    states = _states(st.r, [e.name for e in entries])
    data = [_model_object(e, s) for e, s in zip(entries, states, strict=True)]
    return jsonify({"object": "list", "data": data})


@bp.get("/models/<path:model_id>")
def get_model(model_id: str) -> Any:
    st = state()
    _view, entry = st.lookup(model_id)
    if entry is None:
        raise errors.model_not_found(model_id)
    return jsonify(_model_object(entry, _states(st.r, [model_id])[0]))
