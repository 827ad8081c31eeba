"""The pipeline every API shares, whatever its dialect: a request's model resolved (a policy
routes it; the key's scopes apply), admitted against the in-flight cap and its caller's quotas,
sent to its model's queue (or a remote upstream) and its answer or stream waited for; what it
held given back when it ends.

Each API module (``openai_api``, ``responses_api``, ``messages_api``, ``rerank_api``) is a
dialect over it: it translates its request into a validated chat, completion, embedding or
rerank request, calls ``admitted`` and ``dispatch`` (or the steps), and translates the answer
back (a stream through ``web.stream``).
"""

from __future__ import annotations

import logging
import re
import select
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from flask import Response, g, make_response, request

from residency import errors, vision
from residency.errors import ApiError
from residency.messages import Kind
from residency.registry import Entry
from residency.settings import ModelSpec
from web import (
    admission,
    auth,
    bus,
    image_fetch,
    image_inputs,
    load_progress,
    quota,
    remote,
    routing,
    validation,
)
from web.body import check_size
from web.state import State, View, state

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The metric label of every request that named no registered model or policy. Labels come only
# from registered names: a label per name a client made up would let anyone grow /metrics
# without bound. Registered names start with a letter or digit, so this one is never taken.
UNKNOWN_LABEL = "_unknown_"
#: The response header listing the request fields accepted and ignored (see ``ignore``).
IGNORED_HEADER = "x-residency-ignored"


def count_request(resp: Response) -> Response:
    """Count a generation API's answer in ``residency_requests_total`` (an ``after_request``
    hook of each API blueprint)."""
    if request.method == "POST":
        bus.REQUESTS.labels(g.get("model_label", UNKNOWN_LABEL), str(resp.status_code)).inc()
    return resp


#: What the header lists: a field's name as clients write them (a name from the request body
#: may hold anything: a newline would break the header), at most ``_MAX_IGNORED`` of them.
_FIELD_NAME = re.compile(r"[A-Za-z0-9_.\[\]() -]{1,64}")
_MAX_IGNORED = 16


def ignore(fields: Iterable[str]) -> None:
    """Record request fields that were accepted and change nothing here: they are named in the
    answer's ``x-residency-ignored`` header and the debug log, so a client can see that they
    did nothing."""
    names = [f if _FIELD_NAME.fullmatch(f) else "(a field with an odd name)" for f in fields]
    if not names:
        return
    # A dict keeps the order and finds a name in O(1): a body may name 100,000 fields.
    seen: dict[str, None] = g.setdefault("ignored_fields", {})
    seen.update(dict.fromkeys(names))
    log.debug("ignored request fields: %s", ", ".join(names[:_MAX_IGNORED]))


def ignored_header(resp: Response) -> Response:
    """Add the ``x-residency-ignored`` header (an app-wide ``after_request`` hook)."""
    seen = g.get("ignored_fields")
    if seen:
        more = len(seen) - _MAX_IGNORED
        listed = list(seen)[:_MAX_IGNORED] + ([f"and {more} more"] if more > 0 else [])
        resp.headers[IGNORED_HEADER] = ", ".join(listed)
    return resp


@dataclass
class Target:
    """Where one request goes: a registered model, reached directly or through a policy."""

    entry: Entry
    view: View
    route: str | None = None  # the x-residency-route header value
    trace: dict[str, Any] | None = None
    admitted: bool = False  # admitted against its caller's quotas before it was routed
    # Show its model's load as reasoning (``[models.X] show_loading``, or its policy's).
    show_loading: bool = False
    # A routed request's policy, rule and predicted wait (``messages.Request.route``).
    routed: dict[str, Any] | None = None


#: The model type each request kind needs (any other kind: "llm"), and what it is called.
_SERVED_BY = {Kind.EMBEDDING: ("embedding", "embeddings"), Kind.RERANK: ("rerank", "reranking")}


def check_type(entry: Entry, kind: Kind, param: str = "model") -> None:
    want, what = _SERVED_BY.get(kind, ("llm", "text generation"))
    if entry.spec.type != want:
        raise errors.bad_request(
            f"model '{entry.name}' is of type '{entry.spec.type}' and cannot serve {what}",
            param,
            "wrong_model_type",
        )


def resolve(
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
    Target says so (``admitted``); otherwise the caller admits it (``admit_target``)."""
    view, entry, policy = st.lookup(model)
    if entry is not None or policy is not None:
        g.model_label = model
    check_size(view.settings.server.max_request_bytes)
    caller = auth.principal()
    if policy is not None and kind not in _SERVED_BY:  # policies route llm requests only
        if not caller.may_use_policy(model):
            raise not_allowed(model)
        # The candidates' entries, read once: the reservation's cap and the router's choice.
        candidates = st.entries([str(c) for c in policy.spec.get("candidates", [])])
        if v is not None:
            admit(st, view, model, kind, v, cap=policy_cap(candidates), may_load=False)
        routed = routing.route(
            st,
            view.settings,
            policy,
            kind,
            body,
            caller=caller,
            deadline_at=g.get("deadline_at", 0.0),
            candidates=candidates,
        )
        decision = routed.decision
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
        check_type(entry, kind)
        if v is not None:
            vision.refuse_images(v.params, entry.name, entry.spec)
        if v is not None and not entry.spec.remote:
            # Admitted before the candidate was known: its load-seconds quota is checked now.
            quota.admit_load(st.r, st.scripts, quota.principal(), entry.name)
        header = routing.route_header(model, routed)
        show = policy.spec.get("show_loading")
        predicted = routed.prediction
        return Target(
            entry,
            view,
            header,
            decision.trace,
            admitted=v is not None,
            show_loading=entry.spec.show_loading if show is None else bool(show),
            # Travels with the request: its model process records the wait it predicted beside
            # the wait it had.
            routed={
                "policy": model,
                "rule": decision.rule,
                **(
                    {"predicted": predicted.terms()}
                    if predicted and predicted.wait_s is not None
                    else {}
                ),
            },
        )
    if entry is None:
        raise errors.model_not_found(model)
    if not caller.may_use_model(model):
        raise not_allowed(model)
    check_type(entry, kind)
    if v is not None:
        vision.refuse_images(v.params, entry.name, entry.spec)
    return Target(entry, view, show_loading=entry.spec.show_loading)


def policy_cap(candidates: Mapping[str, Entry]) -> int:
    """The largest token cap among a policy's registered candidates: what a request that names
    no ``max_tokens`` reserves before it is routed."""
    caps = [e.spec.token_cap for e in candidates.values()]
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


def peer_closed(sock: socket.socket) -> bool:
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


def client_gone() -> Callable[[], bool] | None:
    """A check of this request's client connection, when the server exposes its socket
    (gunicorn and werkzeug do)."""
    sock = request.environ.get("gunicorn.socket") or request.environ.get("werkzeug.socket")
    if not isinstance(sock, socket.socket):
        return None
    return lambda: peer_closed(sock)


def max_tokens(kind: Kind, params: Mapping[str, Any], cap: int) -> int | None:
    """The most tokens a request may generate (None: it generates nothing)."""
    if kind in _SERVED_BY or kind is Kind.TOKENIZE:
        return None
    return int(capped_params(kind, dict(params), cap)["max_tokens"])


def admit(
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
    reserving the most tokens it may use; what it takes is given back by ``admitted`` when
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
        reserve=quota.reservation(params, max_tokens(kind, params, cap)),
        now=now,
    )
    if ticket is not None:
        g.quota_ticket = ticket


def admit_target(st: State, t: Target, kind: Kind, v: validation.Validated | None = None) -> None:
    """Admit a request for ``t`` (see ``admit``), unless it was admitted before its routing."""
    if not t.admitted:
        spec = t.entry.spec
        admit(st, t.view, t.entry.name, kind, v, cap=spec.token_cap, may_load=not spec.remote)


def charge_remote(t: Target) -> Callable[[remote.Usage], None]:
    """What a request to a remote model used, counted for its caller (see ``quota.charge``)."""
    caller, scripts = quota.principal(), state().scripts
    return lambda usage: quota.charge(scripts, caller, t.entry.name, usage)


def forward(
    t: Target, path: str, body: Mapping[str, Any], v: validation.Validated
) -> remote.Forwarded:
    """Send the request to ``t``'s remote upstream, its usage counted for its caller."""
    return remote.forward(
        t.entry.name,
        t.entry.spec,
        path,
        body,
        t.view.settings.server,
        on_usage=charge_remote(t),
        prompt_estimate=quota.prompt_bytes(v.params),
    )


def release_quota() -> None:
    ticket = g.pop("quota_ticket", None)
    if ticket is not None:
        ticket.release(state().scripts)


def submit(st: State, kind: Kind, v: validation.Validated, t: Target) -> bus.Call:
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
        client_gone=client_gone(),
        keepalive_s=srv.sse_keepalive_s if v.stream else 0.0,
        fair=pool.fair_queues,
        user=caller.user,
        key=caller.key_id or "",
        may_load=caller.may_load,
        weight=caller.weight,
        cache_scope=t.view.settings.cache.scope,
        route=t.routed or {},
    )
    if v.stream:
        # Queued for this model (its scopes and quotas passed): it may see the model's load.
        call.watch_load = load_progress.Watch(st.r, t.entry.name)
    place = g.get("in_flight_place")
    if isinstance(place, admission.Place):
        place.call = call  # from now on it can make room for another user's (see _admitted)
    return call


def push_out(place: admission.Place, error: ApiError) -> bool:
    """Push the queued request of another request's place out of its model's queue with
    ``error`` (False once a model process took it: it is served, not pushed out)."""
    call = place.call
    return isinstance(call, bus.Call) and call.push_out(error)


def named(obj: dict[str, Any], model: str) -> dict[str, Any]:
    # llama.cpp reports the GGUF path as the model; clients expect the name they asked for.
    if "model" in obj:
        obj["model"] = model
    return obj


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


def headers(t: Target, base: Mapping[str, str] | None = None) -> dict[str, str]:
    out = dict(base or {})
    if t.route is not None:
        out["x-residency-route"] = t.route
    return out


class Held:
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

    def __iter__(self) -> Held:
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


def admitted(view: Callable[[], Any]) -> Any:
    """Run an API request counted in this worker's in-flight requests (429 past
    ``server.max_in_flight``, unless its user is within its share of them and another user's
    queued request makes room): a whole answer until the view returns it, a stream until its
    body ends or is closed."""
    cap = state().cached().settings.server.max_in_flight
    caller = auth.principal()
    place = admission.IN_FLIGHT.admit(cap, caller.user, caller.weight, push=push_out)
    g.in_flight_place = place
    try:
        resp = make_response(view())
    except BaseException:
        admission.IN_FLIGHT.release(place)
        release_quota()
        raise
    if resp.is_streamed:
        ticket = g.pop("quota_ticket", None)
        scripts = state().scripts
        release = None if ticket is None else (lambda: ticket.release(scripts))
        resp.response = Held(resp.response, place, release)
    else:
        admission.IN_FLIGHT.release(place)
        release_quota()
    return resp


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
    its model's queue (as ``submit_as``, default ``kind``; a chat's images made ready first,
    ``ready_images``), then wait for a whole answer. The
    pipeline every generation API shares (chat, completions, Anthropic's messages); run it
    inside ``admitted``, which gives back what it holds."""
    st = state()
    t = resolve(st, v.model, kind, body, v)
    name = t.entry.name
    if t.entry.spec.remote and submit_as not in (None, kind):
        raise errors.bad_request(
            f"model '{name}' is served by a remote upstream: this request needs a local model",
            "model",
            "unsupported",
        )
    # As what it is sent as: counting a prompt's tokens reserves no tokens to generate.
    admit_target(st, t, submit_as or kind, v)
    if t.entry.spec.remote:
        fwd = forward(t, path, body, v)
        if v.stream:
            return Dispatched(t, batches=(bus.Batch([e]) for e in fwd.events()), abandon=fwd.close)
        return Dispatched(t, result=named(fwd.json(), name))
    if kind is Kind.CHAT:
        ready_images(v, t)
    call = submit(st, submit_as or kind, v, t)
    if v.stream:
        return Dispatched(t, batches=call.batches(), abandon=call.abandon)
    return Dispatched(t, result=named(call.result(), name))


def ready_images(v: validation.Validated, t: Target) -> None:
    """A local model's chat request with its images made ready (``web.image_inputs``): after
    it was admitted, so a request refused by its quotas fetches nothing, and before it is
    queued, so a model process is never handed a URL to open."""
    limits = image_inputs.Limits.of(t.view.settings.images)
    with image_fetch.Fetcher(limits) as fetch:
        image_inputs.inline(v.params, limits, fetch)
