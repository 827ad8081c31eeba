"""Pull records and per-host pull queues in Redis (see ``residency.keys.pull`` and
``residency.pulls`` for the states).

The admin API creates a pull and queues it on its host in one script that refuses a full queue;
the host's agent takes it, reports its progress and moves its state, every state write a
compare-and-set against ``pulls.TRANSITIONS`` (a cancel that lands while the agent works is
never overwritten by a later progress or success).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, cast

import redis

from residency import keys
from residency.pulls import FINISHED, PullState, sources_for

# KEYS: record, pulls zset, queue, taken. ARGV: id, created, max, then field/value pairs.
_ENQUEUE = """
if redis.call('LLEN', KEYS[3]) + redis.call('LLEN', KEYS[4]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[1])
return 1
"""

# KEYS: record. ARGV: dst, ttl (0: none), n sources, sources..., then field/value pairs.
_TRANSITION = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
local n = tonumber(ARGV[3])
local ok = false
for i = 1, n do if ARGV[3 + i] == state then ok = true end end
if not ok then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
if #ARGV > 3 + n then redis.call('HSET', KEYS[1], unpack(ARGV, 4 + n)) end
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

# KEYS: record, queue. ARGV: id, now, ttl. A queued pull is taken off its queue and cancelled
# here; one the agent runs is flagged, and the agent stops it (and removes its partial file).
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return false end
if state == 'done' or state == 'failed' or state == 'cancelled' then return state end
redis.call('HSET', KEYS[1], 'cancel', '1')
if state == 'queued' and redis.call('LREM', KEYS[2], 1, ARGV[1]) == 1 then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'error', 'cancelled', 'finished', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return 'cancelled'
end
return state
"""

#: Fields shown in listings (the resolved URL and folder stay in the record).
PUBLIC = (
    "id",
    "source",
    "host",
    "name",
    "file",
    "state",
    "bytes_done",
    "bytes_total",
    "error",
    "created",
    "finished",
    "mmproj_file",
)
_INTS = ("bytes_done", "bytes_total")
_FLOATS = ("created", "finished")


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def enqueue(r: redis.Redis, record: dict[str, Any], max_queued: int) -> bool:
    """Store ``record`` (queued) and queue it on its host; False when the host already holds
    ``max_queued`` pulls (queued or running)."""
    fields = {**record, "state": PullState.QUEUED.value, "bytes_done": 0, "created": time.time()}
    flat: list[Any] = []
    for k, v in fields.items():
        if v is not None:
            flat += [k, str(v)]
    ok = r.eval(
        _ENQUEUE,
        4,
        keys.pull(record["id"]),
        keys.pulls(),
        keys.pull_queue(record["host"]),
        keys.pull_taken(record["host"]),
        record["id"],
        fields["created"],
        max_queued,
        *flat,
    )
    return bool(ok)


def get(r: redis.Redis, pull_id: str) -> dict[str, str] | None:
    raw = cast(dict[str, str], r.hgetall(keys.pull(pull_id)))
    return raw or None


def public(raw: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: raw.get(k) for k in PUBLIC}
    for k in _INTS:
        out[k] = int(raw[k]) if raw.get(k) else None
    for k in _FLOATS:
        out[k] = float(raw[k]) if raw.get(k) else None
    out["model"] = raw.get("name") if raw.get("state") == PullState.DONE.value else None
    return out


def listing(r: redis.Redis, limit: int = keys.PULLS_KEPT) -> list[dict[str, Any]]:
    """The pulls, newest first; ids whose record has expired are pruned, and the oldest
    finished ones past ``PULLS_KEPT``."""
    ids = cast(list[str], r.zrevrange(keys.pulls(), 0, -1))
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for i in ids:
        pipe.hgetall(keys.pull(i))
    rows = cast(list[dict[str, str]], pipe.execute())
    gone = [i for i, raw in zip(ids, rows, strict=True) if not raw]
    live = [raw for raw in rows if raw]
    excess = [
        raw["id"]
        for raw in live[keys.PULLS_KEPT :]
        if raw.get("state") in {s.value for s in FINISHED}
    ]
    if gone or excess:
        pipe = r.pipeline(transaction=False)
        pipe.zrem(keys.pulls(), *gone, *excess)
        for i in excess:
            pipe.delete(keys.pull(i))
        pipe.execute()
        live = [raw for raw in live if raw["id"] not in excess]
    return [public(raw) for raw in live[:limit]]


def transition(
    r: redis.Redis, pull_id: str, dst: PullState, fields: dict[str, Any] | None = None
) -> bool:
    """Move the pull to ``dst`` if its state allows it (``pulls.TRANSITIONS``); a finished pull
    is stamped and expires after ``PULL_TTL_S``."""
    extra = dict(fields or {})
    if dst in FINISHED:
        extra["finished"] = time.time()
    srcs = sorted(s.value for s in sources_for(dst))
    flat: list[Any] = []
    for k, v in extra.items():
        flat += [k, "" if v is None else str(v)]
    ttl = keys.PULL_TTL_S if dst in FINISHED else 0
    return bool(r.eval(_TRANSITION, 1, keys.pull(pull_id), dst.value, ttl, len(srcs), *srcs, *flat))


def cancel(r: redis.Redis, pull_id: str, host: str) -> str | None:
    """Ask to stop a pull: a queued one is cancelled at once, a running one by its agent. Its
    state now, or None when there is no such pull."""
    out = r.eval(
        _CANCEL, 2, keys.pull(pull_id), keys.pull_queue(host), pull_id, time.time(), keys.PULL_TTL_S
    )
    return None if out is None else str(out)


def report(r: redis.Redis, pull_id: str, done: int, total: int | None) -> bool:
    """Record progress; whether a cancel was asked for."""
    pipe = r.pipeline(transaction=False)
    pipe.hset(
        keys.pull(pull_id),
        mapping={"bytes_done": done, **({"bytes_total": total} if total is not None else {})},
    )
    pipe.hget(keys.pull(pull_id), "cancel")
    return bool(pipe.execute()[1])


def pending(r: redis.Redis, host: str) -> int:
    pipe = r.pipeline(transaction=False)
    pipe.llen(keys.pull_queue(host))
    pipe.llen(keys.pull_taken(host))
    return sum(cast(list[int], pipe.execute()))
