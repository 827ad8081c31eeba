"""A spec's measured load time (what the router predicts a cold candidate's load from) is a
moving average over its loads, so a load that found the agent's warm process and one that did
not both count; another spec's time never carries over."""

from __future__ import annotations

import pytest

from workers.model_process import LOAD_EWMA, load_average


def test_the_first_load_of_a_spec_is_its_time() -> None:
    assert load_average([None, None], "d1", 1.5) == 1.5
    assert load_average([], "d1", 1.5) == 1.5


def test_later_loads_of_the_same_spec_are_averaged() -> None:
    got = load_average(["1.0", "d1"], "d1", 0.1)
    assert got == pytest.approx(1.0 + LOAD_EWMA * (0.1 - 1.0))
    assert 0.1 < got < 1.0


def test_another_spec_or_a_damaged_value_starts_afresh() -> None:
    assert load_average(["1.0", "d0"], "d1", 0.2) == 0.2
    for bad in ("nan", "-1", "x", "inf"):
        assert load_average([bad, "d1"], "d1", 0.2) == 0.2
