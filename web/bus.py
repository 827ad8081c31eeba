"""Submitting a request to its model's queue and collecting the reply stream.

A ``Call`` is one submitted request. Its reply stream (``keys.reply(id)``) carries messages with
``t`` in chunk/done/error and ``d`` JSON; the web thread reads it with ``XREAD BLOCK`` so every
wait is bounded, and deletes it when the reply is complete. A request abandoned by its client or
by the timeout is withdrawn (``withdraw.lua``): out of the queue if nobody took it yet, else its
cancel flag tells the model process that took it to stop. While no reply has come, the wait
also watches the client's connection (``client_gone``), so a client that goes away while its
request is queued has it withdrawn before any model process generates it, and the request's
deadline (``server.request_deadline_s``), so one still queued then is answered 504 at once,
and, for a stream, its model's load (``web.load_progress``: each step is handed on like a
keep-alive, in a ``Batch`` of its own).
A queued request may also be pushed out to make room for another user's (a full queue, or a
full web worker, see ``web/admission.py``): it leaves the queue together with a 429 on its reply
stream, which its reader answers its client with like any other reply.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client import Counter, Histogram

from residency import errors, keys, metrics, tracing
from residency.errors import ApiError
from residency.lua import Scripts
from residency.messages import Event, EventType, Kind, ReplyType, Request, new_request_id
from residency.route_wait import Service
from web import admission, load_progress, traces

log = logging.getLogger(__name__)

BLOCK_MS = 1000
#: Calls of the submit script for one request whose user is within its share of a full queue:
#: each names the request to push out, and the next pushes it out unless the queue changed.
PUSH_OUT_TRIES = 3
READ_COUNT = 100
#: Sent in a ``Batch`` when a stream has been quiet for its keep-alive interval (the same
#: object every time: compare with ``is``).
KEEPALIVE: dict[str, Any] = {}


@dataclass
class Batch:
    """The chunks of a stream that arrived together (written to the client in one write);
    ``last``: the reply ended with them."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    last: bool = False


#: Set when this web worker is told to stop (see web/server.py): a request still waiting for
#: its first reply message is withdrawn from its queue and answered 503 with Retry-After, so
#: the client retries elsewhere or later instead of seeing its connection cut at the end of
#: the graceful timeout (and its request is not left queued for a model nobody waits for).
#: Replies already streaming run to their end.
SHUTTING_DOWN = threading.Event()

TTFT = Histogram(
    metrics.TTFT,
    "Seconds from submit to the first streamed chunk (or the whole reply)",
    ["model"],
    buckets=metrics.TTFT_BUCKETS,
)
REQUESTS = Counter(
    metrics.REQUESTS_TOTAL, "API requests by model and HTTP status code", ["model", "code"]
)


def timeout_error(model: str, waited: float) -> ApiError:
    return ApiError(
        503,
        f"no reply from '{model}' within {waited:g}s; retry later",
        type="server_error",
        code="timeout",
        retry_after=5,
    )


def shutting_down_error(model: str) -> ApiError:
    return ApiError(
        503,
        f"the server is shutting down; the request for '{model}' was withdrawn, retry",
        type="server_error",
        code="shutting_down",
        retry_after=5,
    )


def storage_unavailable(exc: Exception) -> ApiError:
    """Redis is unreachable (down, restarting, loading its data): 503 with Retry-After, so
    clients retry rather than treat it as their error."""
    return ApiError(
        503,
        f"storage unavailable ({exc.__class__.__name__}); retry shortly",
        type="server_error",
        code="redis_unavailable",
        retry_after=2,
    )


class Call:
    """One submitted request and its reply stream.

    ``timeout_s`` bounds the wait for each reply message: the first one is measured from submit
    (queue wait and load included), later ones from the message before, so a long stream that
    keeps producing is never cut while a stalled one is. ``client_gone``, when given, says
    whether the client closed its connection; it is asked before each read until the reply is
    complete.
    """

    def __init__(
        self,
        r: redis.Redis,
        req: Request,
        item: str,
        timeout_s: float,
        scripts: Scripts,
        client_gone: Callable[[], bool] | None = None,
        keepalive_s: float = 0.0,
    ) -> None:
        self.r = r
        self.keepalive_s = keepalive_s
        self.req = req
        self.item = item
        self.timeout_s = timeout_s
        self.scripts = scripts
        self.client_gone = client_gone
        self._last_id = "0-0"
        self._first = True
        self._drained = True  # the message read last was the last of its read
        self._deadline_checked = False
        self.closed = False
        self.finished = False  # its last reply message was read (the stream may still exist)
        # A stream's watch of its model's load (``web.load_progress``), set once it was queued:
        # each step is yielded while no reply has come.
        self.watch_load: load_progress.Watch | None = None

    @property
    def model(self) -> str:
        return self.req.model

    def _read(self) -> Iterator[tuple[ReplyType | None, dict[str, Any]]]:
        """Every reply message until done or error; raises the 503 timeout after cancelling.
        With ``keepalive_s``, ``(None, {})`` whenever that long passed without a message (a
        stream sends its client a comment line then)."""
        try:
            yield from self._replies()
        except BaseException:
            # Whatever ended the reading (a bad message, a Redis error, the greenlet killed, the
            # body closed): nobody reads the reply now, so the request must not go on
            # generating for nobody. A finished reply is closed already: this does nothing.
            self.abandon()
            raise

    def _replies(self) -> Iterator[tuple[ReplyType | None, dict[str, Any]]]:
        key = keys.reply(self.req.id)
        deadline = time.monotonic() + self.timeout_s
        quiet_since = time.monotonic()
        while True:
            if self.keepalive_s and time.monotonic() - quiet_since >= self.keepalive_s:
                quiet_since = time.monotonic()
                yield None, {}
            left = deadline - time.monotonic()
            if left <= 0:
                self.abandon()
                raise timeout_error(self.model, self.timeout_s)
            if SHUTTING_DOWN.is_set() and self._last_id == "0-0":
                self.abandon()
                raise shutting_down_error(self.model)
            if self.client_gone is not None and self.client_gone():
                log.info("client of request %s went away; withdrawing it", self.req.id)
                self.abandon()
                raise errors.client_closed(self.model)
            if self.watch_load is not None and self._last_id == "0-0":
                step = self.watch_load.poll()
                if step is not None:
                    quiet_since = time.monotonic()  # it is traffic, as a keep-alive is
                    yield None, {"loading": step}
            try:
                self._check_deadline()
                resp: Any = self.r.xread(
                    {key: self._last_id}, count=READ_COUNT, block=self._block_ms(left)
                )
            except (redis.ConnectionError, redis.TimeoutError) as e:
                self.abandon()
                raise storage_unavailable(e) from e
            streams = resp.items() if isinstance(resp, dict) else (resp or [])
            if streams:
                quiet_since = time.monotonic()
            for _key, entries in streams:
                for i, (msg_id, fields) in enumerate(entries):
                    self._drained = i == len(entries) - 1
                    self._last_id = msg_id
                    kind = ReplyType(fields["t"])
                    data = json.loads(fields["d"]) if fields.get("d") else {}
                    if self._first and kind is not ReplyType.ERROR:
                        self._first = False
                        TTFT.labels(self.model).observe(time.time() - self.req.submitted)
                    if kind is not ReplyType.CHUNK:
                        # Complete: nothing to withdraw any more. Its stream is deleted once
                        # the last message was handed on, so a stream's end goes to its
                        # client before that round trip, not after it.
                        self.finished = True
                        try:
                            yield kind, data
                        finally:
                            self.close()
                        return
                    yield kind, data
                    deadline = time.monotonic() + self.timeout_s

    def _block_ms(self, left: float) -> int:
        """How long one read may block: at most a second (or the keep-alive interval), and no
        later than the deadline (so a request still queued then is answered at once)."""
        wait = min(left, 1.0, self.keepalive_s or 1.0)
        if self.watch_load is not None and self._last_id == "0-0":
            wait = min(wait, self.watch_load.wait_s())
        if self.req.deadline and not self._deadline_checked:
            wait = min(wait, self.req.deadline - time.time())
        return max(1, int(wait * 1000))

    def _check_deadline(self) -> None:
        """Past its deadline with no reply yet: withdraw it if it is still queued and answer
        504; if a model process took it, that process stops it at its next token and answers
        (so the check runs once)."""
        if not self.req.deadline or self._deadline_checked or self._last_id != "0-0":
            return
        if time.time() < self.req.deadline:
            return
        self._deadline_checked = True
        if self.scripts.withdraw(self.model, self.req.id, self.item, cancel=False):
            self.closed = True
            raise errors.deadline_exceeded(self.model, self.req.deadline - self.req.submitted)

    def result(self) -> dict[str, Any]:
        """The whole response of a non-stream request."""
        for kind, data in self._read():
            if kind is None:
                continue
            if kind is ReplyType.DONE:
                return data
            if kind is ReplyType.ERROR:
                raise ApiError.from_reply(data)
            log.warning("ignoring a chunk on the reply of non-stream request %s", self.req.id)
        raise ApiError(500, "reply stream ended without a result", type="server_error")

    def batches(self) -> Iterator[Batch]:
        """The OpenAI chunk objects of a stream request, batched as they arrived (a batch of
        ``KEEPALIVE`` after each quiet ``keepalive_s``); the batch that ends the reply is
        ``last``, an error is raised."""
        batch = Batch()
        for kind, data in self._read():
            if kind is None:
                yield Batch([data.get("loading") or KEEPALIVE])
            elif kind is ReplyType.CHUNK:
                batch.chunks.extend(data.get("chunks", []))
                if self._drained:
                    yield batch
                    batch = Batch()
            elif kind is ReplyType.ERROR:
                if batch.chunks:
                    yield batch
                raise ApiError.from_reply(data)
            else:
                batch.last = True
                yield batch

    def close(self) -> None:
        """The reply is complete: its stream is no longer needed."""
        if self.closed:
            return
        self.closed = True
        try:
            self.r.delete(keys.reply(self.req.id))
        except redis.RedisError:
            log.warning("could not delete reply stream of %s (it expires)", self.req.id)

    def push_out(self, error: ApiError) -> bool:
        """Make room for another user's request: take this one out of its queue with
        ``error`` as its reply, which the thread reading it answers its client with at once.
        False when a model process took it already (or Redis did not answer): it stays."""
        if self.closed or self.finished:
            return False
        try:
            return self.scripts.push_out(self.model, self.req.id, self.item, error.to_reply())
        except redis.RedisError:
            log.warning("could not push out request %s for %s", self.req.id, self.model)
            return False

    def abandon(self) -> None:
        """Nobody will read the reply: drop the request from the queue if it is still there,
        else stop its generation (the cancel flag). Nothing once its reply is complete."""
        if self.closed or self.finished:
            return
        self.closed = True
        try:
            self.scripts.withdraw(self.model, self.req.id, self.item, cancel=True)
        except redis.RedisError:
            log.warning("could not cancel request %s for %s", self.req.id, self.model)


def submit(
    r: redis.Redis,
    scripts: Scripts,
    *,
    kind: Kind,
    model: str,
    params: dict[str, Any],
    stream: bool,
    bound: int,
    timeout_s: float,
    deadline_s: float = 0.0,
    deadline_at: float = 0.0,
    client_gone: Callable[[], bool] | None = None,
    keepalive_s: float = 0.0,
    user: str = "",
    key: str = "",
    may_load: bool = True,
    weight: float = 1.0,
    fair: bool = True,
    cache_scope: str = "user",
    route: dict[str, Any] | None = None,
) -> Call:
    """Queue a request and return its Call. The queue is bounded (``bound``) and the bound
    shared between users: a full queue refuses 429 with Retry-After, unless ``user`` is within
    its share of it, when the newest queued request of the user furthest above its share is
    answered that 429 instead and this one takes its place (``submit.lua``, ``_shares.lua``).
    ``deadline_s``: it must be finished that long after submit (0: no deadline);
    ``deadline_at``: the time it must be finished by instead (its request's deadline, for a
    routing helper's call or a request routed first; 0: use ``deadline_s``). ``user``:
    who asked (usage, fair turns and shares); ``key``: the id of its API key (daily quotas);
    without ``may_load`` a model that is neither ready nor loading is refused 409 and nothing is
    queued (the request would load it). ``weight``: the user's share of the model's turns and
    of its queue; ``fair``: take turns between users (``pool.fair_queues``) rather than first
    come, first served. ``cache_scope``: ``[cache] scope`` now (whose cached prompt prefixes the
    model process may reuse for it). ``route``: how a router policy routed it (``Request.route``),
    for the model process to record its predicted wait against the actual one."""
    now = time.time()
    span = traces.submit_span(model, user)
    req = Request(
        id=new_request_id(),
        kind=kind,
        model=model,
        params=params,
        stream=stream,
        submitted=now,
        deadline=deadline_at or (now + deadline_s if deadline_s > 0 else 0.0),
        user=user,
        key=key,
        cache_scope=cache_scope,
        weight=weight,
        trace=tracing.traceparent(span) if span is not None else "",
        route=route or {},
    )
    try:
        return _submit(r, scripts, req, bound, may_load, fair, timeout_s, client_gone, keepalive_s)
    finally:
        if span is not None:
            span.end()


def _submit(
    r: redis.Redis,
    scripts: Scripts,
    req: Request,
    bound: int,
    may_load: bool,
    fair: bool,
    timeout_s: float,
    client_gone: Callable[[], bool] | None,
    keepalive_s: float,
) -> Call:
    model, user, weight = req.model, req.user, req.weight
    item = req.dumps()
    push_out: tuple[str, dict[str, Any]] | None = None
    try:
        for _ in range(PUSH_OUT_TRIES):
            code, val = scripts.submit(
                model,
                item,
                bound=bound,
                demand_event=Event(EventType.DEMAND, model).to_dict(),
                may_load=may_load,
                user=user,
                weight=weight,
                fair=fair,
                request_id=req.id,
                push_out=push_out,
            )
            if code != 3:
                break
            # Full, but this user is within its share: the request named makes room (the
            # script pushes it out only if it is still the one to go when called again).
            retry = _queue_retry_after(r, model, bound)
            push_out = (str(val), errors.pushed_out(model, bound, retry).to_reply())
        else:
            code, val = 0, bound  # the queue kept changing under us: full, as for anyone
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise storage_unavailable(e) from e
    if code == 2:
        raise errors.model_not_resident(model, str(val))
    if code == 0:
        depth = int(val)
        raise errors.queue_full(model, depth, _queue_retry_after(r, model, depth))
    return Call(r, req, item, timeout_s, scripts, client_gone, keepalive_s)


def _queue_retry_after(r: redis.Redis, model: str, depth: int) -> int:
    """When a refused client should retry: the queue ahead of it, at the pace the model has
    been serving (its model process's moving average), over its slots."""
    try:
        pipe = r.pipeline(transaction=False)
        pipe.get(keys.service(model))
        pipe.hget(keys.model(model), "parallel")
        service, parallel = pipe.execute()
        return admission.queue_retry_after(
            depth, Service.parse(service).service_s, int(parallel or 1)
        )
    except (redis.RedisError, ValueError):
        return admission.MIN_RETRY_S
