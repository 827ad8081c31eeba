"""The usage report's sums and date ranges, and the table ``residency usage`` prints (pure)."""

from __future__ import annotations

from datetime import date

import pytest

from residency.usage import MAX_DAYS, RangeError, parse_range, render, summarize

# Fields are keyed by subject (residency.auth.subject_of); reports show users by name.
DAYS = [
    (
        "2025-01-01",
        {
            "user:ann|a|requests": "2",
            "user:ann|a|prompt_tokens": "20",
            "user:ann|a|completion_tokens": "7",
            "user:ann|a|load_seconds": "1.25",
            "anon|b|requests": "1",
            "anon|b|prompt_tokens": "5",
            "anon|b|completion_tokens": "3",
        },
    ),
    (
        "2025-01-02",
        {"user:ann|b|requests": "1", "user:ann|b|prompt_tokens": "4", "x|y|unknown": "9"},
    ),
]


def test_totals_per_user_model_and_day() -> None:
    rep = summarize(DAYS)
    assert rep["total"] == {
        "requests": 4,
        "prompt_tokens": 29,
        "completion_tokens": 10,
        "load_seconds": 1.25,
        "total_tokens": 39,
    }
    assert list(rep["users"]) == ["-", "ann"]
    assert rep["users"]["ann"]["requests"] == 3 and rep["users"]["ann"]["prompt_tokens"] == 24
    assert rep["models"]["b"]["requests"] == 2
    assert rep["days"]["2025-01-02"]["requests"] == 1
    assert [(r["day"], r["user"], r["model"]) for r in rep["rows"]] == [
        ("2025-01-01", "-", "b"),
        ("2025-01-01", "ann", "a"),
        ("2025-01-02", "ann", "b"),
    ]


def test_filters() -> None:
    rep = summarize(DAYS, user="ann", model="b")
    assert rep["total"]["requests"] == 1 and list(rep["users"]) == ["ann"]
    assert summarize(DAYS, user="-")["total"]["completion_tokens"] == 3
    # A day with nothing for the filter is still a day of the report.
    assert summarize(DAYS, user="bob")["days"]["2025-01-01"]["requests"] == 0


def test_an_admin_token_is_shown_apart_from_the_user_of_its_name() -> None:
    day = {
        "user:ops|a|requests": "1",
        "admin:ops|a|requests": "5",
        "ops|a|requests": "2",  # counted before subjects were namespaced: shown as it was
    }
    rep = summarize([("2025-01-01", day)])
    assert {u: x["requests"] for u, x in rep["users"].items()} == {"ops": 3, "admin:ops": 5}
    assert summarize([("2025-01-01", day)], user="admin:ops")["total"]["requests"] == 5


def test_ranges() -> None:
    today = date(2025, 3, 10)
    assert parse_range(None, None, today).days() == ["2025-03-10"]
    assert parse_range("2025-02-27", "2025-03-01", today).days() == [
        "2025-02-27",
        "2025-02-28",
        "2025-03-01",
    ]
    assert parse_range(None, "2025-01-05", today).days() == ["2025-01-05"]
    for first, last, param in (
        ("2025-02-30", None, "from"),
        ("2025-03-01", "tomorrow", "to"),
        ("2025-03-02", "2025-03-01", "from"),
    ):
        with pytest.raises(RangeError) as e:
            parse_range(first, last, today)
        assert e.value.param == param and param in str(e.value)
    with pytest.raises(RangeError):
        parse_range("2020-01-01", "2025-01-01", today)
    assert len(parse_range(None, None, today).days()) <= MAX_DAYS


def test_table() -> None:
    lines = render(summarize(DAYS)).splitlines()
    assert lines[0].split() == [
        "day",
        "user",
        "model",
        "requests",
        "prompt",
        "completion",
        "load",
        "s",
    ]
    assert lines[2].split() == ["2025-01-01", "ann", "a", "2", "20", "7", "1.2"]
    assert lines[-1].split() == ["total", "4", "29", "10", "1.2"]
