"""The model state machine and the key schema."""

from __future__ import annotations

import inspect

import pytest

from residency import keys
from residency.states import OCCUPYING, TRANSITIONS, ModelState, can_transition, parse, sources_for


def test_every_state_has_a_row_and_a_way_back_to_unloaded() -> None:
    assert set(TRANSITIONS) == set(ModelState)
    for s in ModelState:
        assert (
            s is ModelState.UNLOADED
            or can_transition(s, ModelState.UNLOADED)
            or any(can_transition(n, ModelState.UNLOADED) for n in TRANSITIONS[s])
        )


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        ("unloaded", "loading", True),
        ("unloaded", "ready", False),
        ("loading", "ready", True),
        ("ready", "draining", True),
        ("ready", "loading", False),
        ("draining", "ready", True),  # rescued: work arrived while draining
        ("draining", "unloaded", True),
        ("failed", "loading", True),
        ("failed", "ready", False),
    ],
)
def test_transition_table(src: str, dst: str, ok: bool) -> None:
    assert can_transition(ModelState(src), ModelState(dst)) is ok


def test_sources_for_is_the_inverse_of_the_table() -> None:
    assert sources_for(ModelState.DRAINING) == {ModelState.READY}
    assert sources_for(ModelState.LOADING) == {ModelState.UNLOADED, ModelState.FAILED}


def test_missing_state_is_unloaded_and_occupying_states() -> None:
    assert parse(None) is ModelState.UNLOADED
    assert {ModelState.LOADING, ModelState.READY, ModelState.DRAINING} == OCCUPYING


def test_every_key_function_is_prefixed_documented_and_distinct() -> None:
    # ``*_field`` functions name fields inside a hash, not keys.
    fns = [
        f
        for n, f in inspect.getmembers(keys, inspect.isfunction)
        if f.__module__ == keys.__name__ and not n.endswith("_field")
    ]
    seen = set()
    for f in fns:
        args = ["m"] * len(inspect.signature(f).parameters)
        k = f(*args)
        assert k.startswith(keys.PREFIX), f.__name__
        assert f.__doc__ and len(f.__doc__) > 20, f.__name__
        assert k not in seen, f.__name__
        seen.add(k)
