"""`residency status` renders the published record, including a deferred shrink."""

from __future__ import annotations

from residency.cli import render_status


def record(blocked: dict[str, int]) -> dict[str, object]:
    return {
        "generation": 9,
        "max_models": {"llm": {"configured": 1, "effective": 1}},
        "models": [
            {
                "name": "a",
                "type": "llm",
                "pool": "standard",
                "state": "ready",
                "pinned": False,
                "in_flight": 1,
                "queued": 0,
                "host": "h",
                "device": "cpu",
                "pid": 42,
                "last_used": None,
            }
        ],
        "workers": [],
        "enforcement": {"blocked": blocked},
    }


def test_status_names_a_deferred_shrink() -> None:
    out = render_status(record({"llm": 1}))
    assert "llm pool 1 over its limit: deferred until a busy model goes idle" in out
    assert "generation 9" in out


def test_status_without_a_deferred_shrink_says_nothing_of_it() -> None:
    assert "over its limit" not in render_status(record({}))
