"""The router's view of its listed candidates (``residency.route_wait.View``), read from Redis in
one round trip (``route_view.lua``), two when a cold candidate's load would evict residents that
are not themselves listed.

What each view holds, and where it comes from:

- the live numbers (state, slots, queue, in flight, the queued requests ahead of this caller's
  turn, the measured pace) from the model's own keys, at the instant of the read;
- what a cold candidate's load would take (its victims, its measured load time, whether it fits
  at all) from the coordinator's last pass (``keys.health`` field ``route_room``): the pool's
  own decisions, never re-derived here;
- which candidates served this caller's conversation before (``keys.route_prefix``): a prefix
  that candidate still holds in a slot, or saved in its slot cache when it was unloaded, is
  not prefilled again.

``views`` (pure) turns what was read into views; ``read`` does the reading.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from residency import ledger
from residency.lua import Scripts
from residency.route_wait import Occupant, Service, View
from residency.settings import ModelSpec

#: Rows of ``route_view.lua``: the fields read per model, in its order.
FIELDS = (
    "state",
    "parallel",
    "loading_since",
    "loaded_at",
    "last_used",
    "queued",
    "in_flight",
    "service",
    "ahead",
)


#: What the pool answers (``residency.pool.fit``'s reasons) for a cold model whose request would
#: be refused or fail now, not served later: it is left out of a ``fastest`` choice.
NEVER_NOW = frozenset({"too_large", "memory_pinned", "slots_pinned", "backoff", "no_worker"})


@dataclass(frozen=True)
class Row:
    """One model's live numbers."""

    state: str = ""
    parallel: int | None = None
    loading_since: float | None = None
    loaded_at: float | None = None
    last_used: float | None = None
    queued: int = 0
    in_flight: int = 0
    service: Service = field(default_factory=Service)
    ahead: int = 0

    @classmethod
    def parse(cls, raw: Sequence[str]) -> Row:
        d = dict(zip(FIELDS, raw, strict=False))
        return cls(
            state=d.get("state", ""),
            parallel=_int(d.get("parallel")),
            loading_since=_float(d.get("loading_since")),
            loaded_at=_float(d.get("loaded_at")),
            last_used=_float(d.get("last_used")),
            queued=_int(d.get("queued")) or 0,
            in_flight=_int(d.get("in_flight")) or 0,
            service=Service.parse(d.get("service")),
            ahead=_int(d.get("ahead")) or 0,
        )


@dataclass(frozen=True)
class Caller:
    """What the caller may do: use a model (its key's scopes), and load a cold one."""

    may_use: Callable[[str], bool] = lambda _name: True
    may_load: bool = True


@dataclass(frozen=True)
class Read:
    views: tuple[View, ...]
    room: Mapping[str, Any]  # the published route room (empty before the first pass)


def _float(v: Any) -> float | None:
    """A finite number, or None (a missing or damaged field never turns into NaN or inf)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _int(v: Any) -> int | None:
    f = _float(v)
    return None if f is None else int(f)


def _json(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        out = json.loads(raw)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def cached_bytes(
    name: str, row: Row, prefix: Mapping[str, Any], prompt_bytes: int, slot_cache: bool
) -> int:
    """The bytes of this prompt that candidate ``name`` is expected to hold: the conversation's
    last prompt there (at most this one), if the process that served it is still the resident
    one, or if it was unloaded since and its slots were saved to the slot cache."""
    seen = prefix.get(name)
    if not isinstance(seen, list) or len(seen) != 2:
        return 0
    at, size = _float(seen[0]), _int(seen[1])
    if at is None or size is None:
        return 0
    same_process = row.state == "ready" and row.loaded_at is not None and row.loaded_at <= at
    if not same_process and not slot_cache:
        return 0
    return max(0, min(size, prompt_bytes))


def victims_of(room: Mapping[str, Any], name: str) -> list[str]:
    entry = room.get("models", {}).get(name) if isinstance(room.get("models"), dict) else None
    if not isinstance(entry, dict):
        return []
    return [str(v) for v in entry.get("evict") or [] if isinstance(v, str)]


def view(
    name: str,
    spec: ModelSpec | None,
    row: Row,
    room: Mapping[str, Any],
    others: Mapping[str, Row],
    *,
    now: float,
    caller: Caller,
    cached: int,
) -> View:
    """One listed candidate's view (pure). ``spec`` None: not registered (excluded);
    ``others``: the live rows of the residents its load would evict."""
    if spec is None:
        return View(name, excluded="not registered")
    if spec.remote:
        excluded = "" if caller.may_use(name) else "key"
        return View(name, remote=True, excluded=excluded)
    if not caller.may_use(name):
        return View(name, excluded="key")
    max_busy = float(room.get("max_busy_s") or 0.0)
    models = room.get("models")
    entry = models.get(name) if isinstance(models, dict) else None
    parallel = row.parallel or ledger.slots(spec, "cpu")
    common: dict[str, Any] = {
        "parallel": parallel,
        "ahead": row.ahead,
        "service": row.service,
        "cached_bytes": cached,
        "max_busy_s": max_busy,
    }
    if row.state == "ready":
        return View(name, state="ready", in_flight=row.in_flight, **common)
    if not caller.may_load:
        # Its request would be refused 409 (model_not_resident): not a candidate for this key.
        return View(name, excluded="may_load")
    load_s = _float(entry.get("load_s")) if isinstance(entry, dict) else None
    load_bytes = _int(entry.get("load_bytes")) if isinstance(entry, dict) else None
    if row.state == "loading":
        since = row.loading_since if row.loading_since is not None else now
        return View(
            name,
            state="loading",
            load_s=load_s,
            load_bytes=load_bytes,
            loading_for_s=max(0.0, now - since),
            **common,
        )
    if isinstance(entry, dict) and not entry.get("fits", True):
        reason = str(entry.get("reason") or "no room")
        if reason in NEVER_NOW:
            # The pool's own answer: its request would be refused or fail.
            return View(name, state="unavailable", excluded=reason)
        # Otherwise the room is on its way (a slot or bytes draining, an eviction under way):
        # predicted as a cold load.
    turn_left = entry.get("turn_left") if isinstance(entry, dict) else None
    unload = entry.get("unload_s") if isinstance(entry, dict) else None
    occupants = []
    for victim in victims_of(room, name):
        o = others.get(victim, Row())
        left = _float(turn_left.get(victim)) if isinstance(turn_left, dict) else None
        took = _float(unload.get(victim)) if isinstance(unload, dict) else None
        occupants.append(
            Occupant(
                victim,
                in_flight=o.in_flight,
                queued=o.queued,
                parallel=o.parallel or 1,
                service_s=o.service.service_s,
                turn_left_s=left or 0.0,
                unload_s=took or 0.0,
            )
        )
    return View(
        name,
        state="cold",
        load_s=load_s,
        load_bytes=load_bytes,
        victims=tuple(occupants),
        **common,
    )


def read(
    scripts: Scripts,
    listed: Sequence[tuple[str, ModelSpec | None]],
    *,
    user: str,
    fair: bool,
    prefix_key: str,
    prompt_bytes: int,
    now: float,
    caller: Caller,
    slot_cache: bool,
) -> Read:
    """The views of ``listed`` (name, its spec or None when unregistered), in their order."""
    local = [n for n, spec in listed if spec is not None and not spec.remote]
    room_raw, prefix_raw, rows_raw = (
        scripts.route_view(local, user=user, fair=fair, prefix_key=prefix_key)
        if local
        else (None, None, [])
    )
    rows = {n: Row.parse(r) for n, r in zip(local, rows_raw, strict=True)}
    room = _json(room_raw)
    prefix = _json(prefix_raw)
    # The residents a cold candidate's load would evict, when they are not listed themselves.
    extra = sorted(
        {
            v
            for n in local
            if rows[n].state not in ("ready", "loading")
            for v in victims_of(room, n)
            if v not in rows
        }
    )
    if extra:
        _, _, more = scripts.route_view(extra, user=user, fair=fair, prefix_key=prefix_key)
        rows.update({n: Row.parse(r) for n, r in zip(extra, more, strict=True)})
    out = []
    for name, spec in listed:
        row = rows.get(name, Row())
        cached = cached_bytes(name, row, prefix, prompt_bytes, slot_cache)
        out.append(
            view(
                name,
                spec,
                row,
                room,
                rows,
                now=now,
                caller=caller,
                cached=cached,
            )
        )
    return Read(tuple(out), room)
