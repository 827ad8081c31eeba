"""A gate's progress (pure): engine steps count as progress beside generated tokens, and noting
one never raises — it runs on the engine thread, which must not stop for one request."""

from __future__ import annotations

import threading

import pytest

from workers.gate import Gate, Stopped


def test_engine_steps_are_progress_and_never_raise() -> None:
    stop = threading.Event()
    gate = Gate("r1", 0.0, stop)
    gate.progress()
    gate.progress()
    assert gate.moves == 2 and gate.steps == 0
    stop.set()
    gate.cancelled.set()
    gate.progress()  # stopped and cancelled: still only counted
    assert gate.moves == 3
    with pytest.raises(Stopped):
        gate.step()  # a token is where a request is stopped
    assert gate.moves == 4 and gate.steps == 1
