"""What the model process measures for the router: the model's pace (``keys.service``, read by
``residency.route_wait.Service``), a routed request's actual wait against its predicted one, and
the ``route`` a request carries through the queue."""

from __future__ import annotations

import json

import pytest

from residency import metrics
from residency.messages import Kind, Request
from residency.route_wait import Service
from workers.timings import SERVICE_EWMA, Timings, fold_service, route_sample

PREDICTED = {"wait": 1.5, "queue": 0.5, "load": 0.0, "room": 0.0, "prefill": 1.0}
ROUTE = {"policy": "auto", "rule": "code", "predicted": PREDICTED}


def test_the_service_format_round_trips_and_reads_an_old_record_as_its_service_time() -> None:
    full = Service(0.75, 0.125, 40.0, 1600.0, 5.0)
    assert Service.parse(full.dumps()) == full
    assert Service.parse(full.dumps().encode()) == full
    # Written by a model process of an older version: the service time only, or with a
    # first-token time over prompt *tokens* (not this fit's bytes): its service time alone.
    assert Service.parse("0.5000") == Service(0.5)
    assert Service.parse("0.75 0.125 40") == Service(0.75)
    assert Service.parse(Service(0.5).dumps()) == Service(0.5)
    assert Service.parse(None) == Service() and Service().dumps() == ""


def test_a_generation_folds_all_five_averages_and_an_embedding_only_its_service_time() -> None:
    first = fold_service(Service(), 2.0, 0.5, 100)
    # The first request is the average: its bytes, their square, their product with its time.
    assert first == Service(2.0, 0.5, 100.0, 10000.0, 50.0)
    nxt = fold_service(first, 4.0, 1.5, 0)
    assert nxt.service_s == pytest.approx(2.0 + SERVICE_EWMA * 2.0)
    assert nxt.first_s == pytest.approx(0.5 + SERVICE_EWMA * 1.0)
    assert nxt.new_bytes == pytest.approx(100.0 - SERVICE_EWMA * 100.0)
    assert nxt.bytes_sq == pytest.approx(10000.0 - SERVICE_EWMA * 10000.0)
    assert nxt.bytes_first == pytest.approx(50.0 - SERVICE_EWMA * 50.0)
    # An embedding (or a generation ended before its first token) has no first token.
    emb = fold_service(nxt, 1.0)
    fit = (nxt.first_s, nxt.new_bytes, nxt.bytes_sq, nxt.bytes_first)
    assert (emb.first_s, emb.new_bytes, emb.bytes_sq, emb.bytes_first) == fit
    assert emb.service_s == pytest.approx(nxt.service_s + SERVICE_EWMA * (1.0 - nxt.service_s))
    assert len(emb.dumps().split()) == 5
    # A model that served only embeddings writes its service time alone.
    assert len(fold_service(Service(), 1.0).dumps().split()) == 1
    # Never a negative time or size (a clock step, a cache count above the prompt's).
    assert fold_service(Service(), 1.0, -0.5, -10.0) == Service(1.0, 0.0, 0.0, 0.0, 0.0)


def _through_the_key(requests: list[tuple[float, float]]) -> Service:
    """The pace a model process folds from ``requests`` (uncached bytes, seconds to a first
    token), as the router reads it back from ``keys.service``."""
    s = Service()
    for x, y in requests:
        s = fold_service(s, 1.0, y, x)
    return Service.parse(s.dumps())


def test_the_router_reads_the_line_through_two_sizes_folded_by_the_model_process() -> None:
    # 0.15 s whatever the size, then 40 us a byte: short and long prompts, interleaved.
    def first(x: float) -> float:
        return 0.15 + 40e-6 * x

    pace = _through_the_key([(x, first(x)) for x in [1200.0, 9800.0, 9800.0, 1200.0] * 10])
    for size in (0, 1200, 5000, 30_000):
        assert pace.prefill_s(size) == pytest.approx(first(size), rel=1e-3)


@pytest.mark.parametrize(
    ("size", "first_s"),
    [(2000.0, 0.5), (12345.6, 0.1234567), (73937.545881427, 1.463164284181562), (3456.0, 0.04)],
)
def test_the_router_reads_one_size_as_a_pace_through_zero(size: float, first_s: float) -> None:
    # Every request of one size (a benchmark, an agent's fixed prompt), its bytes a fraction
    # (a share of them cached): twice the size takes twice the time, half of it half.
    pace = _through_the_key([(size, first_s)] * 30)
    assert pace.prefill_s(round(size)) == pytest.approx(first_s, rel=1e-3)
    assert pace.prefill_s(round(2 * size)) == pytest.approx(2 * first_s, rel=1e-3)
    assert pace.prefill_s(round(size / 2)) == pytest.approx(first_s / 2, rel=1e-3)


def test_the_actual_wait_is_its_queue_plus_its_first_token_never_below_zero() -> None:
    t = Timings(submitted=100.0, taken=100.25)
    assert t.actual_wait() is None  # no first token
    t.first = 101.0
    assert t.actual_wait() == {"wait": 1.0, "queue": 0.25, "first": 0.75}
    skewed = Timings(submitted=100.0, taken=99.0)  # web's clock ahead of this host's
    skewed.first = 99.5
    assert skewed.actual_wait() == {"wait": 0.5, "queue": 0.0, "first": 0.5}


def test_a_routed_request_gives_a_sample_with_its_error() -> None:
    actual = {"wait": 1.0, "queue": 0.25, "first": 0.75}
    out = route_sample(ROUTE, "m", actual, 1000.0)
    assert out is not None
    policy, raw, error = out
    assert policy == "auto" and error == pytest.approx(0.5)
    assert json.loads(raw) == {
        "t": 1000.0,
        "candidate": "m",
        "rule": "code",
        "predicted": PREDICTED,
        "actual": actual,
    }


@pytest.mark.parametrize(
    "route",
    [
        {},  # not routed
        {"policy": "auto", "rule": "remote"},  # nothing predicted (a remote)
        {"policy": "no spaces/here", "rule": "r", "predicted": PREDICTED},  # not a policy name
        {"policy": "auto", "rule": "r", "predicted": {"queue": 1.0}},  # no wait to compare
    ],
)
def test_no_sample_without_a_prediction_to_compare(route: dict[str, object]) -> None:
    assert route_sample(route, "m", {"wait": 1.0, "queue": 0.0, "first": 1.0}, 1.0) is None


def test_no_sample_without_a_first_token() -> None:
    assert route_sample(ROUTE, "m", None, 1.0) is None


def test_the_route_travels_with_the_request_and_older_json_has_none() -> None:
    req = Request("r1", Kind.CHAT, "m", {}, False, 1.0, route=ROUTE)
    raw = req.dumps()
    assert raw.startswith('{"id":"r1"')  # the Lua scripts read the id from the start
    assert Request.loads(raw) == req
    old = raw.replace(',"route":' + json.dumps(ROUTE, separators=(",", ":")), "")
    assert "route" not in old
    assert Request.loads(old).route == {}


def test_the_error_histogram_counts_in_its_policy_and_bucket() -> None:
    key, bucket, total = metrics.histogram_fields(metrics.ROUTE_WAIT_ERROR, {"policy": "p"}, 0.3)
    assert key.endswith(metrics.ROUTE_WAIT_ERROR)
    assert bucket == '{"policy":"p"}|0.5' and total == '{"policy":"p"}|sum'
    assert metrics.histogram_fields(metrics.ROUTE_WAIT_ERROR, {"policy": "p"}, 99)[1].endswith(
        "|+Inf"
    )
