"""The model registry in Redis: what can be served, and with which load parameters.

Config-file models are seeded by the coordinator leader at start (``source = "file"``); the
admin API adds and replaces ``source = "admin"`` entries. A file model cannot be deleted through
the API (it would come back at the next start), only pinned or unpinned.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis

from residency import keys
from residency.box import commit_change
from residency.settings import STORED, ModelSpec, Settings


@dataclass(frozen=True)
class Entry:
    name: str
    spec: ModelSpec
    source: str  # "file" | "admin"

    def dumps(self) -> str:
        return json.dumps({"spec": self.spec.model_dump(), "source": self.source})

    @classmethod
    def loads(cls, name: str, raw: str) -> Entry:
        d = json.loads(raw)
        return cls(name, ModelSpec.model_validate(d["spec"], context={STORED: True}), d["source"])

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, **self.spec.model_dump()}


class PathNotAllowed(ValueError):
    pass


def check_path(path: str, allowed_dirs: Iterable[str | Path]) -> str:
    """Resolve ``path`` (relative to the first allowed dir) and refuse anything outside the
    allowed dirs after symlinks and ``..`` are resolved."""
    dirs = [Path(d).resolve() for d in allowed_dirs]
    p = Path(path)
    if not dirs:
        raise PathNotAllowed(f"path {path!r}: no model directories are configured")
    if not p.is_absolute():
        p = dirs[0] / p
    real = Path(os.path.realpath(p))
    for d in dirs:
        if real == d or d in real.parents:
            return str(real)
    shown = ", ".join(str(d) for d in dirs)
    raise PathNotAllowed(f"path {path!r} is outside the model directories ({shown})")


def model_dirs(models_dir: Path | None, s: Settings) -> list[Path]:
    """The folders admin-registered model files must lie in: the data dir's ``models`` folder
    and ``server.model_dirs`` (restart-only, so the admin API cannot widen them). Without a
    data dir only the configured folders count (stricter, never wider)."""
    configured = [Path(d) for d in s.server.model_dirs]
    return configured if models_dir is None else [models_dir, *configured]


def load_dirs(entry: Entry, models_dir: Path | None, s: Settings) -> list[str] | None:
    """The folders the model process re-checks the real path of ``entry``'s file against just
    before it loads (a file swapped for a symlink after registration must not escape them).
    None for config-file models: their paths are the operator's and were never confined."""
    if entry.source != "admin" or entry.spec.path is None:
        return None
    return [str(d) for d in model_dirs(models_dir, s)]


def all_entries(r: redis.Redis) -> dict[str, Entry]:
    raw = cast(dict[str, str], r.hgetall(keys.registry()))
    return {n: Entry.loads(n, v) for n, v in raw.items()}


def get(r: redis.Redis, name: str) -> Entry | None:
    raw = r.hget(keys.registry(), name)
    return Entry.loads(name, raw) if raw else None  # type: ignore[arg-type]


def kv_layout(spec: ModelSpec, parallel: int | None = None) -> tuple[object, ...]:
    """The fields of a spec a saved slot state depends on (the file, its type, the context and
    slot layout — ``parallel`` as loaded, else as configured —, flash attention, the vision
    projector that made an image's KV): a replacement that changes any of them clears the
    model's saved slot caches, and a load's spec digest (``workers.slot_cache.spec_digest``) is
    made of them."""
    slots = spec.parallel if parallel is None else parallel
    return (spec.path, spec.type, spec.n_ctx, slots, spec.flash_attn, spec.mmproj)


def put(r: redis.Redis, entry: Entry, actor: str) -> int:
    """Store ``entry``; when it replaces one of another KV layout (``kv_layout``), its saved slot
    caches become stale in the same MULTI (the stored entry is read under WATCH)."""
    relaid: list[bool] = [False]

    def check(pipe: Any) -> None:
        raw = pipe.hget(keys.registry(), entry.name)
        old = Entry.loads(entry.name, raw) if raw else None
        relaid[0] = old is not None and kv_layout(old.spec) != kv_layout(entry.spec)

    def op(p: Any) -> None:
        p.hset(keys.registry(), entry.name, entry.dumps())
        if relaid[0]:
            clear_slot_caches(p, entry.name)

    return commit_change(
        r,
        actor,
        "model.put",
        entry.public(),
        op,
        absent=(keys.policies(), entry.name),  # a policy may not share the name
        read=(keys.registry(), check),
    )


def delete(r: redis.Redis, name: str, actor: str) -> int:
    def op(p: Any) -> None:
        p.hdel(keys.registry(), name)
        clear_slot_caches(p, name)

    return commit_change(r, actor, "model.delete", {"name": name}, op)


def clear_slot_caches(p: Any, name: str | None, records: Iterable[str] = ()) -> None:
    """Queue on ``p``: the saved slot caches of ``name`` (None: of every model) are stale from
    now on (never restored; deleted by the agent of each host at its next heartbeat), and the
    cache records of ``name`` and of ``records`` (every model's, for None) say so."""
    p.hincrby(keys.kvcache_epochs(), "*" if name is None else name, 1)
    for n in {*records, *([name] if name is not None else [])}:
        p.delete(keys.kvcache(n))


class Missing(KeyError):
    """No model of that name is registered."""


def set_pinned(r: redis.Redis, name: str, pinned: bool, actor: str) -> int:
    """Pin or unpin the stored entry ``name``: read and written under WATCH, so a PUT or a
    DELETE that lands in between is never undone (the pin is made on what the PUT stored; after
    a DELETE it raises ``Missing``)."""
    new: list[Entry] = []

    def check(pipe: Any) -> None:
        raw = pipe.hget(keys.registry(), name)
        if not raw:
            raise Missing(name)
        entry = Entry.loads(name, raw)
        new[:] = [Entry(name, entry.spec.model_copy(update={"pinned": pinned}), entry.source)]

    return commit_change(
        r,
        actor,
        "model.pin",
        {"name": name, "pinned": pinned},
        lambda p: p.hset(keys.registry(), name, new[0].dumps()),
        read=(keys.registry(), check),
    )


def seed_from_file(r: redis.Redis, models: dict[str, ModelSpec]) -> None:
    """Make the registry's file entries equal the config file's models. Admin entries stay; a
    file model whose name an admin entry took keeps the admin entry (admin wins)."""
    current = all_entries(r)
    pipe = r.pipeline(transaction=True)
    for name, e in current.items():
        if e.source == "file" and name not in models:
            pipe.hdel(keys.registry(), name)
    for name, spec in models.items():
        old = current.get(name)
        if old is not None and old.source == "admin":
            continue
        if old is not None and old.source == "file":
            # Keep a pin set through the API across restarts of an unchanged file entry.
            spec = spec.model_copy(update={"pinned": spec.pinned or old.spec.pinned})
        pipe.hset(keys.registry(), name, Entry(name, spec, "file").dumps())
    pipe.execute()
