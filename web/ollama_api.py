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

``/api/pull`` starts one of the box's own pulls (``POST /admin/pulls``), for the admin token
only, and streams its progress.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from flask import Blueprint, Response, jsonify

from residency import errors, keys, policy_store, pull_store
from residency.box import audit
from residency.errors import ApiError
from residency.messages import Event, EventType, Kind
from residency.pulls import FINISHED, SourceError
from residency.registry import all_entries
from web import admin_pulls, auth, ollama, ollama_models, pipeline, stream, validation
from web.body import read_json
from web.load_progress import Loading
from web.state import state

bp = Blueprint("ollama", __name__, url_prefix="/api")
bp.after_request(pipeline.count_request)

NDJSON = "application/x-ndjson"
#: How often a pull's progress is read for its client's stream.
PULL_POLL_S = 0.25
_FINISHED = frozenset(s.value for s in FINISHED)
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
    """Ollama's pull, onto the box's own pulls (``web.admin_pulls``): the admin token only (a
    pull writes a host's disk and registers a model every key may then be scoped to). The model
    is a Hugging Face GGUF repo as Ollama names one (``hf.co/ORG/REPO[:QUANT]``) or a GGUF URL;
    Ollama's own library names are not served here. Progress streams as Ollama's status lines
    (``total``/``completed`` bytes) unless ``stream`` is false, and the answer waits for the end."""
    if auth.principal().kind != "admin":
        raise ApiError(
            403,
            "pulling a model writes to a host's disk and registers it: only the admin token may",
            type="permission_error",
            code="admin_only",
        )
    body = read_json()
    model = body.get("model", body.get("name"))
    source = ollama.pull_source(model)
    pipeline.ignore([k for k in ("insecure", "username", "password") if k in body])
    try:
        record = admin_pulls.start_pull(source, None, None, None, False, via="ollama")
    except SourceError as e:
        raise ApiError(400, str(e), param="model", code="invalid_source") from None
    r = state().r
    wait_s = state().refresh().settings.server.request_timeout_s
    lines = _pull_lines(r, record["id"], time.monotonic() + wait_s)
    if body.get("stream", True) is False:
        last: dict[str, Any] = {}
        for line in lines:
            last = line
        if "error" in last:
            raise ApiError(500, str(last["error"]), type="server_error", code="pull_failed")
        return jsonify(last)
    return Response(
        (json.dumps(line) + "\n" for line in lines),
        mimetype=NDJSON,
        headers={"Cache-Control": "no-cache"},
    )


def _pull_lines(r: Any, pull_id: str, deadline: float) -> Iterator[dict[str, Any]]:
    """A pull's progress as Ollama's status lines, until it ends (read from its record), or
    until ``deadline`` (``server.request_timeout_s``: a pull on a host that went away never
    ends, and its client must not wait for it forever); the pull itself goes on."""
    yield {"status": "pulling manifest"}
    sent: tuple[Any, ...] = ()
    whole = False  # a line with all the bytes was sent
    while True:
        raw = pull_store.get(r, pull_id)
        rec = pull_store.public(raw) if raw else {"state": "failed", "error": "the pull is gone"}
        line = ollama.pull_status(rec)
        if rec["state"] in ("verifying", "done") and not whole and rec.get("bytes_total"):
            # The download may end between two reads: its last bytes are shown all the same,
            # as Ollama's stream shows them, before the check and the success.
            whole = True
            total = rec["bytes_total"]
            yield {"status": f"pulling {rec.get('file')}", "total": total, "completed": total}
        key = tuple(sorted(line.items()))
        if key != sent:
            sent = key
            whole = whole or bool(line.get("total") and line.get("completed") == line["total"])
            yield line
        if rec["state"] in _FINISHED:
            return
        if time.monotonic() >= deadline:
            yield {
                "error": f"the pull goes on past this request's wait: see /admin/pulls/{pull_id}"
            }
            return
        time.sleep(PULL_POLL_S)
