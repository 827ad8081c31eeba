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


def test_status_shows_each_devices_ledger_and_when_a_gone_host_was_last_seen() -> None:
    rec = record({})
    mib = 1 << 20
    rec["devices"] = [
        {"host": "h", "device": "cpu", "budget_bytes": 1000 * mib, "used_bytes": 400 * mib,
         "free_bytes": 600 * mib, "models": {"a": 400 * mib}},
        {"host": "g", "device": "cuda:0", "budget_bytes": None, "used_bytes": 0,
         "free_bytes": None, "models": {}},
    ]  # fmt: skip
    rec["workers"] = [{"host": "old", "devices": ["cpu"], "alive": False, "last_seen": 0.0}]
    out = render_status(rec)
    assert "memory  h/cpu 400 MiB of 1000 MiB (a 400)" in out
    assert "memory  g/cuda:0 0 MiB no budget" in out
    assert "worker  old cpu GONE (last seen " in out


def test_status_shows_the_disk_each_hosts_slot_caches_use() -> None:
    rec = record({})
    models = rec["models"]
    assert isinstance(models, list)
    models[0]["cache"] = {"entries": 3, "bytes": 30 << 20, "hits": 2}
    rec["workers"] = [
        {
            "host": "h",
            "devices": ["cpu"],
            "alive": True,
            "slot_cache": {"dir": "/data/slot-cache", "entries": 3, "bytes": 30 << 20},
        }
    ]
    out = render_status(rec)
    assert "cache   h 30.0 MiB in 3 saved slot(s) at /data/slot-cache (a 3)" in out
