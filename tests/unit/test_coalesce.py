"""Which passes wait for more admin changes before they run (DESIGN §4 rule 6)."""

from __future__ import annotations

from coordinator.loop import COALESCE_MAX_S, COALESCE_QUIET_S, coalesce_wait
from residency.messages import Event, EventType

CONFIG = Event(EventType.CONFIG)


def test_admin_changes_alone_wait_for_a_quiet_spell() -> None:
    assert coalesce_wait([CONFIG], 0.0) == COALESCE_QUIET_S
    assert coalesce_wait([CONFIG] * 20, 0.0) == COALESCE_QUIET_S


def test_the_wait_is_bounded_in_all() -> None:
    assert coalesce_wait([CONFIG], COALESCE_MAX_S - 0.01) < COALESCE_QUIET_S
    assert coalesce_wait([CONFIG], COALESCE_MAX_S) == 0.0
    assert coalesce_wait([CONFIG], COALESCE_MAX_S + 5) == 0.0


def test_any_other_trigger_runs_the_pass_at_once() -> None:
    for kind in (EventType.DEMAND, EventType.READY, EventType.IDLE, EventType.RETRY):
        assert coalesce_wait([CONFIG, Event(kind, "a")], 0.0) == 0.0
    assert coalesce_wait([], 0.0) == 0.0
