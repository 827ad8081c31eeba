"""A router policy's last hour for /health (pure): choices, prediction error and the term that
was off, and when its error is warned about."""

from __future__ import annotations

import json

from residency import route_stats
from residency.route_stats import REL_FLOOR_S, should_warn, stale_choices, stats

NOW = 1_000_000.0


def sample(
    t: float = NOW - 10,
    *,
    wait: float = 1.0,
    actual_wait: float = 1.0,
    queue: float = 0.0,
    load: float = 0.0,
    room: float = 0.0,
    prefill: float = 1.0,
    actual_queue: float = 0.0,
    first: float = 1.0,
    candidate: str = "a",
) -> str:
    return json.dumps(
        {
            "t": t,
            "candidate": candidate,
            "rule": "default",
            "predicted": {
                "wait": wait,
                "queue": queue,
                "load": load,
                "room": room,
                "prefill": prefill,
            },
            "actual": {"wait": actual_wait, "queue": actual_queue, "first": first},
        }
    )


def minute(t: float) -> int:
    return int(t // 60)


def test_choices_count_the_last_hours_minutes_only() -> None:
    choices = {
        f"{minute(NOW)}|a|fastest": "3",
        f"{minute(NOW - 600)}|b|fastest": "2",
        f"{minute(NOW - 600)}|b|over_max_wait": "1",
        f"{minute(NOW - 3700)}|a|fastest": "50",  # over an hour ago
        f"{minute(NOW)}|with|bar|only": "4",  # a candidate's name may hold a "|"
        "garbage": "7",
        f"{minute(NOW)}|a|fastest-x": "not a number",
    }
    st = stats([], choices, NOW)
    assert st["choices"] == {"a": 3, "b": 3, "with|bar": 4}
    assert st["reasons"] == {"fastest": 5, "over_max_wait": 1, "only": 4}
    assert (st["samples"], st["error"], st["off"]) == (0, None, None)


def test_stale_choice_fields_are_the_minutes_past_the_ttl() -> None:
    fields = [f"{minute(NOW)}|a|fastest", f"{minute(NOW - 7300)}|a|fastest", "garbage"]
    assert stale_choices(fields, NOW, 7200) == [f"{minute(NOW - 7300)}|a|fastest"]


def test_error_medians_over_the_last_hours_samples() -> None:
    samples = [
        sample(wait=2.0, actual_wait=1.0),  # off by 1 s, 100 %
        sample(wait=1.0, actual_wait=1.0),  # exact
        sample(wait=1.5, actual_wait=1.0),  # off by 0.5 s, 50 %
        sample(NOW - 3700, wait=100.0, actual_wait=1.0),  # over an hour ago: ignored
    ]
    st = stats(samples, {}, NOW)
    assert st["samples"] == 3
    assert st["error"] == {"median_abs_s": 0.5, "median_rel": 0.5, "p90_rel": 1.0}


def test_a_request_that_waited_nothing_is_measured_against_the_floor() -> None:
    st = stats([sample(wait=0.05, actual_wait=0.0)], {}, NOW)
    assert st["error"]["median_rel"] == round(0.05 / REL_FLOOR_S, 4) == 0.5


def test_malformed_samples_are_skipped() -> None:
    bad = [
        "not json",
        "[1, 2]",
        json.dumps({"t": NOW, "predicted": {"wait": 1}, "actual": {"wait": 1}}),
        sample().replace('"queue": 0.0', '"queue": "x"', 1),
        json.dumps({"t": "now"}),
        sample(wait=float("nan")),
    ]
    st = stats([*bad, sample()], {}, NOW)
    assert st["samples"] == 1


def test_the_prefill_side_is_off_when_its_miss_is_larger() -> None:
    samples = [sample(wait=1.0, actual_wait=4.0, prefill=1.0, first=4.0) for _ in range(3)]
    assert stats(samples, {}, NOW)["off"] == {"term": "prefill", "median_rel": 0.75}


def test_the_queue_side_names_its_largest_predicted_term() -> None:
    def queue_side(**kw: float) -> str:
        samples = [
            sample(wait=1.0 + sum(kw.values()), actual_wait=20.0, actual_queue=19.0, **kw)
            for _ in range(3)
        ]
        return str(stats(samples, {}, NOW)["off"]["term"])

    assert queue_side(load=5.0, room=1.0, queue=1.0) == "load"
    assert queue_side(load=1.0, room=5.0, queue=1.0) == "room"
    assert queue_side(load=1.0, room=1.0, queue=5.0) == "queue"
    # Nothing predicted on that side at all: its queue was missed.
    assert queue_side() == "queue"


def test_nothing_is_off_when_every_prediction_was_exact() -> None:
    assert stats([sample(), sample()], {}, NOW)["off"] is None


def off_stats(n: int, rel: float) -> dict[str, object]:
    samples = [sample(wait=1.0 + rel, actual_wait=1.0) for _ in range(n)]
    return stats(samples, {}, NOW)


def test_a_policy_is_warned_about_once_an_hour() -> None:
    st = off_stats(20, 0.6)
    assert should_warn(st, None, NOW)
    assert not should_warn(st, NOW - 10, NOW)
    assert not should_warn(st, NOW - route_stats.WARN_EVERY_S + 1, NOW)
    assert should_warn(st, NOW - route_stats.WARN_EVERY_S, NOW)
    # Too few samples, or an error within the bound: nothing to say.
    assert not should_warn(off_stats(19, 0.6), None, NOW)
    assert not should_warn(off_stats(20, 0.5), None, NOW)
    assert not should_warn(stats([], {}, NOW), None, NOW)


def test_the_warning_names_the_policy_its_error_and_the_term() -> None:
    st = stats([sample(wait=1.0, actual_wait=4.0, prefill=1.0, first=4.0)] * 20, {}, NOW)
    text = route_stats.warning("auto", st)
    assert "auto" in text and "75%" in text and "prefill" in text
