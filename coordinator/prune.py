"""Key hygiene: the leader deletes what nobody needs any more, so a box that runs for months
keeps a bounded keyspace — a host that is gone (its record expired) once its models are reaped
and it has been gone ``worker.forget_after_s``, and a model deleted from the registry once it
holds no slot and no work. Which ones is decided from the pass's snapshot
(``residency.pool.decide.forgettable``); each deletion is one script that re-checks its condition,
fenced by the lease.

Until then a gone host stays listed in ``/health`` (``alive: false``, ``last_seen``), so an
operator sees which host went and when; its models are reaped at once all the same (they do not
wait for the host to be forgotten). A host that comes back loses nothing either way: its agent
re-registers with every heartbeat."""

from __future__ import annotations

import logging

import redis

from residency.lua import Scripts
from residency.pool.decide import Forget

log = logging.getLogger("residency.coordinator")


def forget(r: redis.Redis, what: Forget, *, lease: str) -> dict[str, list[str]]:
    """Delete the keys of ``what``; returns the hosts and models actually forgotten. A deposed
    leader deletes nothing: NotLeader."""
    done: dict[str, list[str]] = {"hosts": [], "models": []}
    if not what.hosts and not what.models:
        return done
    scripts = Scripts(r)
    for host in what.hosts:
        if scripts.forget_host(host, lease=lease, seen_before=what.seen_before):
            done["hosts"].append(host)
            log.info("forgot host %s: gone, and nothing of it left to reap", host)
    for model in what.models:
        if scripts.forget_model(model, lease=lease):
            done["models"].append(model)
            log.info("deleted the keys of %s: no longer registered, holds nothing", model)
    return done
