"""The coordinator's side of the router, with a coordinator driven by hand against a real Redis:
each pass publishes what a load of each cold policy candidate would take (the health hash's
``route_room``), and the record's ``routing`` shows each policy's last hour; and how long a
model's unload took, as ``try_unload.lua`` records it for that room."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import redis

from residency import keys, ledger, policy_store
from residency.lua import Scripts
from tests.integration.hand_leader import Clock, hand_leader, live_worker, plant_model


def sample(t: float, predicted_wait: float, actual_wait: float) -> str:
    return json.dumps(
        {
            "t": t,
            "candidate": "b",
            "rule": "default",
            "predicted": {
                "wait": predicted_wait,
                "queue": 0.0,
                "load": predicted_wait - 0.5,
                "room": 0.0,
                "prefill": 0.5,
            },
            "actual": {"wait": actual_wait, "queue": actual_wait - 0.5, "first": 0.5},
        }
    )


def test_a_pass_publishes_the_room_of_a_cold_candidate_and_the_routing_stats(
    tmp_path: Path,
    redis_url: str,
    r: redis.Redis,
    models_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    co = hand_leader(
        tmp_path, redis_url, models_dir, clock,
        pool={"max_loaded_models": 1, "llm_pool_autosize": False},
    )  # fmt: skip
    spec = {"candidates": ["a", "b"], "default": "a"}
    policy_store.put(r, policy_store.PolicyEntry("auto", spec, "admin"), "test")
    live_worker(r, "h1", children={"a": "T1"}, children_at=clock.now)
    # "a" is resident and busy: the room still names it (the router adds its wait itself).
    plant_model(
        r, "a", state="ready", token="T1", host="h1", device="cpu",
        loaded_at=clock.now - 100, last_used=clock.now - 50,
    )  # fmt: skip
    r.lpush(keys.processing("a"), "{}")
    co.step([])
    record = json.loads(r.hget(keys.health(), "record"))  # type: ignore[arg-type]
    [need] = [m["expected_bytes"]["cpu"] for m in record["models"] if m["name"] == "b"]

    now = clock.now
    minute = int(now // 60)
    old = f"{minute - 200}|a|fastest"
    r.hset(
        keys.route_choices("auto"),
        mapping={f"{minute}|b|fastest": 3, f"{minute - 1}|a|only": 1, old: 9},
    )
    r.lpush(keys.route_samples("auto"), *[sample(now - 5, 4.0, 1.0) for _ in range(20)])
    clock.now += 10

    with caplog.at_level(logging.WARNING, logger="residency.coordinator"):
        co.step([])
    h = r.hgetall(keys.health())
    room = json.loads(h["route_room"])
    assert room["max_busy_s"] == co.settings.pool.max_busy_s
    assert list(room["models"]) == ["b"]
    b = room["models"]["b"]
    assert (b["fits"], b["reason"], b["evict"], b["turn_left"]) == (
        True,
        "after_evictions",
        ["a"],
        {"a": 0.0},
    )
    assert b["load_bytes"] == need and b["load_s"] is None

    routing = json.loads(h["record"])["routing"]
    assert list(routing) == ["auto"]
    auto = routing["auto"]
    assert (auto["choices"], auto["reasons"], auto["samples"]) == (
        {"a": 1, "b": 3},
        {"fastest": 3, "only": 1},
        20,
    )
    assert auto["error"]["median_rel"] == 3.0
    assert auto["off"]["term"] == "load"
    # The choice minutes past the samples' TTL are deleted.
    assert not r.hexists(keys.route_choices("auto"), old)
    warned = [rec for rec in caplog.records if "router policy auto" in rec.getMessage()]
    assert len(warned) == 1 and "load" in warned[0].getMessage()

    # Read again ten seconds later: still off, but warned about once an hour only.
    caplog.clear()
    clock.now += 10
    with caplog.at_level(logging.WARNING, logger="residency.coordinator"):
        co.step([])
    assert json.loads(r.hget(keys.health(), "record"))["routing"]["auto"]["samples"] == 20  # type: ignore[arg-type]
    assert not [rec for rec in caplog.records if "router policy auto" in rec.getMessage()]


def test_the_room_uses_a_measured_load_of_the_current_spec(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    spec = {"candidates": ["a", "b"], "default": "a"}
    policy_store.put(r, policy_store.PolicyEntry("auto", spec, "admin"), "test")
    live_worker(r, "h1", children={}, children_at=clock.now)
    b = co.settings.models["b"]
    r.hset(
        keys.footprint("b"),
        mapping={"load_s": "2.5", "load_spec": str(ledger.digest(b, "cpu"))},
    )
    r.hset(keys.footprint("a"), mapping={"load_s": "2.5", "load_spec": "another spec"})
    co.step([])
    models = json.loads(r.hget(keys.health(), "route_room"))["models"]  # type: ignore[arg-type]
    assert (models["a"]["load_s"], models["b"]["load_s"]) == (None, 2.5)
    assert models["a"]["fits"] and models["a"]["reason"] == "fits"


def redis_now(r: redis.Redis) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


def drain(scripts: Scripts, model: str, token: str, began: float, lease: str) -> None:
    """The coordinator's eviction step: ``model`` draining since ``began`` (Redis's clock: the
    script stamps the drain with Redis TIME, set back here as if it began then)."""
    control = {"op": "unload", "token": token, "reason": "lru"}
    assert scripts.begin_drain(model, token=token, control=control, now=began, lease=lease) == "ok"
    scripts.r.hset(keys.model(model), "drain_t", f"{began:.6f}")


def test_the_unload_is_timed_on_redis_clock_whatever_the_coordinators(r: redis.Redis) -> None:
    scripts = Scripts(r)
    r.set(keys.leader(), "lease")
    plant_model(r, "a", state="ready", token="T1", host="h1", device="cpu")
    control = {"op": "unload", "token": "T1", "reason": "lru"}
    # A coordinator whose clock is far from Redis's (another host, a test clock).
    assert scripts.begin_drain("a", token="T1", control=control, now=1e6, lease="lease") == "ok"
    assert unload(scripts, "a", "T1") == "unloaded"
    h = r.hgetall(keys.model("a"))
    assert 0.0 <= float(h["unload_s"]) < 60.0 and "drain_t" not in h


def unload(scripts: Scripts, model: str, token: str) -> str:
    """The model process's step: commit its unload, or be rescued."""
    return scripts.try_unload(model, token=token, unloaded_event={}, rescued_event={})


def test_a_committed_unload_records_how_long_it_took_and_a_rescued_one_nothing(
    r: redis.Redis,
) -> None:
    scripts = Scripts(r)
    r.set(keys.leader(), "lease")
    plant_model(r, "a", state="ready", token="T1", host="h1", device="cpu")
    # Its drain began 5 s ago on Redis's clock: its unload took at least that long.
    drain(scripts, "a", "T1", redis_now(r) - 5.0, "lease")
    assert unload(scripts, "a", "T1") == "unloaded"
    h = r.hgetall(keys.model("a"))
    assert h["state"] == "unloaded" and "draining_since" not in h
    took = float(h["unload_s"])
    assert 5.0 <= took < 5.0 + 600  # seconds (not ms), from the drain's start

    # Rescued by a request taken while it drained: no unload, so no time is recorded.
    plant_model(r, "b", state="ready", token="T2", host="h1", device="cpu")
    drain(scripts, "b", "T2", redis_now(r) - 5.0, "lease")
    r.lpush(keys.processing("b"), "{}")
    assert unload(scripts, "b", "T2") == "rescued"
    h = r.hgetall(keys.model("b"))
    assert h["state"] == "ready" and "unload_s" not in h and "draining_since" not in h

    # Loaded again and rescued: the time of its last real unload stays.
    plant_model(r, "a", state="ready", token="T3", host="h1", device="cpu")
    drain(scripts, "a", "T3", redis_now(r) - 50.0, "lease")
    r.lpush(keys.processing("a"), "{}")
    assert unload(scripts, "a", "T3") == "rescued"
    assert float(r.hget(keys.model("a"), "unload_s")) == took  # type: ignore[arg-type]


def test_the_room_says_how_long_a_victims_last_unload_took(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(
        tmp_path, redis_url, models_dir, clock,
        pool={"max_loaded_models": 1, "llm_pool_autosize": False},
    )  # fmt: skip
    scripts = Scripts(r)
    spec = {"candidates": ["a", "b"], "default": "a"}
    policy_store.put(r, policy_store.PolicyEntry("auto", spec, "admin"), "test")
    # "a" was unloaded once (its drain began 2 s before), then loaded again: resident now.
    plant_model(r, "a", state="ready", token="T0", host="h1", device="cpu")
    drain(scripts, "a", "T0", redis_now(r) - 2.0, co.lease_token)
    assert unload(scripts, "a", "T0") == "unloaded"
    r.delete(keys.events())  # passes are driven by hand
    took = float(r.hget(keys.model("a"), "unload_s"))  # type: ignore[arg-type]
    live_worker(r, "h1", children={"a": "T1"}, children_at=clock.now)
    plant_model(
        r, "a", state="ready", token="T1", host="h1", device="cpu",
        loaded_at=clock.now - 100, last_used=clock.now - 50,
    )  # fmt: skip
    co.step([])
    b = json.loads(r.hget(keys.health(), "route_room"))["models"]["b"]  # type: ignore[arg-type]
    assert (b["evict"], b["unload_s"]) == (["a"], {"a": took})
    assert took >= 2.0
