"""Would a model fit now, where, and what would be evicted for it: the answer of
``POST /admin/models/{name}/fit``, computed by the same decisions the coordinator takes.

Pure. The pool is taken as it is, with one change: the model asks for a load and nothing else
waits for one (other models' queued requests and preloads are left out: the question is about
this model), and a resident's turn (a moment of grace after its last request) as over. The
decisions are then played forward — planned evictions done, draining residents
gone — until the model is placed or nothing more can happen.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from residency.pool.decide import (
    Backoff,
    Evict,
    Load,
    ModelView,
    Reject,
    Snapshot,
    Wait,
    decide,
    room_of,
)
from residency.states import ModelState

#: Rounds of decisions played forward: one to plan evictions, one to place after them, and one
#: spare for a count eviction followed by a byte one.
ROUNDS = 4
_FOR_IT = ("lru", "room", "yield")


def _asking(snap: Snapshot, name: str) -> Snapshot:
    models: dict[str, ModelView] = {}
    for n, m in snap.models.items():
        if n == name:
            m = replace(m, explicit="load", demand_since=snap.now, preload=False)
        elif not m.occupying:
            m = replace(m, queued=0, demand_since=None, preload=False, explicit=None)
        models[n] = m
    # A resident in its turn keeps its slot for under a second (``decide.TURN_IDLE_S``): the
    # question is what the pool can give, so turns are taken as over.
    return replace(snap, models=models, turn_idle_s=0.0)


def _gone(m: ModelView) -> ModelView:
    return replace(m, state=ModelState.UNLOADED, host=None, device=None, held_bytes=None)


def fit(snap: Snapshot, name: str) -> dict[str, Any]:
    """The answer for the registered model ``name`` (present in ``snap.models``)."""
    m = snap.models[name]
    answer: dict[str, Any] = {"model": name, "need_bytes": dict(m.need_bytes)}
    if m.occupying:
        return {
            **answer,
            "fits": True,
            "resident": True,
            "host": m.host,
            "device": m.device,
            "evict": [],
            "reason": m.state.value,
        }
    cur = _asking(snap, name)
    evicted: list[dict[str, Any]] = []
    reason = "no_worker"
    for _ in range(ROUNDS):
        acts = decide(cur)
        mine = [a for a in acts if getattr(a, "model", None) == name]
        load = next((a for a in mine if isinstance(a, Load)), None)
        if load is not None:
            ledger = next(
                d
                for d in room_of(cur).report()
                if (d["host"], d["device"]) == (load.host, load.device)
            )
            return {
                **answer,
                "fits": True,
                "resident": False,
                "now": not evicted,
                "host": load.host,
                "device": load.device,
                "bytes": m.need_on(load.device),
                "evict": evicted,
                "reason": "fits" if not evicted else "after_evictions",
                "device_ledger": ledger,
            }
        reject = next((a for a in mine if isinstance(a, Reject | Backoff)), None)
        if reject is not None:
            out = {**answer, "fits": False, "evict": [], "resident": False}
            if isinstance(reject, Backoff):
                return {**out, "reason": "backoff", "until": reject.until}
            extra = {"largest_budget_bytes": reject.largest} if reject.code == "too_large" else {}
            return {**out, "reason": reject.code, **extra}
        wait = next((a for a in mine if isinstance(a, Wait)), None)
        reason = wait.reason if wait is not None else reason
        # Play the round forward: what it evicts (for this model) and what drains is gone.
        going = {a.model: a.reason for a in acts if isinstance(a, Evict) and a.reason in _FOR_IT}
        draining = {
            n for n, v in cur.models.items() if v.state is ModelState.DRAINING and n != name
        }
        if not going and not draining:
            break
        for n, why in sorted(going.items()):
            v = cur.models[n]
            evicted.append({"model": n, "reason": why, "host": v.host, "device": v.device,
                            "bytes": v.bytes_held})  # fmt: skip
        cur = replace(
            cur,
            models={
                n: (_gone(v) if n in going or n in draining else v) for n, v in cur.models.items()
            },
        )
    return {**answer, "fits": False, "resident": False, "evict": [], "reason": reason}
