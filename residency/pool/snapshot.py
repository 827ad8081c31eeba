"""Read the pool from Redis in one pipelined round trip, and shape the published health record."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from residency import __version__, footprint, keys, ledger, policy_store, registry, states
from residency.auth import subject_label
from residency.messages import Request
from residency.policies import candidate_floor, helper_models
from residency.pool.autosize import Autosize, autosize
from residency.pool.decide import (
    HELPER,
    STANDARD,
    ModelView,
    Snapshot,
    WorkerView,
    backoff_until,
    recent_failures,
    room_of,
)
from residency.settings import MODEL_TYPES, ModelSpec, Settings

TYPES = MODEL_TYPES  # one pool, and one limit, per model type
PER_MODEL = 7  # replies per model in the pool read


def _f(v: str | None) -> float | None:
    return float(v) if v not in (None, "") else None


def _int(v: str | None) -> int | None:
    return int(v) if v and v.isdigit() else None


def _failures(
    raw: list[tuple[str, float]], h: dict[str, str], now: float
) -> tuple[tuple[float, ...], str | None]:
    """(failure times oldest first, the last cause) from a ``load_failures`` ZRANGE WITHSCORES
    and the model hash ``h``. A model ``failed`` under a token the window does not hold yet
    counts that failure too (at ``now``): its state is written before its failure event reaches
    the coordinator, and a pass in between must not load it once more than the limit allows."""
    last: str | None = None
    tokens = set()
    for member, _ in raw:  # ascending by time: the last one read is the latest cause
        try:
            entry = json.loads(member)
            last = str(entry.get("error") or "") or last
            tokens.add(entry.get("token"))
        except (ValueError, AttributeError):
            continue
    times = tuple(float(t) for _, t in raw)
    if _failure_pending(h) and h.get("token") not in tokens:
        times = (*times, now)
        last = h.get("error") or last
    return times, last


def _needs(
    spec: ModelSpec, kinds: dict[str, str], measured: dict[str, str]
) -> tuple[tuple[str, int], ...]:
    """What a load of ``spec`` takes on each device kind (one device of that kind given)."""
    out = []
    for kind, device in sorted(kinds.items()):
        n = ledger.expected(spec, device, measured)
        if n is not None:
            out.append((kind, n))
    return tuple(out)


def _load_s(spec: ModelSpec, kinds: dict[str, str], measured: dict[str, str]) -> dict[str, float]:
    """Its spec's measured load time (``keys.footprint`` fields ``load_s``, a moving average
    over the spec's committed loads, and ``load_spec``), on the device kind whose digest those
    loads had: like its bytes (``ledger.expected``), a load of another spec says nothing about
    the next one."""
    spec_digest = measured.get("load_spec")
    try:
        seconds = float(measured.get("load_s") or "")
    except ValueError:
        return {}
    if not spec_digest or not math.isfinite(seconds) or seconds < 0:
        return {}
    return {
        kind: seconds
        for kind, device in sorted(kinds.items())
        if ledger.digest(spec, device) == spec_digest
    }


def _budgets(raw: str | None) -> dict[str, int | None]:
    """An agent's reported budgets; an unreadable report means no byte limit."""
    try:
        data = json.loads(raw or "{}")
        return {str(d): (int(b) if b is not None else None) for d, b in data.items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def _failure_pending(h: dict[str, str]) -> bool:
    """``failed`` under a token the coordinator has not settled (see ``failures.settle``)."""
    token = h.get("token")
    return (
        h.get("state") == states.ModelState.FAILED.value
        and bool(token)
        and h.get("failure_seen") != token
    )


def _children(w: dict[str, str]) -> tuple[dict[str, str] | None, float | None]:
    """The agent's report of its model processes; (None, None) if absent or unreadable (an
    agent that does not report them: nothing is reaped on its word)."""
    try:
        children = json.loads(w["children"])
        at = float(w["children_at"])
    except (KeyError, ValueError, TypeError):
        return None, None
    if not isinstance(children, dict):
        return None, None
    return {str(k): str(v) for k, v in children.items()}, at


def queue_summary(items: list[str]) -> tuple[float | None, dict[str, int]]:
    """(the submit time of the oldest queued request, queued requests per user) of one model's
    queue list. The oldest is not always the one served next (that is the right end): fair
    queueing lets another user's later request go first. Requests count under their subject's
    label (a user's name, ``admin:<name>``, ``-`` for anonymous callers: as ``/admin/usage``
    shows them); an unreadable item counts for nobody."""
    oldest: float | None = None
    users: Counter[str] = Counter()
    for raw in items:
        try:
            req = Request.loads(raw)
        except (ValueError, KeyError, TypeError):
            continue
        users[subject_label(req.user or keys.ANONYMOUS)] += 1
        oldest = req.submitted if oldest is None else min(oldest, req.submitted)
    return oldest, dict(users)


@dataclass(frozen=True)
class Read:
    snap: Snapshot
    model_hashes: dict[str, dict[str, str]]  # pid, load_seconds… for the health record
    worker_hashes: dict[str, dict[str, str]]
    autosize: Autosize  # the floor and per-policy counts, from the same read as the pool
    helpers: tuple[str, ...] = ()  # the routing-helper set, from that same read
    # Per model with anything queued: its queued requests per user (for the health record).
    queued_by_user: dict[str, dict[str, int]] = field(default_factory=dict)
    # Per model with saved slot caches: its cache record (keys.kvcache).
    cache_hashes: dict[str, dict[str, str]] = field(default_factory=dict)
    # Per registered model with a measured load of the spec it would load now: its seconds per
    # device kind (``residency.pool.route_room``).
    load_s: dict[str, dict[str, float]] = field(default_factory=dict)


def adopt_model_keys(r: redis.Redis) -> int:
    """Add every model hash to the set of models with state: a one-off sweep when a coordinator
    becomes leader, for data written before that set existed (a pass itself never scans)."""
    names = [
        str(k).removeprefix(keys.model(""))
        for k in r.scan_iter(match=keys.model_pattern(), count=1000)
    ]
    return int(r.sadd(keys.models_with_state(), *names)) if names else 0


def read(r: redis.Redis, s: Settings, now: float) -> Read:
    """The pool as one Snapshot. The registry, the policies, the explicit wishes and the workers
    come from one MULTI (so the floor, the per-policy breakdown and the helper set are computed
    from one consistent view of the registry), the pool state from one more pipelined round
    trip."""
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(keys.registry())
    pipe.hgetall(keys.policies())
    pipe.hgetall(keys.explicit())
    pipe.smembers(keys.workers())
    pipe.smembers(keys.models_with_state())
    pipe.hgetall(keys.hosts_seen())
    raw_registry, raw_policies, explicit, members, with_state, seen = pipe.execute()
    entries = {n: registry.Entry.loads(n, v) for n, v in raw_registry.items()}
    pols = policy_store.parsed(
        {n: policy_store.PolicyEntry.loads(n, v) for n, v in raw_policies.items()}
    )
    infos = policy_store.model_infos(entries)
    floor = candidate_floor(pols, infos)
    helpers = helper_models(pols)
    auto = autosize(s, floor)
    warm_candidates = floor.candidates if s.pool.preload_candidates else frozenset()
    # Remote models are forwarded by web and never resident: they have no place in the pool.
    entries = {n: e for n, e in entries.items() if not e.spec.remote}
    # Residents of models deleted from the registry are found through the set of models with
    # state, never by scanning the keyspace.
    names = set(entries) | {str(n) for n in with_state}
    explicit = cast(dict[str, str], explicit)
    hosts = sorted(cast(set[str], members))
    ordered = sorted(names)

    pipe = r.pipeline(transaction=False)
    for n in ordered:
        pipe.hgetall(keys.model(n))
        pipe.llen(keys.queue(n))
        pipe.llen(keys.processing(n))
        # The whole list (it is bounded by max_queue_per_model): its oldest request and how
        # many each user has queued.
        pipe.lrange(keys.queue(n), 0, -1)
        pipe.zrange(keys.load_failures(n), 0, -1, withscores=True)
        pipe.hgetall(keys.footprint(n))
        pipe.hgetall(keys.kvcache(n))
    for h in hosts:
        pipe.hgetall(keys.worker(h))
    res = pipe.execute()

    worker_raw = res[PER_MODEL * len(ordered) :]
    # One device of each kind the live hosts offer: a model's bytes are known per kind.
    kinds: dict[str, str] = {}
    for w in worker_raw:
        for d in json.loads(w.get("devices", "[]")) if w else []:
            kinds.setdefault(footprint.device_kind(d), d)
    models: dict[str, ModelView] = {}
    raw: dict[str, dict[str, str]] = {}
    by_user: dict[str, dict[str, int]] = {}
    cache_hashes: dict[str, dict[str, str]] = {}
    load_s: dict[str, dict[str, float]] = {}
    for i, n in enumerate(ordered):
        h, queued, in_flight, items, failed, measured, saved = res[
            PER_MODEL * i : PER_MODEL * (i + 1)
        ]
        failures, last_error = _failures(failed, h, now)
        oldest, users = queue_summary(items)
        if users:
            by_user[n] = users
        e = entries.get(n)
        raw[n] = h
        if saved:
            cache_hashes[n] = saved
        if e is not None and (secs := _load_s(e.spec, kinds, measured)):
            load_s[n] = secs
        models[n] = ModelView(
            name=n,
            type=e.spec.type if e else h.get("type", "llm"),
            state=states.parse(h.get("state")),
            token=h.get("token", ""),
            pinned=e.spec.pinned if e else False,
            queued=int(queued),
            in_flight=int(in_flight),
            last_used=float(h.get("last_used") or 0.0),
            demand_since=oldest,
            host=h.get("host") or None,
            device=h.get("device") or None,
            registered=e is not None,
            loading_since=_f(h.get("loading_since")),
            explicit=explicit.get(n),
            pool=HELPER if n in helpers else STANDARD,
            load_seconds=_f(h.get("load_seconds")),
            loaded_pool=h.get("pool") or None,
            loaded_at=_f(h.get("loaded_at")),
            draining_since=_f(h.get("draining_since")),
            failures=failures,
            last_error=last_error,
            failure_pending=_failure_pending(h),
            yielding=h.get("yielding") or None,
            yielding_since=_f(h.get("yielding_since")),
            ttl_s=e.spec.ttl_s if e else None,
            preload=e is not None and (e.spec.preload or n in warm_candidates),
            held_bytes=_int(h.get("footprint_bytes")) or _int(h.get("estimate_bytes")),
            need_bytes=_needs(e.spec, kinds, measured) if e else (),
            last_host=h.get("last_host") or None,
            last_device=h.get("last_device") or None,
        )
    workers: dict[str, WorkerView] = {}
    worker_hashes: dict[str, dict[str, str]] = {}
    for j, host in enumerate(hosts):
        w = res[PER_MODEL * len(ordered) + j]
        worker_hashes[host] = w
        children, children_at = _children(w)
        workers[host] = WorkerView(
            host=host,
            devices=tuple(json.loads(w.get("devices", "[]"))),
            alive=bool(w),
            memory={k: float(v) for k, v in json.loads(w.get("memory", "{}")).items()},
            children=children,
            children_at=children_at,
            budgets=_budgets(w.get("budgets")),
            last_seen=_f(seen.get(host)),
        )
    # Rule 3: autosize raises the LLM limit only; other types keep the configured one.
    limits = {t: auto.effective if t == "llm" else s.pool.max_loaded_models for t in TYPES}
    snap = Snapshot(
        models,
        workers,
        limits,
        now,
        s.pool.load_timeout_s,
        auto_evict=s.pool.auto_evict,
        auto_evict_threshold=s.pool.auto_evict_threshold,
        max_busy_s=s.pool.max_busy_s,
        min_resident_s=s.pool.min_resident_s,
    )
    return Read(
        snap,
        raw,
        worker_hashes,
        auto,
        tuple(sorted(helpers)),
        by_user,
        cache_hashes,
        load_s=load_s,
    )


def _slots(h: dict[str, str], in_flight: int) -> dict[str, int] | None:
    """A loaded model's slots: how many requests it decodes together, and how many run."""
    if not h.get("parallel"):
        return None
    parallel = int(h["parallel"])
    return {"parallel": parallel, "busy": min(in_flight, parallel)}


def _cache(h: dict[str, str] | None) -> dict[str, int]:
    h = h or {}
    return {k: int(float(h.get(k) or 0)) for k in ("entries", "bytes", "hits")}


def health_record(
    rd: Read,
    s: Settings,
    enforcement: dict[str, Any] | None = None,
    routing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The /health document (without ``generation``, which publishing stamps). ``routing``: per
    router policy, its last hour's choices and prediction error (``residency.route_stats``)."""
    snap, raw, worker_hashes = rd.snap, rd.model_hashes, rd.worker_hashes
    models = []
    for m in sorted(snap.models.values(), key=lambda m: m.name):
        h = raw.get(m.name, {})
        until = None if m.occupying else backoff_until(m, snap)
        backoff = (
            None
            if until is None
            else {
                "failures": len(recent_failures(m, snap)),
                "until": until,
                "last_error": m.last_error,
            }
        )
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
                "slots": _slots(h, m.in_flight),
                "queued": m.queued,
                "queued_by_user": rd.queued_by_user.get(m.name, {}),
                "host": m.host,
                "device": m.device,
                "pid": int(h["pid"]) if h.get("pid") else None,
                "last_used": m.last_used or None,
                "load_seconds": _f(h.get("load_seconds")),
                "loading_since": m.loading_since if m.state is states.ModelState.LOADING else None,
                "error": h.get("error") or None,
                "backoff": backoff,
                # A resident giving its slot to a waiting model: it admits nothing new.
                "yielding": (
                    {"for": m.yielding, "since": m.yielding_since} if m.is_yielding else None
                ),
                # Its memory as measured after its load, and the estimate for it (bytes).
                "footprint_bytes": _int(h.get("footprint_bytes")),
                "estimate_bytes": _int(h.get("estimate_bytes")),
                # What its next load is counted for, per device kind.
                "expected_bytes": dict(m.need_bytes),
                # Its saved slot caches as its last process left them.
                "cache": _cache(rd.cache_hashes.get(m.name)),
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
                # Outlives the record: when a gone host was last seen (its agent's clock).
                "last_seen": w.last_seen,
                "pid": int(wh["pid"]) if wh.get("pid") else None,
                "memory_total": int(wh["memory_total"]) if wh.get("memory_total") else None,
                "memory_used": json.loads(wh.get("memory", "{}")),
                # The host's slot cache folder: its entries and bytes on disk.
                "slot_cache": json.loads(wh["slot_cache"]) if wh.get("slot_cache") else None,
            }
        )
    return {
        "status": "ok",
        "version": __version__,
        "max_models": {
            t: {"configured": s.pool.max_loaded_models, "effective": snap.limits[t]} for t in TYPES
        },
        "llm_pool_autosize": rd.autosize.health(),
        "routing_helpers": list(rd.helpers),
        "routing": routing or {},
        "auto_evict": {"enabled": s.pool.auto_evict, "threshold": s.pool.auto_evict_threshold},
        "models": models,
        "workers": workers,
        # Each live device's memory ledger: its budget, and the bytes each resident holds there.
        "devices": room_of(snap).report(),
        "enforcement": enforcement or {},
        "published_at": snap.now,
    }
