"""Operations on queued and in-flight requests that more than one role performs: writing a
reply message, answering every queued request with an error, and handing a dead model process's
in-flight requests back to the queue."""

from __future__ import annotations

import json
import logging
from typing import Any, cast

import redis

from residency import keys
from residency.errors import ApiError
from residency.lua import Scripts
from residency.messages import Event, EventType, ReplyType, Request

log = logging.getLogger(__name__)


def add_reply(
    pipe: Any, request_id: str, kind: ReplyType, data: dict[str, Any], *, set_ttl: bool = True
) -> None:
    """Queue one reply message on a pipeline or client, and (re)set the stream's TTL. A stream
    writer may skip the TTL on middle chunks: the first and the last message set it."""
    k = keys.reply(request_id)
    pipe.xadd(k, {"t": kind.value, "d": json.dumps(data, separators=(",", ":"))})
    if set_ttl:
        pipe.expire(k, keys.REPLY_TTL_S)


def fail_queued(r: redis.Redis, model: str, error: ApiError, limit: int = 100_000) -> int:
    """Answer every request still queued for ``model`` with ``error``. Each one leaves the queue
    together with its reply (one script), so a request is answered exactly once even if a model
    process starts taking them meanwhile, and none is lost to a crash in between."""
    scripts = Scripts(r)
    reply = error.to_reply()
    n = 0
    while n < limit:
        raw = cast(str | None, r.lindex(keys.queue(model), -1))
        if raw is None:
            break
        try:
            req_id = Request.loads(raw).id
        except (ValueError, KeyError):
            log.error("dropping malformed queued request for %s", model)
            r.lrem(keys.queue(model), 1, raw)
            continue
        if scripts.reject_oldest(model, req_id, raw, reply):
            n += 1
    return n


def hand_back(r: redis.Redis, scripts: Scripts, model: str, reason: str) -> dict[str, int]:
    """After a model process died: requeue its in-flight requests that produced no output yet,
    answer the others with an error, and ask the coordinator to re-plan."""
    counts = {"requeued": 0, "failed": 0, "gone": 0}
    err = ApiError(
        503,
        f"the process serving '{model}' stopped mid-reply ({reason}); retry the request",
        type="server_error",
        code="model_process_exited",
        retry_after=1,
    ).to_reply()
    for raw in cast(list[str], r.lrange(keys.processing(model), 0, -1)):
        try:
            req_id = Request.loads(raw).id
        except (ValueError, KeyError):
            r.lrem(keys.processing(model), 1, raw)
            continue
        counts[scripts.hand_back(model, req_id, raw, err)] += 1
    r.rpush(keys.events(), json.dumps(Event(EventType.GONE, model, {"reason": reason}).to_dict()))
    if counts["requeued"] or counts["failed"]:
        log.warning("model %s gone (%s): %s", model, reason, counts)
    return counts
