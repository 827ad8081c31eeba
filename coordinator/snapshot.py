"""Read the pool from Redis in one pipelined round trip, and shape the published health record."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

import redis

from coordinator.decide import ModelView, Snapshot, WorkerView, effective_limit
from residency import __version__, keys, registry, states
from residency.messages import Request
from residency.settings import Settings

TYPES = ("llm", "embedding")


def _f(v: str | None) -> float | None:
    return float(v) if v not in (None, "") else None


@dataclass(frozen=True)
class Read:
    snap: Snapshot
    model_hashes: dict[str, dict[str, str]]  # pid, load_seconds… for the health record
    worker_hashes: dict[str, dict[str, str]]


def read(r: redis.Redis, s: Settings, now: float) -> Read:
    """The pool as one Snapshot, from one pipelined round trip (plus the registry read)."""
    entries = registry.all_entries(r)
    names = set(entries)
    names.update(
        str(k).removeprefix(keys.model(""))
        for k in r.scan_iter(match=keys.model_pattern(), count=1000)
    )
    explicit = cast(dict[str, str], r.hgetall(keys.explicit()))
    hosts = sorted(cast(set[str], r.smembers(keys.workers())))
    ordered = sorted(names)

    pipe = r.pipeline(transaction=False)
    for n in ordered:
        pipe.hgetall(keys.model(n))
        pipe.llen(keys.queue(n))
        pipe.llen(keys.processing(n))
        pipe.lindex(keys.queue(n), -1)
    for h in hosts:
        pipe.hgetall(keys.worker(h))
    res = pipe.execute()

    models: dict[str, ModelView] = {}
    raw: dict[str, dict[str, str]] = {}
    for i, n in enumerate(ordered):
        h, queued, in_flight, oldest = res[4 * i : 4 * i + 4]
        e = entries.get(n)
        raw[n] = h
        models[n] = ModelView(
            name=n,
            type=e.spec.type if e else h.get("type", "llm"),
            state=states.parse(h.get("state")),
            token=h.get("token", ""),
            pinned=e.spec.pinned if e else False,
            queued=int(queued),
            in_flight=int(in_flight),
            last_used=float(h.get("last_used") or 0.0),
            demand_since=Request.loads(oldest).submitted if oldest else None,
            host=h.get("host") or None,
            device=h.get("device") or None,
            registered=e is not None,
            loading_since=_f(h.get("loading_since")),
            explicit=explicit.get(n),
        )
    workers: dict[str, WorkerView] = {}
    worker_hashes: dict[str, dict[str, str]] = {}
    for j, host in enumerate(hosts):
        w = res[4 * len(ordered) + j]
        worker_hashes[host] = w
        workers[host] = WorkerView(
            host=host, devices=tuple(json.loads(w.get("devices", "[]"))), alive=bool(w)
        )
    limits = {t: limit_for(s, t) for t in TYPES}
    snap = Snapshot(models, workers, limits, now, s.pool.load_timeout_s)
    return Read(snap, raw, worker_hashes)


def limit_for(s: Settings, typ: str) -> int:
    # No router policies exist yet, so the LLM candidate floor is 0 and autosize changes nothing.
    floor = 0
    return effective_limit(
        s.pool.max_loaded_models, s.pool.llm_pool_autosize and typ == "llm", floor
    )


def health_record(rd: Read, s: Settings) -> dict[str, Any]:
    """The /health document (without ``generation``, which publishing stamps)."""
    snap, raw, worker_hashes = rd.snap, rd.model_hashes, rd.worker_hashes
    models = []
    for m in sorted(snap.models.values(), key=lambda m: m.name):
        h = raw.get(m.name, {})
        models.append(
            {
                "name": m.name,
                "type": m.type,
                "pool": m.pool,
                "state": m.state.value,
                "pinned": m.pinned,
                "registered": m.registered,
                "busy": m.busy,
                "in_flight": m.in_flight,
                "queued": m.queued,
                "host": m.host,
                "device": m.device,
                "pid": int(h["pid"]) if h.get("pid") else None,
                "last_used": m.last_used or None,
                "load_seconds": _f(h.get("load_seconds")),
                "error": h.get("error") or None,
            }
        )
    workers = []
    for host, w in sorted(snap.workers.items()):
        wh = worker_hashes.get(host, {})
        workers.append(
            {
                "host": host,
                "devices": list(w.devices),
                "alive": w.alive,
                "last_heartbeat": _f(wh.get("last_heartbeat")),
                "pid": int(wh["pid"]) if wh.get("pid") else None,
                "memory_total": int(wh["memory_total"]) if wh.get("memory_total") else None,
            }
        )
    return {
        "status": "ok",
        "version": __version__,
        "max_models": {
            t: {"configured": s.pool.max_loaded_models, "effective": snap.limits[t]} for t in TYPES
        },
        "llm_pool_autosize": {
            "enabled": s.pool.llm_pool_autosize,
            "candidate_floor": 0,
            "policies": {},
            "exceeds_max_loaded_models": False,
            "advisory": None,
        },
        "auto_evict": {"enabled": s.pool.auto_evict, "threshold": s.pool.auto_evict_threshold},
        "models": models,
        "workers": workers,
        "published_at": snap.now,
    }
