"""The OpenAI-compatible API: chat completions, completions, embeddings and the model list."""

from __future__ import annotations

import base64
import json
import logging
import select
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from flask import Blueprint, Response, g, jsonify, make_response, request

from residency import errors, keys, policy_store
from residency.auth import Principal
from residency.errors import ApiError
from residency.messages import Kind
from residency.policy_store import PolicyEntry
from residency.registry import Entry, all_entries
from residency.settings import ModelSpec
from web import admission, auth, bus, quota, remote, routing, validation
from web.body import check_size, read_json
from web.state import State, View, state

log = logging.getLogger(__name__)

bp = Blueprint("openai", __name__, url_prefix="/v1")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The metric label of every request that named no registered model or policy. Labels come only
# from registered names: a label per name a client made up would let anyone grow /metrics
# without bound. Registered names start with a letter or digit, so this one is never taken.
UNKNOWN_LABEL = "_unknown_"


@bp.after_request
def _count(resp: Response) -> Response:
    if request.method == "POST":
        bus.REQUESTS.labels(g.get("model_label", UNKNOWN_LABEL), str(resp.status_code)).inc()
    return resp


@dataclass
class Target:
    """Where one request goes: a registered model, reached directly or through a policy."""

    entry: Entry
    view: View
    route: str | None = None  # the x-residency-route header value
    trace: dict[str, Any] | None = None
    admitted: bool = False  # admitted against its caller's quotas before it was routed


#: The model type each request kind needs (any other kind: "llm"), and what it is called.
_SERVED_BY = {Kind.EMBEDDING: ("embedding", "embeddings"), Kind.RERANK: ("rerank", "reranking")}


def _check_type(entry: Entry, kind: Kind, param: str = "model") -> None:
    want, what = _SERVED_BY.get(kind, ("llm", "text generation"))
    if entry.spec.type != want:
        raise errors.bad_request(
            f"model '{entry.name}' is of type '{entry.spec.type}' and cannot serve {what}",
            param,
            "wrong_model_type",
        )


def _resolve(
    st: State,
    model: str,
    kind: Kind,
    body: Mapping[str, Any],
    v: validation.Validated | None = None,
) -> Target:
    """The registry entry to serve ``model`` (404 when unknown, 400 for the wrong type); a
    policy name is routed to one of its candidates first. With ``v`` (a generation request),
    a policy's request is admitted against its caller's quotas before it is routed (its
    routing helpers generate only for an admitted request, and within its deadline), and its
    Target says so (``admitted``); otherwise the caller admits it (``_quota``)."""
    view, entry, policy = st.lookup(model)
    if entry is not None or policy is not None:
        g.model_label = model
    check_size(view.settings.server.max_request_bytes)
    caller = auth.principal()
    if policy is not None and kind not in _SERVED_BY:  # policies route llm requests only
        if not caller.may_use_policy(model):
            raise not_allowed(model)
        if v is not None:
            _admit(st, view, model, kind, v, cap=_policy_cap(st, policy), may_load=False)
        decision = routing.route(
            st,
            view.settings,
            policy,
            kind,
            body,
            caller=caller,
            deadline_at=g.get("deadline_at", 0.0),
        )
        _view, entry, _ = st.lookup(decision.candidate)
        if entry is None:
            raise ApiError(
                503,
                f"policy '{model}' chose '{decision.candidate}', which is not registered",
                type="server_error",
                code="candidate_missing",
                retry_after=5,
            )
        if not caller.may_use_model(entry.name):
            raise not_allowed(entry.name, via=model)
        _check_type(entry, kind)
        if v is not None and not entry.spec.remote:
            # Admitted before the candidate was known: its load-seconds quota is checked now.
            quota.admit_load(st.r, st.scripts, quota.principal(), entry.name)
        header = routing.route_header(model, decision)
        return Target(entry, view, header, decision.trace, admitted=v is not None)
    if entry is None:
        raise errors.model_not_found(model)
    if not caller.may_use_model(model):
        raise not_allowed(model)
    _check_type(entry, kind)
    return Target(entry, view)


def _policy_cap(st: State, policy: PolicyEntry) -> int:
    """The largest token cap among a policy's registered candidates: what a request that names
    no ``max_tokens`` reserves before it is routed."""
    names = [str(c) for c in policy.spec.get("candidates", [])]
    raws = st.r.hmget(keys.registry(), names) if names else []
    caps = [
        Entry.loads(n, str(raw)).spec.token_cap for n, raw in zip(names, raws, strict=True) if raw
    ]
    return max(caps, default=int(ModelSpec.model_fields["n_ctx"].default))


def not_allowed(name: str, via: str | None = None) -> ApiError:
    """403 for a model (or policy) outside the caller's API key scopes."""
    how = f"policy '{via}' routed this request to '{name}', which" if via else f"'{name}'"
    return ApiError(
        403,
        f"{how} is not among the models this API key may use",
        type="permission_error",
        param="model",
        code="model_not_allowed",
    )


#: What llama.cpp generates for a completion that names no max_tokens (OpenAI's default for
#: /v1/completions too); a chat without one gets the model's cap.
COMPLETION_DEFAULT_TOKENS = 16


def capped_params(kind: Kind, params: dict[str, Any], cap: int) -> dict[str, Any]:
    """``params`` with ``max_tokens`` bounded by the model's cap (``[models.X] max_tokens``,
    default its n_ctx): a larger value is clamped to it (OpenAI-style clients send large
    values), and a request without one gets the cap (a chat) or the completions default
    bounded by the cap, so every generation is bounded."""
    if kind in _SERVED_BY:  # nothing is generated
        return params
    asked = params.get("max_tokens")
    if asked is None:
        asked = COMPLETION_DEFAULT_TOKENS if kind is Kind.COMPLETION else cap
    return {**params, "max_tokens": min(int(asked), cap)}


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the client closed its end of the connection (it sends nothing more on a
    connection whose request was read: readable means closed, or a pipelined request). ``poll``
    with no timeout never blocks, so it is safe under gevent too; ``select`` would refuse the
    descriptors above 1023 that a worker holding a thousand clients has."""
    try:
        fd = sock.fileno()
    except (OSError, ValueError):
        return True
    if fd < 0:
        return True
    poller = select.poll()
    rdhup = getattr(select, "POLLRDHUP", 0)  # Linux: the peer shut down its side
    poller.register(fd, select.POLLIN | rdhup)
    for _fd, ev in poller.poll(0):
        if ev & (rdhup | select.POLLHUP | select.POLLERR | select.POLLNVAL):
            return True
        if ev & select.POLLIN:
            try:
                return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except (OSError, ValueError):
                return False  # e.g. a TLS socket refuses MSG_PEEK: no verdict
    return False


def _client_gone() -> Callable[[], bool] | None:
    """A check of this request's client connection, when the server exposes its socket
    (gunicorn and werkzeug do)."""
    sock = request.environ.get("gunicorn.socket") or request.environ.get("werkzeug.socket")
    if not isinstance(sock, socket.socket):
        return None
    return lambda: _peer_closed(sock)


def _max_tokens(kind: Kind, params: Mapping[str, Any], cap: int) -> int | None:
    """The most tokens a request may generate (None: it generates nothing)."""
    if kind in _SERVED_BY:
        return None
    return int(capped_params(kind, dict(params), cap)["max_tokens"])


def _admit(
    st: State,
    view: View,
    model: str,
    kind: Kind,
    v: validation.Validated | None,
    *,
    cap: int,
    may_load: bool,
) -> None:
    """Admit the request against its caller's quotas (429 ``quota_exceeded`` when over one),
    reserving the most tokens it may use; what it takes is given back by ``_admitted`` when
    the request ends. Its deadline starts here (``g.deadline_at``)."""
    srv = view.settings.server
    params = v.params if v is not None else {}
    now = time.time()
    if srv.request_deadline_s:
        g.deadline_at = now + srv.request_deadline_s
    ticket = quota.admit(
        st.r,
        st.scripts,
        quota.principal(),
        model,
        hold_s=srv.request_deadline_s or srv.request_timeout_s,
        may_load=may_load,
        reserve=quota.reservation(params, _max_tokens(kind, params, cap)),
        now=now,
    )
    if ticket is not None:
        g.quota_ticket = ticket


def _quota(st: State, t: Target, kind: Kind, v: validation.Validated | None = None) -> None:
    """Admit a request for ``t`` (see ``_admit``), unless it was admitted before its routing."""
    if not t.admitted:
        spec = t.entry.spec
        _admit(st, t.view, t.entry.name, kind, v, cap=spec.token_cap, may_load=not spec.remote)


def _charge_remote(t: Target) -> Callable[[remote.Usage], None]:
    """What a request to a remote model used, counted for its caller (see ``quota.charge``)."""
    caller, scripts = quota.principal(), state().scripts
    return lambda usage: quota.charge(scripts, caller, t.entry.name, usage)


def _forward(
    t: Target, path: str, body: Mapping[str, Any], v: validation.Validated
) -> remote.Forwarded:
    """Send the request to ``t``'s remote upstream, its usage counted for its caller."""
    return remote.forward(
        t.entry.name,
        t.entry.spec,
        path,
        body,
        t.view.settings.server,
        on_usage=_charge_remote(t),
        prompt_estimate=quota.prompt_bytes(v.params),
    )


def _release_quota() -> None:
    ticket = g.pop("quota_ticket", None)
    if ticket is not None:
        ticket.release(state().scripts)


def _submit(st: State, kind: Kind, v: validation.Validated, t: Target) -> bus.Call:
    srv, pool = t.view.settings.server, t.view.settings.pool
    caller = quota.principal()
    call = bus.submit(
        st.r,
        st.scripts,
        kind=kind,
        model=t.entry.name,
        params=capped_params(kind, v.params, t.entry.spec.token_cap),
        stream=v.stream,
        bound=pool.max_queue_per_model,
        timeout_s=srv.request_timeout_s,
        deadline_s=srv.request_deadline_s,
        deadline_at=g.get("deadline_at", 0.0),
        client_gone=_client_gone(),
        keepalive_s=srv.sse_keepalive_s if v.stream else 0.0,
        fair=pool.fair_queues,
        user=caller.user,
        key=caller.key_id or "",
        may_load=caller.may_load,
        weight=caller.weight,
        cache_scope=t.view.settings.cache.scope,
    )
    place = g.get("in_flight_place")
    if isinstance(place, admission.Place):
        place.call = call  # from now on it can make room for another user's (see _admitted)
    return call


def _push_out(place: admission.Place, error: ApiError) -> bool:
    """Push the queued request of another request's place out of its model's queue with
    ``error`` (False once a model process took it: it is served, not pushed out)."""
    call = place.call
    return isinstance(call, bus.Call) and call.push_out(error)


def _named(obj: dict[str, Any], model: str) -> dict[str, Any]:
    # llama.cpp reports the GGUF path as the model; clients expect the name they asked for.
    if "model" in obj:
        obj["model"] = model
    return obj


def _sse(obj: Mapping[str, Any]) -> str:
    if obj is bus.KEEPALIVE:
        # A comment line: clients ignore it, proxies with idle timeouts see traffic.
        return ": keep-alive\n\n"
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


_DONE = "data: [DONE]\n\n"


def _stream_response(
    batches: Iterator[bus.Batch], model: str, on_abandon: Callable[[], None] | None, t: Target
) -> Response:
    # Pull the first batch before answering, so that an error that happens before any output
    # (queue full, load failed, timeout) reaches the client as a proper HTTP status — unless
    # the wait outlasts the keep-alive interval: then the stream starts with a comment line,
    # and an error after it comes as an error event. Each batch goes out in one write (one
    # HTTP chunk), the end of the stream with the last one.
    first = next(batches, None)

    def render(b: bus.Batch, trace: dict[str, Any] | None = None) -> str:
        out = []
        for c in b.chunks:
            if c is not bus.KEEPALIVE:
                c = _named(c, model)
                if trace is not None:
                    c["route_trace"], trace = trace, None
            out.append(_sse(c))
        if b.last:
            out.append(_DONE)
        return "".join(out)

    def events() -> Iterator[str]:
        if first is None:
            yield _DONE
        else:
            yield render(first, t.trace)
            done = first.last
            try:
                for b in batches:
                    yield render(b)
                    done = b.last
            except ApiError as e:
                yield _sse(e.envelope())
            if not done:
                yield _DONE

    body = abandon_on_exit(events(), batches, on_abandon)
    return Response(body, mimetype="text/event-stream", headers=_headers(t, SSE_HEADERS))


def abandon_on_exit(
    body: Iterator[str], batches: Iterator[Any], on_abandon: Callable[[], None] | None
) -> Iterator[str]:
    """A stream's body that stops its generation when it does not end normally: its client
    went away (the WSGI server closes it: GeneratorExit) or it failed — ``batches`` is closed
    and ``on_abandon`` called (withdraw the request, or close a remote's stream)."""
    finished = False
    try:
        yield from body
        finished = True
    finally:
        if not finished:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
            if on_abandon is not None:
                on_abandon()


def _headers(t: Target, base: Mapping[str, str] | None = None) -> dict[str, str]:
    out = dict(base or {})
    if t.route is not None:
        out["x-residency-route"] = t.route
    return out


def _route_trace_wanted(body: dict[str, Any]) -> bool:
    want = body.pop("route_trace", False)
    if not isinstance(want, bool):
        raise errors.bad_request("'route_trace' must be a boolean", "route_trace")
    return want


class _Held:
    """A stream's body that holds its in-flight place until it ends or is closed (a WSGI
    server closes the body when the client leaves, even one never iterated: a generator's
    ``finally`` would not run then)."""

    def __init__(
        self,
        body: Iterable[Any],
        place: admission.Place,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._it = iter(body)
        self._body = body
        self._place = place
        self._released = False
        self._release = release  # the request's place in its caller's quota, if it took one

    def __iter__(self) -> _Held:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self.close()
            raise

    def close(self) -> None:
        # The body first: closing it ends what it streams (a remote's stream counts its usage
        # then), before the request's quota places and reservation are given back.
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            if not self._released:
                self._released = True
                admission.IN_FLIGHT.release(self._place)
                if self._release is not None:
                    self._release()


def _admitted(view: Callable[[], Any]) -> Any:
    """Run an API request counted in this worker's in-flight requests (429 past
    ``server.max_in_flight``, unless its user is within its share of them and another user's
    queued request makes room): a whole answer until the view returns it, a stream until its
    body ends or is closed."""
    cap = state().cached().settings.server.max_in_flight
    caller = auth.principal()
    place = admission.IN_FLIGHT.admit(cap, caller.user, caller.weight, push=_push_out)
    g.in_flight_place = place
    try:
        resp = make_response(view())
    except BaseException:
        admission.IN_FLIGHT.release(place)
        _release_quota()
        raise
    if resp.is_streamed:
        ticket = g.pop("quota_ticket", None)
        scripts = state().scripts
        release = None if ticket is None else (lambda: ticket.release(scripts))
        resp.response = _Held(resp.response, place, release)
    else:
        admission.IN_FLIGHT.release(place)
        _release_quota()
    return resp


def _generate(
    kind: Kind, path: str, validate: Callable[[Mapping[str, Any]], validation.Validated]
) -> Any:
    return _admitted(lambda: _generate_admitted(kind, path, validate))


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
    d = dispatch(kind, path, v, body)
    t = d.target
    if not want_trace:
        t.trace = None
    if d.batches is not None:
        return _stream_response(d.batches, t.entry.name, d.abandon, t)
    assert d.result is not None
    out = d.result
    if t.trace is not None:
        out["route_trace"] = t.trace
    return jsonify(out), 200, _headers(t)


@dataclass
class Dispatched:
    """A generation request admitted and sent on (``dispatch``): a stream's batches and how
    to stop it, or a whole answer (named for the model that served it)."""

    target: Target
    result: dict[str, Any] | None = None
    batches: Iterator[bus.Batch] | None = None
    abandon: Callable[[], None] | None = None


def dispatch(
    kind: Kind,
    path: str,
    v: validation.Validated,
    body: Mapping[str, Any],
    *,
    submit_as: Kind | None = None,
) -> Dispatched:
    """Resolve ``v``'s model (a policy routes it; the key's scopes apply), admit it against
    its caller's quotas and send it on: to its remote upstream (``body``, at ``path``) or to
    its model's queue (as ``submit_as``, default ``kind``), then wait for a whole answer. The
    pipeline every generation API shares (chat, completions, Anthropic's messages); run it
    inside ``_admitted``, which gives back what it holds."""
    st = state()
    t = _resolve(st, v.model, kind, body, v)
    name = t.entry.name
    if t.entry.spec.remote and submit_as not in (None, kind):
        raise errors.bad_request(
            f"model '{name}' is served by a remote upstream: this request needs a local model",
            "model",
            "unsupported",
        )
    _quota(st, t, kind, v)
    if t.entry.spec.remote:
        fwd = _forward(t, path, body, v)
        if v.stream:
            return Dispatched(t, batches=(bus.Batch([e]) for e in fwd.events()), abandon=fwd.close)
        return Dispatched(t, result=_named(fwd.json(), name))
    call = _submit(st, submit_as or kind, v, t)
    if v.stream:
        return Dispatched(t, batches=call.batches(), abandon=call.abandon)
    return Dispatched(t, result=_named(call.result(), name))


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
    return _admitted(_embeddings)


def _embeddings() -> Any:
    body = read_json()
    v = validation.validate_embedding(body)
    st = state()
    t = _resolve(st, v.model, Kind.EMBEDDING, body)
    _quota(st, t, Kind.EMBEDDING, v)
    if t.entry.spec.remote:
        return jsonify(_named(_forward(t, "/embeddings", body, v).json(), v.model))
    out = _named(_submit(st, Kind.EMBEDDING, v, t).result(), v.model)
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
