"""What a load of each local router candidate would take right now: the room the router reads.

Pure. Published with each pass's health record (``keys.health`` field ``route_room``) so the
router (``residency.route_wait``) can predict the wait of a cold candidate without playing the
pool's decisions itself. It is computed by the same decisions the coordinator takes
(``residency.pool.fit``), with one more change to the pool than fit makes: every resident is
taken as idle. Which residents are busy changes with every request, and the router adds their
wait from its own live counts (``route_wait.drain_s``); what the pool tells it is only which
residents would go and how long each one's turn still keeps its slot.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from residency import footprint
from residency.pool.decide import ModelView, Snapshot, in_turn
from residency.pool.fit import fit

if TYPE_CHECKING:
    from residency.pool.snapshot import Read


def idle(snap: Snapshot) -> Snapshot:
    """The pool with every resident idle: nothing queued or in flight on it."""
    models = {
        n: (replace(m, queued=0, in_flight=0, demand_since=None) if m.occupying else m)
        for n, m in snap.models.items()
    }
    return replace(snap, models=models)


def turn_left(m: ModelView, snap: Snapshot) -> float:
    """Seconds until ``m``'s turn is over (``decide.in_turn``): its turn ends at whichever
    comes first of ``min_resident_s`` after its load and ``turn_idle_s`` after its last use."""
    if not in_turn(m, snap) or m.loaded_at is None:
        return 0.0
    ends = min(
        m.loaded_at + snap.min_resident_s,
        m.last_used + min(snap.turn_idle_s, snap.min_resident_s),
    )
    return max(0.0, ends - snap.now)


def _bytes(m: ModelView, device: str | None) -> int | None:
    """Its expected bytes on ``device`` (of fit's choice), else the largest it needs anywhere."""
    need = dict(m.need_bytes)
    if device is not None and footprint.device_kind(device) in need:
        return need[footprint.device_kind(device)]
    return max(need.values()) if need else None


def _load_s(measured: dict[str, float] | None, device: str | None) -> float | None:
    """The measured load seconds (per device kind) that hold for a load on ``device``; without a
    device (it does not fit), the one measured, if any."""
    if not measured:
        return None
    if device is not None:
        return measured.get(footprint.device_kind(device))
    return max(measured.values())


def room(
    snap: Snapshot,
    name: str,
    measured_load_s: dict[str, float] | None = None,
    unload_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    """What a load of the cold model ``name`` would need now. ``measured_load_s``: its load's
    measured seconds per device kind, for the spec it would load now (``Read.load_s``);
    ``unload_s``: how long each model's last unload took (``unloaded_s``)."""
    m = snap.models[name]
    answer = fit(idle(snap), name)
    device = answer.get("device") if answer["fits"] else None
    victims = [str(e["model"]) for e in answer.get("evict", [])]
    return {
        "fits": bool(answer["fits"]),
        "reason": str(answer["reason"]),
        "evict": victims,
        "turn_left": {
            v: round(turn_left(snap.models[v], snap), 3) for v in victims if v in snap.models
        },
        "unload_s": {v: (unload_s or {})[v] for v in victims if v in (unload_s or {})},
        "load_s": _load_s(measured_load_s, device),
        "load_bytes": _bytes(m, device),
    }


def asked(snap: Snapshot, candidates: frozenset[str]) -> list[str]:
    """The candidates the room is published for: registered local LLMs holding no slot."""
    return sorted(
        n
        for n in candidates
        if (m := snap.models.get(n)) is not None
        and m.registered
        and m.type == "llm"
        and not m.occupying
    )


def unloaded_s(hashes: dict[str, dict[str, str]]) -> dict[str, float]:
    """How long each model's last unload took (``unload_s`` in its model hash, written by
    ``try_unload.lua``: from the start of its drain to its unload)."""
    out: dict[str, float] = {}
    for n, h in hashes.items():
        try:
            out[n] = float(h["unload_s"])
        except (KeyError, ValueError):
            continue
    return out


def published(rd: Read) -> dict[str, Any]:
    """The ``route_room`` field of one pass: per cold candidate of any policy, its room."""
    snap = rd.snap
    unload = unloaded_s(rd.model_hashes)
    return {
        "models": {
            n: room(snap, n, rd.load_s.get(n), unload)
            for n in asked(snap, rd.autosize.floor.candidates)
        },
        "max_busy_s": snap.max_busy_s,
    }
