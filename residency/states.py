"""Model residency states and the only transitions allowed between them.

Every write of a model's state goes through ``residency.lua.Scripts.transition`` which takes the
allowed source states from ``sources_for`` — so this table is the single definition of the state
machine, for Python and Lua alike.
"""

from __future__ import annotations

import enum


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


S = ModelState

TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    # The coordinator starts a load.
    S.UNLOADED: frozenset({S.LOADING}),
    # The model process announces ready or failure; the agent reports a process that died while
    # loading (failed) and the reaper resets a load whose host vanished (unloaded).
    S.LOADING: frozenset({S.READY, S.FAILED, S.UNLOADED}),
    # The coordinator begins an eviction (draining); the agent or reaper reports a dead process.
    S.READY: frozenset({S.DRAINING, S.UNLOADED}),
    # The model process commits the unload, or refuses it because work arrived ("rescued").
    S.DRAINING: frozenset({S.UNLOADED, S.READY}),
    # A failed model may be loaded again on new demand, or cleared.
    S.FAILED: frozenset({S.LOADING, S.UNLOADED}),
}

#: States that hold a slot in their pool (a loading model already takes its memory).
OCCUPYING: frozenset[ModelState] = frozenset({S.LOADING, S.READY, S.DRAINING})


def can_transition(src: ModelState, dst: ModelState) -> bool:
    return dst in TRANSITIONS[src]


def sources_for(dst: ModelState) -> frozenset[ModelState]:
    """Every state from which ``dst`` may be entered."""
    return frozenset(src for src, dsts in TRANSITIONS.items() if dst in dsts)


def parse(value: str | bytes | None) -> ModelState:
    """A missing state hash means the model was never loaded."""
    if value is None:
        return S.UNLOADED
    if isinstance(value, bytes):
        value = value.decode()
    return ModelState(value)
