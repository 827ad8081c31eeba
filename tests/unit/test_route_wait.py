"""The router's predicted waits and its choice among listed candidates (``residency.route_wait``).

Pure: concrete numbers for each term, then properties of ``choose`` over generated pools."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from residency.route_wait import (
    DEFAULT_SERVICE_S,
    LOAD_BASE_S,
    LOAD_BYTES_PER_S,
    LOADING_LEFT_MIN,
    Choice,
    Occupant,
    Prediction,
    Service,
    View,
    choose,
    drain_s,
    estimated_load_s,
    idle_s,
    predict,
    slot_wait,
)

# --- Service: the model's measured pace, as its key stores it ---------------------------------


#: A measured pace in the key's five fields: 2.5 s in a slot; 0.4 s to a first token over 200
#: uncached bytes on average, with the square and the product a line's fit needs (all one size).
FULL = Service(2.5, 0.4, 200.0, 40000.0, 80.0)


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, Service()),
        ("", Service()),
        (b"", Service()),
        ("2.5 0.4 200 40000 80", FULL),
        (b"2.5 0.4 200 40000 80", FULL),
        ("  2.5   0.4\t200 40000\n80 ", FULL),
        ("2.5 0.4 200 40000 80 9 9", FULL),  # a later field added: ignored
        # Older records: the service time alone, or with a first-token time over *tokens*
        # (another unit: read as bytes it would be a pace off by the bytes per token). Only
        # the service time is kept; the fit starts over from the next request.
        ("2.5", Service(2.5)),
        (b"2.5", Service(2.5)),
        ("2.5 0.4 200", Service(2.5)),
        (b"2.5 0.4 200", Service(2.5)),
        ("2.5 0.4", Service(2.5)),
        ("2.5 0.4 200 40000", Service(2.5)),
        ("abc 0.4 200", Service()),
        # Garbage, field by field.
        ("abc", Service()),
        ("abc 0.4 200 40000 80", Service(None, 0.4, 200.0, 40000.0, 80.0)),
        ("2.5 x 200 40000 80", Service(2.5, None, 200.0, 40000.0, 80.0)),
        ("2.5 0.4 200 y 80", Service(2.5, 0.4, 200.0, None, 80.0)),
        # Negative, infinite or not a number: unknown, never a pace.
        ("-1 -0.5 -3 -4 -5", Service()),
        ("inf nan -inf inf nan", Service()),
        ("1e400 0.4 200 40000 80", Service(None, 0.4, 200.0, 40000.0, 80.0)),
        ("nan", Service()),
        ("0 0 0 0 0", Service(0.0, 0.0, 0.0, 0.0, 0.0)),
    ],
)
def test_service_parse(raw: str | bytes | None, want: Service) -> None:
    assert Service.parse(raw) == want


@pytest.mark.parametrize(
    ("service", "text"),
    [
        (Service(), ""),
        (Service(None, 0.4, 200, 40000, 80), ""),  # no service time: nothing worth writing
        (Service(2.5), "2.5"),
        # Any field of the fit missing is no fit: the service time alone.
        (Service(2.5, 0.4, None, 40000, 80), "2.5"),
        (Service(2.5, None, 200, 40000, 80), "2.5"),
        (Service(2.5, 0.4, 200, None, 80), "2.5"),
        (Service(2.5, 0.4, 200, 40000, None), "2.5"),
        (FULL, "2.5 0.4 200 40000 80"),
        (Service(1 / 3, 0.4, 200, 40000, 80), "0.333333 0.4 200 40000 80"),
    ],
)
def test_service_dumps(service: Service, text: str) -> None:
    assert service.dumps() == text


def _maybe(lo: float, hi: float) -> st.SearchStrategy[float | None]:
    return st.none() | st.floats(lo, hi, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    service_s=_maybe(0, 1e6),
    first_s=_maybe(0, 1e6),
    new_bytes=_maybe(0, 1e6),
    bytes_sq=_maybe(0, 1e12),
    bytes_first=_maybe(0, 1e12),
)
def test_service_dumps_parses_back(
    service_s: float | None,
    first_s: float | None,
    new_bytes: float | None,
    bytes_sq: float | None,
    bytes_first: float | None,
) -> None:
    # What is written reads back to itself, and each known field to within its precision.
    s = Service(service_s, first_s, new_bytes, bytes_sq, bytes_first)
    back = Service.parse(s.dumps())
    assert Service.parse(back.dumps()) == back
    if service_s is None:
        assert back == Service()
        return
    assert back.service_s == pytest.approx(service_s, rel=1e-5)
    fit = (first_s, new_bytes, bytes_sq, bytes_first)
    got = (back.first_s, back.new_bytes, back.bytes_sq, back.bytes_first)
    if any(v is None for v in fit):
        assert got == (None, None, None, None)
    else:
        assert got == pytest.approx(fit, rel=1e-5)


def _measured(*requests: tuple[float, float]) -> Service:
    """The pace of equally weighted requests, each (uncached bytes, seconds to a first token):
    the averages a model process keeps (``workers.timings.fold_service``), here exact."""
    n = len(requests)
    return Service(
        1.0,
        sum(y for _, y in requests) / n,
        sum(x for x, _ in requests) / n,
        sum(x * x for x, _ in requests) / n,
        sum(x * y for x, y in requests) / n,
    )


def test_prefill_is_the_line_through_requests_of_two_sizes() -> None:
    # 0.2 s whatever the size (the first decode step, the process's overhead), then 1 ms a
    # byte: measured on prompts of 1,000 and 3,000 bytes, predicted for others on the line.
    def first(x: float) -> float:
        return 0.2 + 0.001 * x

    s = _measured((1000, first(1000)), (3000, first(3000)), (1000, first(1000)))
    for size in (0, 500, 1000, 2000, 3000, 10_000):
        assert s.prefill_s(size) == pytest.approx(first(size))


def test_prefill_of_requests_all_of_one_size_goes_through_zero() -> None:
    # Nothing tells the fixed part from the per-byte part: the average pace, from nothing at 0.
    s = _measured((2000, 0.5), (2000, 0.5))
    assert s.prefill_s(2000) == pytest.approx(0.5)
    assert s.prefill_s(4000) == pytest.approx(1.0)
    assert s.prefill_s(500) == pytest.approx(0.125)
    assert s.prefill_s(0) == 0.0
    # Sizes a byte apart are one size (their spread says nothing of a slope).
    assert _measured((2000, 0.5), (2001, 0.9)).prefill_s(4000) == pytest.approx(4000 * 0.7 / 2000.5)


def test_prefill_line_never_has_a_negative_intercept_or_slope() -> None:
    # Larger prompts far slower than the smaller ones' pace: the line would cross zero above
    # 0 bytes; the fixed part is none, the slope kept.
    steep = _measured((1000, 0.1), (2000, 0.5))
    assert steep.prefill_s(0) == 0.0
    assert steep.prefill_s(3000) == pytest.approx(3000 * 0.0004)
    # Larger prompts faster (noise, another load on the host): no slope, their average time.
    falling = _measured((1000, 0.5), (2000, 0.1))
    assert falling.prefill_s(0) == pytest.approx(0.3)
    assert falling.prefill_s(50_000) == pytest.approx(0.3)


def test_prefill_unknown_or_degenerate_measure() -> None:
    assert Service(2.0).prefill_s(500) == 0.0  # not measured: not counted
    assert Service(2.0, 0.3, 100.0, None, 30.0).prefill_s(500) == 0.0
    assert Service(2.0, None, 100.0, 10000.0, 30.0).prefill_s(500) == 0.0
    # Every measured prompt was cached whole: no pace per byte was ever seen.
    assert Service(2.0, 0.3, 0.0, 0.0, 0.0).prefill_s(500) == 0.0
    # A negative size (never asked for) is no size.
    assert _measured((2000, 0.5), (2000, 0.5)).prefill_s(-10) == 0.0


@settings(max_examples=300, deadline=None)
@given(
    first_s=_maybe(0, 100.0),
    new_bytes=_maybe(0, 1e6),
    bytes_sq=_maybe(0, 1e12),
    bytes_first=_maybe(0, 1e8),
    a=st.integers(0, 10**6),
    b=st.integers(0, 10**6),
)
def test_prefill_is_never_negative_and_never_shorter_for_a_longer_prompt(
    first_s: float | None,
    new_bytes: float | None,
    bytes_sq: float | None,
    bytes_first: float | None,
    a: int,
    b: int,
) -> None:
    # Any record, even one no requests could give (a damaged or hand-written key).
    s = Service(1.0, first_s, new_bytes, bytes_sq, bytes_first)
    lo, hi = sorted((a, b))
    assert 0.0 <= s.prefill_s(0) <= s.prefill_s(lo) <= s.prefill_s(hi)
    assert math.isfinite(s.prefill_s(hi))


# --- The terms -----------------------------------------------------------------------------------


def test_slot_wait() -> None:
    assert slot_wait(0, 4.0, 1) == 0.0
    assert slot_wait(-3, 4.0, 1) == 0.0
    # Half a service time is left of what runs, then a whole one per request, over the slots.
    assert slot_wait(1, 4.0, 1) == pytest.approx(2.0)
    assert slot_wait(3, 4.0, 1) == pytest.approx(10.0)
    assert slot_wait(3, 4.0, 2) == pytest.approx(5.0)
    assert slot_wait(2, 4.0, 0) == pytest.approx(6.0)  # no slots counted as one


def test_drain_idle_and_in_turn() -> None:
    assert drain_s(Occupant("a"), 0.0) == 0.0
    assert drain_s(Occupant("a", turn_left_s=3.0), 0.0) == 3.0
    assert drain_s(Occupant("a", turn_left_s=3.0), 60.0) == 3.0


def test_drain_busy_without_queue() -> None:
    # What runs is half done, on average; its turn does not count once it is busy.
    assert drain_s(Occupant("a", in_flight=1, service_s=4.0), 0.0) == pytest.approx(2.0)
    assert drain_s(Occupant("a", in_flight=3, parallel=4, service_s=4.0), 0.0) == pytest.approx(2.0)
    assert drain_s(Occupant("a", in_flight=1, service_s=4.0, turn_left_s=100.0), 0.0) == 2.0
    # No measured pace: the default.
    assert drain_s(Occupant("a", in_flight=1), 0.0) == pytest.approx(DEFAULT_SERVICE_S / 2)


def test_drain_busy_with_queue() -> None:
    # One running (half left), then two queued one after the other: 2 + 4 + 4.
    o = Occupant("a", in_flight=1, queued=2, service_s=4.0)
    assert drain_s(o, 0.0) == pytest.approx(10.0)
    # Two slots: the last of 2 + 3 starts when the third slot frees (2.5 * 4 / 2), then runs.
    o2 = Occupant("a", in_flight=2, queued=3, parallel=2, service_s=4.0)
    assert drain_s(o2, 0.0) == pytest.approx(9.0)
    # Queued with a slot free: it starts now and runs a whole service time.
    assert drain_s(Occupant("a", queued=1, service_s=4.0), 0.0) == pytest.approx(4.0)


def test_drain_capped_by_max_busy() -> None:
    o = Occupant("a", in_flight=1, queued=2, service_s=4.0)  # 10 s uncapped
    # It yields once the load waited 5 s, and finishes what it runs (half a service time).
    assert drain_s(o, 5.0) == pytest.approx(7.0)
    assert drain_s(o, 20.0) == pytest.approx(10.0)  # done before the cap
    # Without a queue the cap never lengthens it.
    assert drain_s(Occupant("a", in_flight=1, service_s=4.0), 0.5) == pytest.approx(2.0)


def test_drain_adds_the_victims_measured_unload() -> None:
    # Idle: gone once its last unload's time has passed; in its turn: the turn, then that.
    assert drain_s(Occupant("a", unload_s=1.5), 0.0) == pytest.approx(1.5)
    assert idle_s(Occupant("a", unload_s=1.5), 0.0) == 0.0
    assert drain_s(Occupant("a", turn_left_s=3.0, unload_s=1.5), 0.0) == pytest.approx(4.5)
    # Busy: what it runs (half of 4 s), then the unload; capped or not, the unload comes after.
    busy = Occupant("a", in_flight=1, queued=2, service_s=4.0, unload_s=1.5)
    assert drain_s(busy, 0.0) == pytest.approx(10.0 + 1.5)
    assert drain_s(busy, 5.0) == pytest.approx(7.0 + 1.5)


@settings(max_examples=200, deadline=None)
@given(
    o=st.builds(
        Occupant,
        name=st.just("x"),
        in_flight=st.integers(0, 4),
        queued=st.integers(0, 5),
        parallel=st.integers(1, 4),
        service_s=st.none() | st.floats(0.01, 60.0),
        turn_left_s=st.floats(0.0, 30.0),
        unload_s=st.floats(0.0, 30.0),
    ),
    max_busy=st.sampled_from([0.0, 5.0]) | st.floats(0.0, 120.0),
)
def test_drain_is_idle_then_unload(o: Occupant, max_busy: float) -> None:
    assert drain_s(o, max_busy) == pytest.approx(idle_s(o, max_busy) + o.unload_s)
    assert idle_s(o, max_busy) == idle_s(replace(o, unload_s=0.0), max_busy)


def test_estimated_load() -> None:
    assert estimated_load_s(View("a", load_s=7.5, load_bytes=10**12)) == (7.5, True)
    assert estimated_load_s(View("a", load_s=0.0)) == (0.0, True)
    assert estimated_load_s(View("a", load_bytes=3 * 10**9)) == (
        pytest.approx(LOAD_BASE_S + 3e9 / LOAD_BYTES_PER_S),
        False,
    )
    assert estimated_load_s(View("a")) == (LOAD_BASE_S, False)


# --- predict -------------------------------------------------------------------------------------


def test_resident_idle_with_free_slot_waits_no_queue() -> None:
    p = predict(View("a", parallel=2, in_flight=1, service=Service(4.0)), 10)
    assert p.queue_s == 0.0
    assert p.wait_s == 0.0
    assert (p.load_s, p.room_s, p.penalty_s, p.evicts) == (0.0, 0.0, 0.0, ())


def test_full_slots_queue_grows_with_ahead() -> None:
    base = View("a", parallel=1, in_flight=1, service=Service(4.0))
    waits = [predict(replace(base, ahead=n), 10).queue_s for n in range(5)]
    assert waits == pytest.approx([2.0, 6.0, 10.0, 14.0, 18.0])
    # Two slots, both taken: half the pace per request ahead.
    two = replace(base, parallel=2, in_flight=2)
    assert [predict(replace(two, ahead=n), 10).queue_s for n in range(3)] == pytest.approx(
        [1.0, 3.0, 5.0]
    )
    # A free slot takes the first request ahead; the caller waits for the first to free.
    assert predict(replace(two, in_flight=1, ahead=1), 10).queue_s == pytest.approx(1.0)


def test_queue_uses_default_service_when_unmeasured() -> None:
    p = predict(View("a", in_flight=1), 10)
    assert p.queue_s == pytest.approx(DEFAULT_SERVICE_S / 2)


def test_cold_load_room_and_penalty_from_an_in_turn_victim() -> None:
    v = View(
        "c",
        state="cold",
        load_s=10.0,
        victims=(Occupant("x"), Occupant("y", turn_left_s=3.0)),
        service=Service(2.0),
    )
    p = predict(v, 10, evict_penalty_s=5.0)
    assert (p.load_s, p.room_s, p.penalty_s) == (10.0, 3.0, 5.0)
    assert p.wait_s == pytest.approx(13.0)
    assert p.score == pytest.approx(18.0)
    assert p.evicts == ("x", "y")
    assert p.load_measured


def test_cold_room_is_the_slowest_victim_not_the_sum() -> None:
    v = View(
        "c",
        state="cold",
        load_s=10.0,
        victims=(
            Occupant("x", turn_left_s=3.0),
            Occupant("y", in_flight=1, queued=2, service_s=4.0),  # 10 s
        ),
    )
    assert predict(v, 10).room_s == pytest.approx(10.0)
    assert predict(replace(v, max_busy_s=5.0), 10).room_s == pytest.approx(7.0)


def test_cold_room_of_idle_victims_is_their_unload() -> None:
    # Both idle: no wait for their work, but each takes its unload; the slowest one counts.
    v = View(
        "c",
        state="cold",
        load_s=10.0,
        victims=(Occupant("x", unload_s=0.5), Occupant("y", turn_left_s=1.0, unload_s=2.0)),
    )
    p = predict(v, 10, evict_penalty_s=5.0)
    assert (p.room_s, p.wait_s) == (pytest.approx(3.0), pytest.approx(13.0))
    assert p.penalty_s == 5.0  # y is in its turn
    # The unload counts in the room only: no penalty for an idle victim that takes long.
    slow = replace(v, victims=(Occupant("x", unload_s=8.0),))
    p = predict(slow, 10, evict_penalty_s=5.0)
    assert (p.room_s, p.penalty_s) == (8.0, 0.0)


def test_cold_penalty_only_when_a_victim_is_in_use() -> None:
    idle = View("c", state="cold", load_s=10.0, victims=(Occupant("x"), Occupant("y")))
    p = predict(idle, 10, evict_penalty_s=5.0)
    assert (p.room_s, p.penalty_s, p.wait_s) == (0.0, 0.0, 10.0)
    assert p.evicts == ("x", "y")
    busy = replace(idle, victims=(Occupant("x"), Occupant("y", in_flight=1, service_s=4.0)))
    p = predict(busy, 10, evict_penalty_s=5.0)
    assert (p.room_s, p.penalty_s) == (2.0, 5.0)
    queued = replace(idle, victims=(Occupant("y", queued=1, service_s=4.0),))
    assert predict(queued, 10, evict_penalty_s=5.0).penalty_s == 5.0
    # Fitting without eviction: nothing to penalise.
    assert predict(replace(idle, victims=()), 10, evict_penalty_s=5.0).penalty_s == 0.0


def test_cold_unmeasured_load_is_estimated_from_bytes() -> None:
    p = predict(View("c", state="cold", load_bytes=4 * 10**9), 10)
    assert p.load_s == pytest.approx(LOAD_BASE_S + 4.0)
    assert not p.load_measured
    assert p.trace()["load_measured"] is False


def test_cold_ignores_a_stale_in_flight_count() -> None:
    p = predict(View("c", state="cold", load_s=10.0, in_flight=3, ahead=0), 10)
    assert p.queue_s == 0.0


def test_cold_queue_counts_the_requests_ahead() -> None:
    v = View("c", state="cold", load_s=10.0, ahead=2, service=Service(4.0))
    assert predict(v, 10).queue_s == pytest.approx(slot_wait(2, 4.0, 1))


def test_loading_waits_what_is_left_of_its_load() -> None:
    v = View("l", state="loading", load_s=10.0, loading_for_s=4.0)
    assert predict(v, 10).load_s == pytest.approx(6.0)
    # Late or nearly done: never less than a share of the whole load.
    for ran in (9.5, 10.0, 50.0):
        got = predict(replace(v, loading_for_s=ran), 10).load_s
        assert got == pytest.approx(10.0 * LOADING_LEFT_MIN)


def test_loading_makes_no_room_and_pays_no_penalty() -> None:
    # Its room was made when the load started.
    v = View(
        "l",
        state="loading",
        load_s=10.0,
        victims=(Occupant("x", in_flight=1, service_s=40.0),),
    )
    p = predict(v, 10, evict_penalty_s=5.0)
    assert (p.room_s, p.penalty_s, p.evicts) == (0.0, 0.0, ())


def test_cached_bytes_lower_prefill() -> None:
    v = View("a", service=_measured((100, 1.0)))  # 10 ms a byte
    assert predict(v, 500).prefill_s == pytest.approx(5.0)
    assert predict(replace(v, cached_bytes=400), 500).prefill_s == pytest.approx(1.0)
    # All of it cached (even more than this prompt): nothing to prefill, never a negative size.
    assert predict(replace(v, cached_bytes=1000), 500).prefill_s == 0.0
    assert predict(replace(v, cached_bytes=400), 500).wait_s == pytest.approx(1.0)
    # On a line with a fixed part, the fixed part stays however much is cached.
    line = replace(v, service=_measured((1000, 0.2 + 1.0), (3000, 0.2 + 3.0)))
    assert predict(replace(line, cached_bytes=1500), 2000).prefill_s == pytest.approx(0.7)
    assert predict(replace(line, cached_bytes=2000), 2000).prefill_s == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("view", "excluded"),
    [
        (View("a", excluded="not_allowed"), "not_allowed"),
        (View("a", remote=True, excluded="not_allowed"), "not_allowed"),
        (View("a", state="unavailable"), "unavailable"),
        (View("a", remote=True), ""),
    ],
)
def test_not_predicted(view: View, excluded: str) -> None:
    p = predict(view, 10, evict_penalty_s=5.0)
    assert p.wait_s is None
    assert p.excluded == excluded
    assert p.score == math.inf


def test_trace_shapes() -> None:
    assert predict(View("r", remote=True), 10).trace() == {"candidate": "r", "remote": True}
    assert predict(View("x", excluded="no"), 10).trace() == {"candidate": "x", "excluded": "no"}
    cold = View("c", state="cold", load_s=10.0, victims=(Occupant("y", turn_left_s=3.0),))
    t = predict(cold, 10, evict_penalty_s=5.0).trace()
    assert t["wait"] == 13.0 and t["penalty"] == 5.0 and t["evicts"] == ["y"]
    assert t["load_measured"] is True
    assert "penalty" not in predict(View("a"), 10).trace()


# --- Generated pools -----------------------------------------------------------------------------


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


# A few fixed values among the drawn ones so that equal predictions (ties) come up often.
_services = st.sampled_from(
    [
        Service(),
        Service(2.0),
        Service(4.0, 1.0, 100.0, 10000.0, 100.0),  # through zero: 10 ms a byte
        Service(4.0, 0.6, 2000.0, 5e6, 1400.0),  # a line: 0.2 s, then 0.2 ms a byte
    ]
) | st.builds(
    Service,
    st.none() | _floats(0.01, 60.0),
    st.none() | _floats(0.0, 10.0),
    st.none() | _floats(0.0, 40_000.0),
    st.none() | _floats(0.0, 2e9),
    st.none() | _floats(0.0, 4e5),
)

_occupants = st.builds(
    Occupant,
    name=st.sampled_from(["x", "y", "z"]),
    in_flight=st.integers(0, 4),
    queued=st.sampled_from([0, 0, 1, 5]),
    parallel=st.integers(1, 4),
    service_s=st.none() | _floats(0.01, 60.0),
    turn_left_s=st.sampled_from([0.0, 0.0, 3.0]) | _floats(0.0, 30.0),
    unload_s=st.sampled_from([0.0, 0.0, 2.0]) | _floats(0.0, 30.0),
)

_views = st.builds(
    View,
    name=st.just(""),
    remote=st.sampled_from([False, False, False, True]),
    state=st.sampled_from(["ready", "ready", "loading", "cold", "unavailable"]),
    excluded=st.sampled_from(["", "", "", "", "not_allowed"]),
    parallel=st.integers(0, 4),
    in_flight=st.integers(0, 6),
    ahead=st.sampled_from([0, 0, 1]) | st.integers(0, 20),
    service=_services,
    load_s=st.none() | st.sampled_from([10.0]) | _floats(0.0, 300.0),
    load_bytes=st.none() | st.integers(0, 50 * 10**9),
    loading_for_s=st.sampled_from([0.0]) | _floats(0.0, 400.0),
    victims=st.lists(_occupants, max_size=3).map(tuple),
    max_busy_s=st.sampled_from([0.0, 0.0, 5.0]) | _floats(0.0, 120.0),
    cached_bytes=st.sampled_from([0, 0, 100]) | st.integers(0, 40_000),
)


@st.composite
def _pools(draw: st.DrawFn) -> list[View]:
    """1-5 listed candidates, named by their place; some copies of others (equal predictions)."""
    base = draw(st.lists(_views, min_size=1, max_size=5))
    out = []
    for v in base:
        if len(base) > 1 and draw(st.booleans()):
            v = base[draw(st.integers(0, len(base) - 1))]
        out.append(v)
    return [replace(v, name=f"m{i}") for i, v in enumerate(out)]


@st.composite
def _pools_with_remotes(draw: st.DrawFn) -> list[View]:
    """A pool with up to two more remote candidates listed anywhere (past ``max_wait_s`` the
    first of them must be taken, not just any)."""
    pool = draw(_pools())
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(pool)))
        pool.insert(at, View("", remote=True, excluded=draw(st.sampled_from(["", "", "no"]))))
    return [replace(v, name=f"m{i}") for i, v in enumerate(pool)]


_sizes = st.integers(0, 40_000)
_penalties = st.sampled_from([0.0, 30.0]) | _floats(0.0, 200.0)
_max_waits = st.sampled_from([0.0, 0.0, 10.0]) | _floats(0.0, 400.0)


def _usable_local(pool: list[View]) -> list[View]:
    return [v for v in pool if not v.excluded and not v.remote and v.state != "unavailable"]


def _usable_remote(pool: list[View]) -> list[View]:
    return [v for v in pool if not v.excluded and v.remote]


def _by_name(c: Choice) -> dict[str, Prediction]:
    return {p.name: p for p in c.predictions}


@settings(max_examples=200, deadline=None)
@given(pool=_pools(), size=_sizes, penalty=_penalties, max_wait=_max_waits)
def test_first_takes_the_first_listed_whatever_the_predictions(
    pool: list[View], size: int, penalty: float, max_wait: float
) -> None:
    c = choose("first", pool, size, evict_penalty_s=penalty, max_wait_s=max_wait)
    assert (c.candidate, c.reason) == (pool[0].name, "first")
    # The predictions are still made, for the trace and the error measure.
    assert c.predictions == tuple(predict(v, size, penalty) for v in pool)


@settings(max_examples=200, deadline=None)
@given(pool=_pools(), size=_sizes, penalty=_penalties, max_wait=_max_waits)
def test_fastest_chosen_is_listed_and_usable(
    pool: list[View], size: int, penalty: float, max_wait: float
) -> None:
    c = choose("fastest", pool, size, evict_penalty_s=penalty, max_wait_s=max_wait)
    assert c.candidate in [v.name for v in pool]
    assert c.predictions == tuple(predict(v, size, penalty) for v in pool)
    usable = _usable_local(pool) + _usable_remote(pool)
    if not usable:
        assert (c.candidate, c.reason) == (pool[0].name, "none_usable")
    else:
        assert c.reason != "none_usable"
        assert c.candidate in [v.name for v in usable]


@settings(max_examples=200, deadline=None)
@given(pool=_pools(), size=_sizes, penalty=_penalties, max_wait=_max_waits)
def test_fastest_never_waits_more_than_the_penalty_over_another_local(
    pool: list[View], size: int, penalty: float, max_wait: float
) -> None:
    c = choose("fastest", pool, size, evict_penalty_s=penalty, max_wait_s=max_wait)
    local = _usable_local(pool)
    preds = _by_name(c)
    if c.candidate not in {v.name for v in local}:
        return
    chosen = preds[c.candidate]
    assert chosen.wait_s is not None
    for other in local:
        w = preds[other.name].wait_s
        assert w is not None
        assert chosen.wait_s <= w + penalty


@settings(max_examples=200, deadline=None)
@given(pool=_pools(), size=_sizes, penalty=_penalties, max_wait=_max_waits)
def test_fastest_ties_go_to_the_earlier_listed(
    pool: list[View], size: int, penalty: float, max_wait: float
) -> None:
    c = choose("fastest", pool, size, evict_penalty_s=penalty, max_wait_s=max_wait)
    local = _usable_local(pool)
    preds = _by_name(c)
    if c.candidate not in {v.name for v in local}:
        return
    at = [v.name for v in pool].index(c.candidate)
    chosen = preds[c.candidate].score
    for v in local:
        i = [x.name for x in pool].index(v.name)
        if i < at:
            assert preds[v.name].score > chosen  # an equal one listed before would have won
        else:
            assert preds[v.name].score >= chosen


@settings(max_examples=200, deadline=None)
@given(
    pool=_pools_with_remotes(),
    size=_sizes,
    penalty=_penalties,
    max_wait=st.sampled_from([0.001, 1.0]) | _max_waits,
)
def test_fastest_past_max_wait_goes_remote(
    pool: list[View], size: int, penalty: float, max_wait: float
) -> None:
    c = choose("fastest", pool, size, evict_penalty_s=penalty, max_wait_s=max_wait)
    local, remote = _usable_local(pool), _usable_remote(pool)
    if not local:
        return
    preds = _by_name(c)
    waits = [preds[v.name].wait_s for v in local]
    over = max_wait > 0 and all(w is not None and w > max_wait for w in waits)
    if over and remote:
        assert (c.candidate, c.reason) == (remote[0].name, "over_max_wait")
    elif over:
        best = min(preds[v.name].score for v in local)
        first_best = next(v.name for v in local if preds[v.name].score == best)
        assert (c.candidate, c.reason) == (first_best, "over_max_wait_no_remote")
    else:
        # A local candidate within the limit (or no limit): never a remote one.
        assert c.candidate in {v.name for v in local}
        assert c.reason in ("fastest", "only")


@settings(max_examples=200, deadline=None)
@given(pool=_pools(), size=_sizes, penalty=_penalties, max_wait=_max_waits)
def test_fastest_is_deterministic(
    pool: list[View], size: int, penalty: float, max_wait: float
) -> None:
    c = choose("fastest", pool, size, evict_penalty_s=penalty, max_wait_s=max_wait)
    again = choose(
        "fastest", copy.deepcopy(pool), size, evict_penalty_s=penalty, max_wait_s=max_wait
    )
    assert again == c
    assert choose("fastest", tuple(pool), size, evict_penalty_s=penalty, max_wait_s=max_wait) == c


@settings(max_examples=200, deadline=None)
@given(view=_views, size=_sizes, penalty=_penalties)
def test_prediction_is_its_terms(view: View, size: int, penalty: float) -> None:
    p = predict(view, size, penalty)
    if p.wait_s is None:
        return
    assert p.wait_s >= 0 and min(p.queue_s, p.load_s, p.room_s, p.prefill_s) >= 0
    assert p.wait_s == pytest.approx(p.queue_s + p.load_s + p.room_s + p.prefill_s)
    assert p.penalty_s in (0.0, penalty)
    if view.state == "loading":
        whole, _ = estimated_load_s(view)
        assert p.load_s >= whole * LOADING_LEFT_MIN
        assert p.load_s <= whole
    # One more request ahead never shortens the wait.
    later = predict(replace(view, ahead=view.ahead + 1), size, penalty).wait_s
    assert later is not None and later >= p.wait_s


def test_choose_refuses_an_empty_list() -> None:
    with pytest.raises(ValueError):
        choose("fastest", [], 10)


# --- Scenarios -----------------------------------------------------------------------------------

SERVICE = Service(3.0, 0.5, 100.0, 10000.0, 50.0)  # 0.5 s to a first token over 100 bytes
SLOW = replace(SERVICE, service_s=30.0)


def _resident(**kw: object) -> View:
    return replace(View("resident", state="ready", service=SERVICE), **kw)  # type: ignore[arg-type]


def _cold(**kw: object) -> View:
    return replace(View("cold", state="cold", load_s=20.0, service=SERVICE), **kw)  # type: ignore[arg-type]


def test_resident_idle_beats_cold() -> None:
    for pool in ([_resident(), _cold()], [_cold(), _resident()]):
        c = choose("fastest", pool, 100)
        assert (c.candidate, c.reason) == ("resident", "fastest")
    # ``first`` keeps the list's order.
    assert choose("first", [_cold(), _resident()], 100).candidate == "cold"


def test_saturated_resident_loses_to_a_cold_one_that_fits() -> None:
    slow = _resident(in_flight=1, ahead=10, service=SLOW)
    c = choose("fastest", [slow, _cold()], 100)
    assert (c.candidate, c.reason) == ("cold", "fastest")
    pr = _by_name(c)
    assert pr["resident"].queue_s == pytest.approx(10.5 * 30.0)
    assert pr["cold"].wait_s == pytest.approx(20.0 + 0.5)


def test_evicting_a_busy_model_pays_the_penalty() -> None:
    slow = _resident(in_flight=1, ahead=10, service=SLOW)  # ~315 s
    cold = _cold(victims=(Occupant("busy", in_flight=1, service_s=10.0),))  # 20 + 5 + 0.5
    c = choose("fastest", [slow, cold], 100, evict_penalty_s=400.0)
    assert c.candidate == "resident"
    assert _by_name(c)["cold"].penalty_s == 400.0
    assert _by_name(c)["cold"].wait_s == pytest.approx(25.5)  # the penalty is no wait
    # A smaller penalty still leaves the load ahead.
    assert choose("fastest", [slow, cold], 100, evict_penalty_s=100.0).candidate == "cold"
    # An idle victim costs no penalty however large.
    idle = _cold(victims=(Occupant("idle"),))
    assert choose("fastest", [slow, idle], 100, evict_penalty_s=400.0).candidate == "cold"


def test_both_over_max_wait_go_to_the_listed_remote() -> None:
    slow = _resident(in_flight=1, ahead=10, service=SLOW)
    cold = _cold(victims=(Occupant("busy", in_flight=1, service_s=10.0),))
    api, api2 = View("api", remote=True), View("api2", remote=True)
    c = choose("fastest", [slow, cold, api, api2], 100, max_wait_s=10.0)
    assert (c.candidate, c.reason) == ("api", "over_max_wait")
    # The first listed remote, wherever it is listed.
    c = choose("fastest", [api2, slow, api, cold], 100, max_wait_s=10.0)
    assert (c.candidate, c.reason) == ("api2", "over_max_wait")
    # No remote listed: the best local.
    c = choose("fastest", [slow, cold], 100, max_wait_s=10.0)
    assert (c.candidate, c.reason) == ("cold", "over_max_wait_no_remote")
    # One local within the limit, or no limit: local.
    assert choose("fastest", [slow, cold, api], 100, max_wait_s=30.0).candidate == "cold"
    assert choose("fastest", [api, slow, cold], 100).candidate == "cold"
    # An excluded remote is no way out.
    gone = View("api", remote=True, excluded="not_allowed")
    c = choose("fastest", [slow, cold, gone], 100, max_wait_s=10.0)
    assert (c.candidate, c.reason) == ("cold", "over_max_wait_no_remote")


def test_only_and_none_usable() -> None:
    excluded = View("x", excluded="not_allowed")
    down = View("d", state="unavailable")
    c = choose("fastest", [excluded, down], 100)
    assert (c.candidate, c.reason) == ("x", "none_usable")
    assert choose("fastest", [excluded, _cold()], 100).reason == "only"
    c = choose("fastest", [excluded, View("api", remote=True)], 100)
    assert (c.candidate, c.reason) == ("api", "only")
    assert c.chosen() == Prediction("api", None)


def test_a_wild_fitted_slope_is_held_to_twice_the_pace_through_zero() -> None:
    """Moving averages of a shifting mix (the bench: prompts cached whole, then not) can leave
    a tiny variance beside a large covariance; the line's slope then must not explode."""
    from residency.route_wait import SLOPE_CAP

    # Averages no set of requests gives together: x = 500, x^2 barely above x^2, x*y large.
    wild = Service(1.0, 0.03, 500.0, 500.0 * 500.0 + 2.0, 500.0 * 0.03 + 5.0)
    through_zero = 0.03 / 500.0
    assert wild.prefill_s(1500) <= SLOPE_CAP * through_zero * 1500 + 1e-9
    assert wild.prefill_s(1500) < 0.2
