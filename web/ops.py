"""Operations endpoints: liveness, readiness, the health record and Prometheus metrics."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import redis
from flask import Blueprint, Response, jsonify
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from residency import keys, pull_store
from residency.metrics import RedisCollector
from web.state import state

bp = Blueprint("ops", __name__)

RETRY_AFTER_S = 2
#: The newest pulls /health lists (GET /admin/pulls lists them all).
HEALTH_PULLS = 20


def _unavailable(body: dict[str, Any]) -> Response:
    resp = jsonify(body)
    resp.status_code = 503
    resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp


@bp.get("/livez")
def livez() -> Any:
    return jsonify({"status": "ok"})


def _not_ready_reasons(r: redis.Redis) -> list[str]:
    try:
        pipe = r.pipeline(transaction=False)
        pipe.ping()
        pipe.exists(keys.leader())
        pipe.smembers(keys.workers())
        _pong, leader, hosts = pipe.execute()
        reasons = [] if leader else ["no coordinator leader"]
        alive = 0
        if hosts:
            check = r.pipeline(transaction=False)
            for h in sorted(hosts):
                check.exists(keys.worker(h))
            alive = sum(check.execute())
        if not alive:
            reasons.append("no live worker agent")
        return reasons
    except redis.RedisError as e:
        return [f"Redis unreachable: {e.__class__.__name__}"]


@bp.get("/readyz")
def readyz() -> Any:
    # The probe client has short timeouts and no retries: an unreachable Redis fails this at
    # once, so a load balancer stops sending traffic without waiting out the request timeouts.
    reasons = _not_ready_reasons(state().probe)
    if reasons:
        return _unavailable({"status": "not_ready", "reasons": reasons})
    return jsonify({"status": "ready"})


@bp.get("/health")
def health() -> Any:
    st = state()
    # One HGETALL: the record and its generation come from the same published snapshot.
    h = st.r.hgetall(keys.health())
    raw = h.get("record") if isinstance(h, dict) else None
    # Checked on every call (one stat of the config file, a reload only if something changed),
    # so a broken config file is named here even before anything else reloads settings.
    st.refresh()
    if not raw:
        return _unavailable({"status": "starting", "config_error": st.config_error()})
    record = json.loads(raw)
    record["generation"] = int(h.get("generation") or record.get("generation") or 0)
    # This web process's view: why its last settings reload failed (it keeps serving with the
    # last good settings), or null.
    record["config_error"] = st.config_error()
    # Model pulls, read live (the agents write their progress; no coordinator pass needed).
    record["pulls"] = pull_store.listing(st.r, limit=HEALTH_PULLS)
    return jsonify(record)


class _Forward(Collector):
    """Exposes an existing registry inside a fresh one (so per-request collectors never get
    registered twice on the process-wide default registry)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        yield from self.source.collect()


@bp.get("/metrics")
def metrics() -> Any:
    reg = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(reg)
    else:
        reg.register(_Forward(REGISTRY))
    st = state()
    reg.register(RedisCollector(st.r, per_user=st.refresh().settings.metrics.per_user))
    return Response(generate_latest(reg), mimetype=None, content_type=CONTENT_TYPE_LATEST)
