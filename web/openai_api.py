"""The OpenAI-compatible API: chat completions, completions, embeddings and the model list — a
dialect over ``web.pipeline`` (its requests validated by ``web.validation``, its streams
written by ``web.stream``)."""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
from flask import Blueprint, jsonify

from residency import errors, keys, policy_store
from residency.auth import Principal
from residency.errors import ApiError
from residency.messages import Kind
from residency.policy_store import PolicyEntry
from residency.registry import Entry, all_entries
from web import auth, openapi, stream, validation
from web.body import read_json
from web.load_progress import Loading
from web.pipeline import (
    admit_target,
    admitted,
    count_request,
    dispatch,
    forward,
    headers,
    ignore,
    named,
    not_allowed,
    resolve,
    submit,
)
from web.state import state

bp = Blueprint("openai", __name__, url_prefix="/v1")
bp.after_request(count_request)


def _sse(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


_DONE = "data: [DONE]\n\n"


class ChunkStream:
    """OpenAI's stream: each chunk as a ``data:`` line (named for the model asked for, the
    first carrying the route trace when one was asked for), an error as an error envelope,
    then ``data: [DONE]``. Its model's load is shown as comment lines and, with
    ``show_loading`` (a chat), as ``reasoning_content`` deltas that chat UIs display."""

    def __init__(
        self, model: str, trace: dict[str, Any] | None, show_loading: bool = False
    ) -> None:
        self._model = model
        self._trace = trace
        self._show_loading = show_loading

    def start(self) -> str:
        return ""

    def chunk(self, chunk: Mapping[str, Any]) -> str:
        c = named(dict(chunk), self._model)
        if self._trace is not None:
            c["route_trace"], self._trace = self._trace, None
        return _sse(c)

    def keepalive(self) -> str:
        return stream.KEEPALIVE

    def loading(self, step: Loading) -> str:
        out = stream.loading_comment(step)
        if self._show_loading:
            delta = {"role": "assistant", "reasoning_content": stream.loading_text(step) + "\n"}
            chunk = {
                "id": "chatcmpl-loading",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": self._model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
            }
            out += _sse(chunk)
        return out

    def end(self) -> str:
        return _DONE

    def fail(self, error: ApiError) -> str:
        return _sse(error.envelope()) + _DONE


def _route_trace_wanted(body: dict[str, Any]) -> bool:
    want = body.pop("route_trace", False)
    if not isinstance(want, bool):
        raise errors.bad_request("'route_trace' must be a boolean", "route_trace")
    return want


def _generate(
    kind: Kind, path: str, validate: Callable[[Mapping[str, Any]], validation.Validated]
) -> Any:
    return admitted(lambda: _generate_admitted(kind, path, validate))


def _generate_admitted(
    kind: Kind, path: str, validate: Callable[[Mapping[str, Any]], validation.Validated]
) -> Any:
    body = read_json()
    want_trace = _route_trace_wanted(body)
    if want_trace and not auth.principal().route_trace:
        raise ApiError(
            403,
            "'route_trace' is not allowed for this API key (it needs the route_trace scope)",
            type="permission_error",
            param="route_trace",
            code="route_trace_not_allowed",
        )
    v = validate(body)
    fields = openapi.CHAT if kind is Kind.CHAT else openapi.COMPLETION
    ignore(k for k in body if k not in fields)
    d = dispatch(kind, path, v, body)
    t = d.target
    if not want_trace:
        t.trace = None
    if d.batches is not None:
        dialect = ChunkStream(t.entry.name, t.trace, kind is Kind.CHAT and t.show_loading)
        return stream.response(d.batches, dialect, d.abandon, headers(t))
    assert d.result is not None
    out = d.result
    if t.trace is not None:
        out["route_trace"] = t.trace
    return jsonify(out), 200, headers(t)


@bp.post("/chat/completions")
def chat_completions() -> Any:
    return _generate(Kind.CHAT, "/chat/completions", validation.validate_chat)


@bp.post("/completions")
def completions() -> Any:
    return _generate(Kind.COMPLETION, "/completions", validation.validate_completion)


def _base64(vec: list[float]) -> str:
    # OpenAI's base64 encoding: little-endian float32, what the official clients decode.
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


@bp.post("/embeddings")
def embeddings() -> Any:
    return admitted(_embeddings)


def _embeddings() -> Any:
    body = read_json()
    v = validation.validate_embedding(body)
    st = state()
    t = resolve(st, v.model, Kind.EMBEDDING, body)
    admit_target(st, t, Kind.EMBEDDING, v)
    if t.entry.spec.remote:
        return jsonify(named(forward(t, "/embeddings", body, v).json(), v.model))
    out = named(submit(st, Kind.EMBEDDING, v, t).result(), v.model)
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
    caller = auth.principal()
    # A key sees the models and policies it may use.
    entries = sorted(
        (e for e in all_entries(st.r).values() if caller.may_use_model(e.name)),
        key=lambda e: e.name,
    )
    states = _states(st.r, [e.name for e in entries])
    data = [_model_object(e, s) for e, s in zip(entries, states, strict=True)]
    for _name, p in sorted(policy_store.all_entries(st.r).items()):
        obj = _policy_object(p, caller)
        if obj is not None:
            data.append(obj)
    return jsonify({"object": "list", "data": data})


def _policy_object(p: PolicyEntry, caller: Principal) -> dict[str, Any] | None:
    """A policy is listed like a model (clients pick it by name), marked as a policy, with the
    candidates ``caller`` may use (a key sees no model outside its scopes, through a policy
    neither); None when the caller may not use the policy, or none of its candidates."""
    candidates = [c for c in p.spec.get("candidates", []) if caller.may_use_model(str(c))]
    if not caller.may_use_policy(p.name) or not candidates:
        return None
    default = p.spec.get("default")
    if isinstance(default, list):
        # Equivalent defaults: the first this caller may use.
        default = next((d for d in default if d in candidates), None)
    return {
        "id": p.name,
        "object": "model",
        "created": 0,
        "owned_by": "residency",
        "type": "policy",
        "candidates": candidates,
        "default": default if default in candidates else None,
    }


@bp.get("/models/<path:model_id>")
def get_model(model_id: str) -> Any:
    st = state()
    _view, entry, policy = st.lookup(model_id)
    caller = auth.principal()
    if policy is not None:
        obj = _policy_object(policy, caller)
        if obj is None:
            raise not_allowed(model_id)
        return jsonify(obj)
    if entry is None:
        raise errors.model_not_found(model_id)
    if not caller.may_use_model(model_id):
        raise not_allowed(model_id)
    return jsonify(_model_object(entry, _states(st.r, [model_id])[0]))
