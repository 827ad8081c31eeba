"""Router policies in Redis, next to the model registry.

Policies are checked against the registry when they are written (``policies.parse_policy``).
Stored ones are read back with their structure checked only: a candidate whose model was
deleted later stays in the policy, so the candidate floor counts it (and logs it) instead of
shrinking silently.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis
from pydantic import ValidationError

from residency import keys
from residency.box import commit_change
from residency.policies import ModelInfo, Policy
from residency.registry import Entry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyEntry:
    name: str
    spec: dict[str, Any]  # as written (validated on entry)
    source: str  # "file" | "admin"

    def dumps(self) -> str:
        return json.dumps({"spec": self.spec, "source": self.source})

    @classmethod
    def loads(cls, name: str, raw: str) -> PolicyEntry:
        d = json.loads(raw)
        return cls(name, d["spec"], d["source"])

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, **self.spec}


def model_infos(entries: Mapping[str, Entry]) -> dict[str, ModelInfo]:
    return {n: ModelInfo(e.spec.type, e.spec.remote) for n, e in entries.items()}


def all_entries(r: redis.Redis) -> dict[str, PolicyEntry]:
    raw = cast(dict[str, str], r.hgetall(keys.policies()))
    return {n: PolicyEntry.loads(n, v) for n, v in raw.items()}


def get(r: redis.Redis, name: str) -> PolicyEntry | None:
    raw = cast(str | None, r.hget(keys.policies(), name))
    return PolicyEntry.loads(name, raw) if raw else None


def parsed(entries: Mapping[str, PolicyEntry]) -> dict[str, Policy]:
    """Every stored policy whose structure still parses; one that does not (written by an older
    version) is logged and left out rather than failing every reader."""
    out: dict[str, Policy] = {}
    for name, e in entries.items():
        try:
            out[name] = Policy.model_validate(e.spec)
        except ValidationError as err:
            log.error("stored policy %s does not parse and is ignored: %s", name, err)
    return out


def put(r: redis.Redis, entry: PolicyEntry, actor: str) -> int:
    return commit_change(
        r,
        actor,
        "policy.put",
        entry.public(),
        lambda p: p.hset(keys.policies(), entry.name, entry.dumps()),
        absent=(keys.registry(), entry.name),  # a model may not share the name
    )


def delete(r: redis.Redis, name: str, actor: str) -> int:
    return commit_change(
        r, actor, "policy.delete", {"name": name}, lambda p: p.hdel(keys.policies(), name)
    )


def seed_from_file(r: redis.Redis, policies: Mapping[str, dict[str, Any]]) -> None:
    """Make the stored file policies equal the config file's; admin ones stay (admin wins)."""
    current = all_entries(r)
    pipe = r.pipeline(transaction=True)
    for name, e in current.items():
        if e.source == "file" and name not in policies:
            pipe.hdel(keys.policies(), name)
    for name, spec in policies.items():
        old = current.get(name)
        if old is not None and old.source == "admin":
            continue
        pipe.hset(keys.policies(), name, PolicyEntry(name, dict(spec), "file").dumps())
    pipe.execute()
