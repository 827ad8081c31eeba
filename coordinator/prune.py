"""Key hygiene: the leader deletes what nobody needs any more, so a box that runs for months
keeps a bounded keyspace — a host that is gone (its record expired) once its models are reaped,
and a model deleted from the registry once it holds no slot and no work. Which ones is decided
from the pass's snapshot (``coordinator.decide.forgettable``); each deletion is one script that
re-checks its condition, fenced by the lease.

A host is forgotten at once (in the pass that finds it gone with nothing left on it), not after
a grace: its agent re-registers with every heartbeat, so one that comes back loses nothing, and
the reap that freed its models already logged its going."""

from __future__ import annotations

import logging
from importlib.resources import files

import redis

from coordinator.decide import Forget
from residency import keys
from residency.lua import NotLeader
from residency.states import OCCUPYING

log = logging.getLogger("residency.coordinator")

_HOST = files("residency").joinpath("lua", "forget_host.lua").read_text()
_MODEL = files("residency").joinpath("lua", "forget_model.lua").read_text()
_OCCUPYING = ",".join(sorted(s.value for s in OCCUPYING))


def host_keys(host: str) -> list[str]:
    """Every key of one host besides its record and its place in the host set."""
    return [keys.agent_commands(host), keys.agent_taken(host)]


def forget(r: redis.Redis, what: Forget, *, lease: str) -> dict[str, list[str]]:
    """Delete the keys of ``what``; returns the hosts and models actually forgotten. A deposed
    leader deletes nothing: NotLeader."""
    done: dict[str, list[str]] = {"hosts": [], "models": []}
    if what.hosts:
        script = r.register_script(_HOST)
        for host in what.hosts:
            res = script(
                keys=[keys.workers(), keys.worker(host), keys.leader(), *host_keys(host)],
                args=[lease, host],
            )
            if _s(res) == "not_leader":
                raise NotLeader(f"host {host} not forgotten")
            if _s(res) == "ok":
                done["hosts"].append(host)
                log.info("forgot host %s: gone, and nothing of it left to reap", host)
    if what.models:
        script = r.register_script(_MODEL)
        for model in what.models:
            res = script(
                keys=[
                    keys.model(model),
                    keys.queue(model),
                    keys.processing(model),
                    keys.control(model),
                    keys.load_failures(model),
                    keys.models_with_state(),
                    keys.registry(),
                    keys.leader(),
                    keys.progress(model),
                ],
                args=[lease, model, _OCCUPYING],
            )
            if _s(res) == "not_leader":
                raise NotLeader(f"keys of {model} not deleted")
            if _s(res) == "ok":
                done["models"].append(model)
                log.info("deleted the keys of %s: no longer registered, holds nothing", model)
    return done


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
