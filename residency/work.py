"""Operations on queued and in-flight requests that more than one role performs: writing a
reply message, answering every queued request with an error, and handing a dead model process's
in-flight requests back to the queue."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Container
from dataclasses import replace
from typing import Any, cast

import redis

from residency import keys
from residency.errors import ApiError
from residency.lua import Scripts
from residency.messages import Event, EventType, ReplyType, Request

log = logging.getLogger(__name__)


def add_reply(pipe: Any, request_id: str, kind: ReplyType, data: dict[str, Any]) -> None:
    """Queue one reply message on a pipeline or client, and (re)set the stream's TTL. (A
    model process writes a stream's chunks with ``Scripts.flush``, which skips a cancelled
    request.)"""
    k = keys.reply(request_id)
    pipe.xadd(k, {"t": kind.value, "d": json.dumps(data, separators=(",", ":"))})
    pipe.expire(k, keys.REPLY_TTL_S)


def _writes(r: redis.Redis, scripts: Scripts, lease: str | None) -> Any:
    """Where a plain write goes: to Redis, or for the coordinator leader (``lease``) into a
    batch fenced by its lease. Both are pipeline-shaped: queue, then ``execute()``."""
    return scripts.fenced(lease) if lease else r.pipeline(transaction=False)


def fail_queued(
    r: redis.Redis,
    model: str,
    error: ApiError,
    limit: int = 100_000,
    *,
    lease: str | None = None,
    on_answered: Callable[[str], None] | None = None,
) -> int:
    """Answer the requests queued for ``model`` when this starts with ``error``, oldest first.
    Each one leaves the queue together with its reply (one script), so a request is answered
    exactly once even if a model process starts taking them meanwhile, and none is lost to a
    crash in between. A request queued after this started is not answered: it arrived after
    what ``error`` tells (a failed load), and is the next load's; the answering stops at the
    first such request at the queue's oldest end. ``lease``: the coordinator leader's token;
    every write is then fenced by it (NotLeader when deposed). ``on_answered`` is told each
    answered request's id (tests use it to queue one meanwhile)."""
    scripts = Scripts(r)
    reply = error.to_reply()
    queued = set(cast(list[str], r.lrange(keys.queue(model), 0, -1)))
    n = 0
    while n < limit:
        raw = cast(str | None, r.lindex(keys.queue(model), -1))
        if raw is None or raw not in queued:
            break
        try:
            req_id = Request.loads(raw).id
        except (ValueError, KeyError):
            log.error("dropping malformed queued request for %s", model)
            _writes(r, scripts, lease).lrem(keys.queue(model), 1, raw).execute()
            continue
        if scripts.reject_oldest(model, req_id, raw, reply, lease=lease):
            n += 1
            if on_answered is not None:
                on_answered(req_id)
    return n


#: A request whose model process died (unasked) this many times while running it is refused
#: rather than requeued: it may be what kills the process.
MAX_CRASHES = 2


def hand_back(
    r: redis.Redis,
    scripts: Scripts,
    model: str,
    reason: str,
    *,
    crashed: bool = False,
    lease: str | None = None,
    token: str = "",
    fail: ApiError | None = None,
    only: Container[str] | None = None,
    announce: bool = True,
) -> dict[str, int]:
    """After a model process died or was stopped: requeue its in-flight requests that produced
    no output yet, answer the others with an error, and ask the coordinator to re-plan.
    ``crashed``: the process died without being asked to (a signal, an abort); each in-flight
    request then counts one attempt, and one that reaches ``MAX_CRASHES`` is answered with an
    error naming the crash instead of being requeued. ``lease``: the coordinator leader's token
    (it reaps); every write is then fenced by it (NotLeader when deposed). ``fail``: answer
    every in-flight request with this error instead (the process was killed because its
    generation hung: requeueing would hang the next process too). ``only``: hand back just
    these items (a live process's orphans); ``announce``: tell the coordinator the process is
    gone (not when it lives on)."""
    counts = {"requeued": 0, "refused": 0, "failed": 0, "gone": 0}
    err = ApiError(
        503,
        f"the process serving '{model}' stopped mid-reply ({reason}); retry the request",
        type="server_error",
        code="model_process_exited",
        retry_after=1,
    ).to_reply()
    refusal = ApiError(
        500,
        f"the process serving '{model}' died {MAX_CRASHES} times while running this request "
        f"(last: {reason}); it is not retried again",
        type="server_error",
        code="model_crashed",
    ).to_reply()
    failed = fail.to_reply() if fail is not None else None
    for raw in cast(list[str], r.lrange(keys.processing(model), 0, -1)):
        if only is not None and raw not in only:
            continue
        try:
            req = Request.loads(raw)
        except (ValueError, KeyError):
            _writes(r, scripts, lease).lrem(keys.processing(model), 1, raw).execute()
            continue
        requeue = raw
        if fail is not None:
            requeue = ""
        elif crashed:
            attempts = req.attempts + 1
            requeue = "" if attempts >= MAX_CRASHES else replace(req, attempts=attempts).dumps()
        res = scripts.hand_back(
            model,
            req.id,
            raw,
            failed or err,
            requeue=requeue,
            refusal=failed or refusal,
            lease=lease,
        )
        counts[res] += 1
    if announce:
        # A crash with its load token counts toward the model's crash loop
        # (coordinator.failures).
        crash = {"crashed": True, "token": token} if crashed and token else {}
        gone = Event(EventType.GONE, model, {"reason": reason, **crash}).to_dict()
        _writes(r, scripts, lease).rpush(keys.events(), json.dumps(gone)).execute()
    if counts["requeued"] or counts["failed"] or counts["refused"]:
        log.warning("model %s gone (%s): %s", model, reason, counts)
    return counts
