"""Ollama's API (``/api/...``): a dialect over ``web.pipeline``, as the OpenAI and Messages
APIs are. A chat or generate request is translated (``web.ollama``) into a chat completions
request (a ``raw`` generate into a completion) and goes the same way as one: resolution (a
policy routes it), the key's scopes, quotas, the in-flight cap, fair queues, limits; the
answer is translated back, a stream as NDJSON (Ollama streams unless ``stream`` is false).
Errors are ``{"error": "..."}`` with the HTTP status (``web.responses``), and in a stream that
already started, an error object as its last line.

``keep_alive: 0`` asks for the model's unload once the request is done. Unloading a model
evicts it for every user of the box, so only the admin token's request does that (the same
as ``POST /admin/models/{name}/unload``, which lets requests already taken finish); a user
key's ``keep_alive`` is accepted and ignored, named in ``x-residency-ignored``, as is any
other value: residency's own rules (``ttl_s``, eviction for demand) decide what stays.

``/api/pull`` is 501: an admin pulls models (``residency pull``, ``POST /admin/pulls``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, jsonify

from residency import errors, keys, policy_store
from residency.box import audit
from residency.errors import ApiError
from residency.messages import Event, EventType, Kind
from residency.registry import all_entries
from web import auth, ollama, ollama_models, pipeline, stream, validation
from web.body import read_json
from web.load_progress import Loading
from web.state import state

bp = Blueprint("ollama", __name__, url_prefix="/api")
bp.after_request(pipeline.count_request)

NDJSON = "application/x-ndjson"
CHAT_PATH, COMPLETION_PATH = "/chat/completions", "/completions"


def _validated(req: ollama.Request) -> tuple[Kind, str, validation.Validated]:
    pipeline.ignore(req.ignored)
    try:
        if req.raw:
            return Kind.COMPLETION, COMPLETION_PATH, validation.validate_completion(req.chat)
        return Kind.CHAT, CHAT_PATH, validation.validate_chat(req.chat)
    except ApiError as e:
        raise ollama.renamed(e) from None


def _unload(name: str) -> None:
    """The admin's wish to unload ``name`` (as ``POST /admin/models/{name}/unload`` records
    it: the coordinator carries it out under the pool rules, letting taken requests finish)."""
    st = state()
    pipe = st.r.pipeline(transaction=True)
    pipe.hset(keys.explicit(), name, "unload")
    pipe.rpush(keys.events(), json.dumps(Event(EventType.CONFIG, name, {"unload": True}).to_dict()))
    audit(
        pipe,
        f"admin:{auth.principal().name or '-'}",
        "model.unload",
        {"name": name, "via": "keep_alive"},
    )
    pipe.execute()


def _may_unload(req: ollama.Request) -> bool:
    if not req.unload:
        return False
    if auth.principal().kind != "admin":
        pipeline.ignore(["keep_alive"])
        return False
    return True


@bp.post("/chat")
def chat() -> Any:
    started = time.monotonic_ns()
    return pipeline.admitted(lambda: _generate(ollama.to_chat(read_json()), False, started))


@bp.post("/generate")
def generate() -> Any:
    started = time.monotonic_ns()
    return pipeline.admitted(lambda: _generate(ollama.generate_to_chat(read_json()), True, started))


def _generate(req: ollama.Request, is_generate: bool, started: int) -> Any:
    unload = _may_unload(req)
    if req.empty:
        return _empty(req, is_generate, unload)
    kind, path, v = _validated(req)
    d = pipeline.dispatch(kind, path, v, req.chat)
    name = d.target.entry.name
    after = (lambda: _unload(name)) if unload else None
    headers = pipeline.headers(d.target)
    if d.batches is not None:
        lines = ollama.Lines(v.model, is_generate, started)
        resp = stream.response(d.batches, _Lines(lines, after), d.abandon, headers)
        resp.mimetype = NDJSON
        return resp
    assert d.result is not None
    total = time.monotonic_ns() - started
    answer = ollama.generate_answer if is_generate else ollama.chat_answer
    out = answer(d.result, v.model, total)
    if after is not None:
        after()
    return jsonify(out), 200, headers


def _empty(req: ollama.Request, is_generate: bool, unload: bool) -> Any:
    """Nothing to generate (Ollama's idiom to load or unload a model): the model is resolved
    as for any request (404, 403 outside the key's scopes), nothing is loaded, and the admin's
    ``keep_alive: 0`` unloads it."""
    model = req.chat.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("'model' is required", "model", "missing_required")
    st = state()
    t = pipeline.resolve(st, model, Kind.COMPLETION if req.raw else Kind.CHAT, req.chat)
    if unload:
        _unload(t.entry.name)
    out = ollama.empty_answer(model, is_generate, unload)
    if req.stream:
        return Response(ollama.line(out), mimetype=NDJSON)
    return jsonify(out)


class _Lines:
    """Ollama's NDJSON stream as a ``stream.Dialect``. A keep-alive is an object with no
    text (NDJSON has no comment lines, and Ollama's clients parse every line)."""

    def __init__(self, lines: ollama.Lines, after: Callable[[], None] | None) -> None:
        self._lines = lines
        self._after = after

    def start(self) -> str:
        return ""

    def chunk(self, chunk: Any) -> str:
        return "".join(map(ollama.line, self._lines.feed(chunk)))

    def keepalive(self) -> str:
        return ollama.line(self._lines.keepalive())

    def loading(self, step: Loading) -> str:
        # The model's load as an empty-content object with a ``status`` (as Ollama's own
        # progress lines name what they do).
        return ollama.line({**self._lines.keepalive(), "status": stream.loading_text(step)})

    def end(self) -> str:
        out = "".join(map(ollama.line, self._lines.end(time.monotonic_ns())))
        if self._after is not None:
            self._after()
        return out

    def fail(self, error: ApiError) -> str:
        return ollama.line(ollama.error_body(error))


# --- embeddings -------------------------------------------------------------------------------


def _embed(model: Any, inputs: Any, param: str, body: dict[str, Any]) -> dict[str, Any]:
    """The embeddings of ``inputs`` as the OpenAI embeddings answer, the same way as
    ``/v1/embeddings`` (scopes, quotas, queue)."""
    ignored = [k for k in body if k not in ("model", "input", "prompt", "truncate")]
    if body.get("truncate") is not None:
        ignored.append("truncate")
    pipeline.ignore(ignored)
    try:
        v = validation.validate_embedding({"model": model, "input": inputs})
    except ApiError as e:
        if param == "input" or e.param is None or not e.param.startswith("input"):
            raise
        named = param + e.param[len("input") :]
        raise ApiError(
            e.status, e.message.replace(f"'{e.param}'", f"'{named}'"), param=named, code=e.code
        ) from None
    st = state()
    t = pipeline.resolve(st, v.model, Kind.EMBEDDING, body)
    pipeline.admit_target(st, t, Kind.EMBEDDING, v)
    if t.entry.spec.remote:
        return pipeline.forward(
            t, "/embeddings", {"model": v.model, "input": v.params["input"]}, v
        ).json()
    return pipeline.submit(st, Kind.EMBEDDING, v, t).result()


@bp.post("/embed")
def embed() -> Any:
    started = time.monotonic_ns()

    def run() -> Any:
        body = read_json()
        out = _embed(body.get("model"), body.get("input"), "input", body)
        usage = out.get("usage") or {}
        return jsonify(
            {
                "model": body["model"],
                "embeddings": [d.get("embedding") for d in out.get("data", [])],
                "total_duration": time.monotonic_ns() - started,
                "load_duration": 0,
                "prompt_eval_count": int(usage.get("prompt_tokens") or 0),
            }
        )

    return pipeline.admitted(run)


@bp.post("/embeddings")
def embeddings() -> Any:
    def run() -> Any:
        body = read_json()
        out = _embed(body.get("model"), body.get("prompt"), "prompt", body)
        data = out.get("data") or [{}]
        return jsonify({"embedding": data[0].get("embedding") or []})

    return pipeline.admitted(run)


# --- models -----------------------------------------------------------------------------------


@bp.get("/tags")
def tags() -> Any:
    st = state()
    caller = auth.principal()
    entries = sorted(
        (e for e in all_entries(st.r).values() if caller.may_use_model(e.name)),
        key=lambda e: e.name,
    )
    models = [ollama_models.tag(e) for e in entries]
    for name, p in sorted(policy_store.all_entries(st.r).items()):
        candidates = [c for c in p.spec.get("candidates", []) if caller.may_use_model(str(c))]
        if caller.may_use_policy(name) and candidates:
            models.append(ollama_models.policy_tag(name))
    return jsonify({"models": models})


@bp.post("/show")
def show() -> Any:
    body = read_json()
    name = body.get("model") if body.get("model") is not None else body.get("name")
    if not isinstance(name, str) or not name:
        raise errors.bad_request("'model' is required", "model", "missing_required")
    _view, entry, policy = state().lookup(name)
    caller = auth.principal()
    if policy is not None and entry is None:
        if not caller.may_use_policy(name):
            raise pipeline.not_allowed(name)
        raise errors.bad_request(
            f"'{name}' is a policy: it routes each request to one of its models", "model"
        )
    if entry is None:
        raise errors.model_not_found(name)
    if not caller.may_use_model(name):
        raise pipeline.not_allowed(name)
    return jsonify(ollama_models.show(entry))


@bp.get("/ps")
def ps() -> Any:
    st = state()
    caller = auth.principal()
    entries = sorted(
        (
            e
            for e in all_entries(st.r).values()
            if caller.may_use_model(e.name) and not e.spec.remote
        ),
        key=lambda e: e.name,
    )
    pipe = st.r.pipeline(transaction=False)
    for e in entries:
        pipe.hgetall(keys.model(e.name))
    now = time.time()
    models = [
        ollama_models.running(e, dict(fields), now)
        for e, fields in zip(entries, pipe.execute(), strict=True)
        if fields and fields.get("state") == "ready"
    ]
    return jsonify({"models": models})


@bp.get("/version")
def version() -> Any:
    return jsonify({"version": ollama.VERSION})


@bp.post("/pull")
def pull() -> Any:
    raise ApiError(
        501,
        "pulling models through the Ollama API is not served by this box: an admin pulls them "
        "(`residency pull SOURCE`, or POST /admin/pulls with the admin token)",
        code="not_implemented",
    )
