"""The admin API: live config, model registry, explicit residency control, audit, faults.

Every call needs ``Authorization: Bearer <admin key>``. Changes are written through
``ConfigStore`` and ``residency.registry`` (each one MULTI with its generation bump, audit record
and coordinator event) and answered at once; enforcement is the coordinator's job.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flask import Blueprint, Response, g, jsonify, request
from pydantic import ValidationError

from residency import errors, keys, policies, policy_store, registry, usage
from residency.box import ConfigStore, NameTaken, audit, commit_change
from residency.errors import ApiError
from residency.messages import Event, EventType
from residency.pool import fit, snapshot
from residency.settings import (
    ModelSpec,
    SettingsError,
    check_model_name,
    validate_patch,
)
from web import auth, routing
from web.body import read_json
from web.faults import parse_faults
from web.responses import settings_error
from web.state import state

bp = Blueprint("admin", __name__, url_prefix="/admin")

_MODEL_FIELDS = ("state", "host", "device", "pid")
AUDIT_DEFAULT = 100


@bp.before_request
def _auth() -> None:
    # The admin key (the token named "default") or a named admin token, by bearer only.
    header = request.headers.get("Authorization") or ""
    scheme, _, token = header.partition(" ")
    name = None
    if scheme.lower() == "bearer" and token.strip():
        name = auth.admin_token_name(state(), token.strip())
    if name is None:
        raise ApiError(
            401,
            "admin API: send 'Authorization: Bearer <admin key or admin token>'",
            type="authentication_error",
            code="invalid_admin_key",
        )
    g.admin = name


def _actor() -> str:
    """Who made a change, for the audit log: the admin token's name."""
    return f"admin:{g.get('admin') or '-'}"


def _changed(generation: int) -> int:
    # Refresh this worker's cache now, so its next request already sees the change.
    state().refresh()
    return generation


# --- config -----------------------------------------------------------------------------------


@bp.get("/config")
def get_config() -> Any:
    st = state()
    view = st.refresh()
    return jsonify(
        {
            "config": view.settings.model_dump(exclude={"models", "policies"}),
            "sources": view.sources,
            # The pass generation, comparable with /health's (as every change's answer is).
            "generation": int(st.r.get(keys.generation()) or 0),
            "config_error": st.config_error(),
        }
    )


@bp.patch("/config")
def patch_config() -> Any:
    st = state()
    body = read_json()
    current = st.refresh().settings
    try:
        flat = validate_patch(current, body)
    except SettingsError as e:
        return settings_error(e)
    gen = _changed(ConfigStore(st.box, st.r).apply_patch(flat, _actor()))
    return jsonify({"updated": flat, "generation": gen})


# --- models -----------------------------------------------------------------------------------


def _residency(raw: list[Any]) -> dict[str, Any]:
    out = dict(zip(_MODEL_FIELDS, raw, strict=True))
    out["state"] = out["state"] or "unloaded"
    if out["pid"]:
        out["pid"] = int(out["pid"])
    return out


def _with_residency(entries: list[registry.Entry]) -> list[dict[str, Any]]:
    pipe = state().r.pipeline(transaction=False)
    for e in entries:
        pipe.hmget(keys.model(e.name), list(_MODEL_FIELDS))
    return [
        {**e.public(), **_residency(raw)} for e, raw in zip(entries, pipe.execute(), strict=True)
    ]


def _entry(name: str) -> registry.Entry:
    entry = registry.get(state().r, name)
    if entry is None:
        raise errors.model_not_found(name)
    return entry


@bp.get("/models")
def list_models() -> Any:
    entries = sorted(registry.all_entries(state().r).values(), key=lambda e: e.name)
    return jsonify({"models": _with_residency(entries)})


@bp.get("/models/<name>")
def get_model(name: str) -> Any:
    return jsonify(_with_residency([_entry(name)])[0])


def _spec_error(e: ValidationError) -> ApiError:
    problems: dict[str, str] = {}
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        problems[loc or "(body)"] = msg.removeprefix("Value error, ")
    first = next(iter(problems))
    message = "invalid model: " + "; ".join(f"{k}: {v}" for k, v in problems.items())
    return errors.bad_request(message, None if first == "(body)" else first, "invalid_model")


@bp.put("/models/<name>")
def put_model(name: str) -> Any:
    st = state()
    try:
        check_model_name(name)
    except ValueError as e:
        raise errors.bad_request(str(e), "name", "invalid_model_name") from None
    body = read_json()
    try:
        spec = ModelSpec.model_validate(body)
    except ValidationError as e:
        raise _spec_error(e) from None
    s = st.refresh().settings
    dirs = registry.model_dirs(st.box.models_dir, s)
    # The model file and its projector both lie in the model directories, resolved.
    for field, what in (("path", "model"), ("mmproj", "projector")):
        given = getattr(spec, field)
        if given is not None:
            spec = spec.model_copy(update={field: _model_file(given, dirs, field, what)})
    existed = registry.get(st.r, name) is not None
    entry = registry.Entry(name, spec, "admin")
    try:
        gen = _changed(registry.put(st.r, entry, _actor()))
    except NameTaken:
        raise _name_taken(name, "policy") from None
    return _stored("model", entry.public(), gen, existed)


def _model_file(path: str, dirs: list[Path], field: str, what: str) -> str:
    """``path`` resolved inside the model directories ``dirs``, or the 400 naming ``field``."""
    try:
        resolved = registry.check_path(path, dirs)
    except registry.PathNotAllowed as e:
        raise errors.bad_request(str(e), field, "path_not_allowed") from None
    if not Path(resolved).is_file():
        raise errors.bad_request(f"no {what} file at {resolved}", field, "path_not_found")
    return resolved


def _stored(kind: str, public: dict[str, Any], generation: int, existed: bool) -> Response:
    resp = jsonify({kind: public, "generation": generation})
    resp.status_code = 200 if existed else 201
    return resp


def _name_taken(name: str, other: str) -> ApiError:
    return errors.bad_request(f"'{name}' is the name of a {other}", "name", "name_taken")


def _defined_in_file(kind: str, name: str) -> ApiError:
    return ApiError(
        409,
        f"{kind} '{name}' is defined in the config file; remove it there",
        type="conflict_error",
        param="name",
        code="defined_in_file",
    )


@bp.delete("/models/<name>")
def delete_model(name: str) -> Any:
    st = state()
    entry = _entry(name)
    if entry.source == "file":
        raise _defined_in_file("model", name)
    gen = _changed(registry.delete(st.r, name, _actor()))
    return jsonify({"deleted": name, "generation": gen})


@bp.delete("/cache")
def clear_cache() -> Any:
    """Empty the saved slot caches (``?model=``: of one model). Answered at once: from now on no
    entry saved before is restored, and each host's agent deletes them at its next heartbeat."""
    st = state()
    model = request.args.get("model") or None
    if model is not None:
        _entry(model)
    every = () if model else registry.all_entries(st.r)

    def op(p: Any) -> None:
        registry.clear_slot_caches(p, model, every)

    gen = _changed(commit_change(st.r, _actor(), "cache.clear", {"model": model or "*"}, op))
    return jsonify({"cleared": model or "*", "generation": gen})


def _request_residency(name: str, what: str) -> Response:
    """Record the wish in the ``explicit`` hash (it survives a coordinator restart) and wake the
    coordinator; it carries the wish out under the pool rules and then clears it."""
    st = state()
    _entry(name)
    pipe = st.r.pipeline(transaction=True)
    pipe.hset(keys.explicit(), name, what)
    if what == "load":
        pipe.delete(keys.load_failures(name))  # an explicit load ends a crash-loop backoff
    pipe.rpush(keys.events(), json.dumps(Event(EventType.CONFIG, name, {what: True}).to_dict()))
    audit(pipe, _actor(), f"model.{what}", {"name": name})
    pipe.execute()
    resp = jsonify({"model": name, "requested": what})
    resp.status_code = 202
    return resp


@bp.post("/models/<name>/load")
def load_model(name: str) -> Any:
    return _request_residency(name, "load")


@bp.post("/models/<name>/unload")
def unload_model(name: str) -> Any:
    return _request_residency(name, "unload")


@bp.post("/models/<name>/fit")
def fit_model(name: str) -> Any:
    """Would the model fit now, where, and what would be evicted for it: the coordinator's own
    decisions over the pool as it is, played forward without doing anything."""
    st = state()
    entry = _entry(name)
    if entry.spec.remote:
        raise errors.bad_request(f"'{name}' is a remote model: it is never loaded", "name")
    rd = snapshot.read(st.r, st.refresh().settings, time.time())
    return jsonify(fit.fit(rd.snap, name))


@bp.post("/models/<name>/pin")
def pin_model(name: str) -> Any:
    st = state()
    body = read_json()
    pinned = body.get("pinned")
    if not isinstance(pinned, bool):
        raise errors.bad_request("'pinned' must be a boolean", "pinned")
    try:
        gen = _changed(registry.set_pinned(st.r, name, pinned, _actor()))
    except registry.Missing:
        raise errors.model_not_found(name) from None
    return jsonify({"model": name, "pinned": pinned, "generation": gen})


# --- policies ---------------------------------------------------------------------------------


def _policy_problems(e: policies.PolicyError, what: str) -> ApiError:
    first = next(iter(e.problems), None)
    message = f"invalid {what}: " + "; ".join(f"{k}: {v}" for k, v in e.problems.items())
    err = errors.bad_request(message, first, "invalid_policy")
    return err


def _parse(name: str, body: Any) -> policies.Policy:
    if not isinstance(body, dict):
        raise errors.bad_request("expected a policy object", None, "invalid_policy")
    infos = policy_store.model_infos(registry.all_entries(state().r))
    try:
        return policies.parse_policy(name, body, infos)
    except policies.PolicyError as e:
        raise _policy_problems(e, f"policy '{name}'") from None


def _policy_entry(name: str, param: str = "name") -> policy_store.PolicyEntry:
    entry = policy_store.get(state().r, name)
    if entry is None:
        raise ApiError(404, f"no policy '{name}'", param=param, code="policy_not_found")
    return entry


@bp.get("/policies")
def list_policies() -> Any:
    entries = policy_store.all_entries(state().r)
    return jsonify({"policies": [e.public() for _, e in sorted(entries.items())]})


@bp.get("/policies/<name>")
def get_policy(name: str) -> Any:
    return jsonify(_policy_entry(name).public())


@bp.put("/policies/<name>")
def put_policy(name: str) -> Any:
    st = state()
    body = read_json()
    _parse(name, body)
    existed = policy_store.get(st.r, name) is not None
    entry = policy_store.PolicyEntry(name, body, "admin")
    try:
        gen = _changed(policy_store.put(st.r, entry, _actor()))
    except NameTaken:
        raise _name_taken(name, "model") from None
    return _stored("policy", entry.public(), gen, existed)


@bp.delete("/policies/<name>")
def delete_policy(name: str) -> Any:
    st = state()
    entry = _policy_entry(name)
    if entry.source == "file":
        raise _defined_in_file("policy", name)
    gen = _changed(policy_store.delete(st.r, name, _actor()))
    return jsonify({"deleted": name, "generation": gen})


@bp.post("/policies/validate")
def validate_policy() -> Any:
    """The decision and trace for a sample request, without serving it: ``{"policy": name or
    an inline policy object, "request": a chat body (messages, tools, metadata)}``."""
    st = state()
    body = read_json()
    ref = body.get("policy")
    if isinstance(ref, str):
        name, policy = ref, _parse(ref, _policy_entry(ref, "policy").spec)
    elif isinstance(ref, dict):
        name, policy = "(inline)", _parse("inline", ref)
    else:
        raise errors.bad_request("'policy' must be a policy name or object", "policy")
    sample = body.get("request")
    if not isinstance(sample, dict):
        raise errors.bad_request("'request' must be a chat completion body", "request")
    inp = policies.RoutingInput.from_chat(sample)
    s = st.refresh().settings
    decision = routing.decide(st, s, name, policy, inp)
    # The choice among the listed candidates as the pool stands now (read, nothing recorded).
    routed = routing.choose(st, s, name, policy, decision, sample, caller=auth.principal())
    decision = routed.decision
    return jsonify(
        {
            "policy": name,
            "candidate": decision.candidate,
            "rule": decision.rule,
            "used_default": decision.used_default,
            "listed": list(decision.listed),
            "trace": decision.trace,
        }
    )


# --- audit ------------------------------------------------------------------------------------


@bp.get("/audit")
def get_audit() -> Any:
    raw = request.args.get("limit", str(AUDIT_DEFAULT))
    try:
        limit = int(raw)
    except ValueError:
        raise errors.bad_request("'limit' must be an integer", "limit") from None
    if not 1 <= limit <= keys.AUDIT_MAX:
        raise errors.bad_request(f"'limit' must be between 1 and {keys.AUDIT_MAX}", "limit")
    rows = state().r.lrange(keys.audit(), 0, limit - 1)
    return jsonify({"audit": [json.loads(x) for x in rows]})


# --- faults -----------------------------------------------------------------------------------


def _faults_enabled() -> None:
    # Answer exactly like an unknown path, so a production box does not advertise the drill.
    if not state().refresh().settings.debug.fault_injection:
        raise ApiError(404, f"unknown path: {request.method} {request.path}", code="not_found")


@bp.get("/faults")
def get_faults() -> Any:
    _faults_enabled()
    return jsonify({"faults": state().r.hgetall(keys.faults())})


@bp.post("/faults")
def post_faults() -> Any:
    _faults_enabled()
    st = state()
    put, drop = parse_faults(read_json())
    pipe = st.r.pipeline(transaction=True)
    if put:
        pipe.hset(keys.faults(), mapping=put)  # type: ignore[arg-type]
    if drop:
        pipe.hdel(keys.faults(), *drop)
    audit(pipe, _actor(), "faults", {"set": put, "deleted": drop})
    pipe.hgetall(keys.faults())
    return jsonify({"faults": pipe.execute()[-1]})


# --- usage ------------------------------------------------------------------------------------


@bp.get("/usage")
def get_usage() -> Any:
    """What was used, per user, per model and per UTC day: ``from`` and ``to`` (YYYY-MM-DD,
    both included; default today), ``user`` (``-`` = anonymous callers), ``model``."""
    args = request.args
    today = datetime.now(UTC).date()
    try:
        span = usage.parse_range(args.get("from") or None, args.get("to") or None, today)
    except usage.RangeError as e:
        raise errors.bad_request(str(e), e.param, "invalid_date") from None
    rep = usage.report(
        state().r, span, user=args.get("user") or None, model=args.get("model") or None
    )
    return jsonify(rep)
