"""A request's ``timings``: where its time went, from the model process's clock readings."""

from __future__ import annotations

from workers.timings import Timings


def test_the_three_spans_and_the_counts() -> None:
    t = Timings(submitted=100.0, taken=100.5)
    calls: list[int] = []
    step = t.on_step(lambda: calls.append(1))
    t.first = None
    step()
    first = t.first
    assert first is not None and calls == [1]
    step()  # later tokens do not move the first one
    assert t.first == first and calls == [1, 1]
    t.first = 101.0
    out = t.report([40, 8, 32], end=103.0)
    assert out == {
        "queue_ms": 500.0,
        "prompt_n": 40,
        "cache_n": 32,
        "prompt_ms": 500.0,
        "predicted_n": 8,
        "predicted_ms": 2000.0,
    }


def test_no_token_and_a_clock_skew_read_as_zero_not_negative() -> None:
    # Web's host clock ahead of this one: the queue cannot have taken less than nothing.
    t = Timings(submitted=200.0, taken=199.0)
    out = t.report([], end=199.5)
    assert out["queue_ms"] == 0.0
    assert out["prompt_ms"] == 500.0 and out["predicted_ms"] == 0.0
    assert (out["prompt_n"], out["cache_n"], out["predicted_n"]) == (0, 0, 0)
