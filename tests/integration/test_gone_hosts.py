"""A gone host (its worker record expired) is listed in /health as gone, with when it was last
seen, until it has been gone ``worker.forget_after_s``; then it is forgotten. Its models are
reaped at once all the same. Real Redis, a coordinator driven by hand (``Clock``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from coordinator.prune import forget
from residency import keys
from residency.lua import NotLeader
from residency.pool.decide import Forget
from tests.integration.hand_leader import Clock, hand_leader, live_worker, plant_model


def listed(r: redis.Redis) -> dict[str, dict[str, Any]]:
    record = json.loads(str(r.hget(keys.health(), "record")))
    return {w["host"]: w for w in record["workers"]}


def test_a_gone_host_is_listed_as_gone_until_forget_after_s_then_forgotten(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock, pool={"max_loaded_models": 2})
    seen = clock.now - 5
    live_worker(r, "h1", children={"a": "T1"}, children_at=seen)
    live_worker(r, "box1", children={}, children_at=clock.now)
    plant_model(r, "a", state="ready", token="T1", host="h1", device="cpu", loaded_at=seen - 9)
    co.step([])
    assert listed(r)["h1"]["alive"] is True
    assert listed(r)["h1"]["last_seen"] == seen

    r.delete(keys.worker("h1"))  # its heartbeat lapsed
    co.step([])
    # Its model is reaped at once; the host stays, listed as gone with its last sighting.
    assert r.hget(keys.model("a"), "state") == "unloaded"
    assert listed(r)["h1"]["alive"] is False
    assert listed(r)["h1"]["last_seen"] == seen
    assert listed(r)["h1"]["last_heartbeat"] is None  # the record itself is gone
    assert listed(r)["box1"]["alive"] is True

    clock.now = seen + 599  # gone for less than forget_after_s (600 by default)
    co.step([])
    assert set(listed(r)) == {"h1", "box1"}
    assert r.sismember(keys.workers(), "h1")

    clock.now = seen + 600
    co.step([])  # forgets it (this pass's record was read before)
    assert not r.sismember(keys.workers(), "h1")
    co.step([])
    assert set(listed(r)) == {"box1"}
    assert not r.sismember(keys.workers(), "h1")
    assert not r.hexists(keys.hosts_seen(), "h1")
    assert r.hexists(keys.hosts_seen(), "box1")


def test_forget_after_s_is_live_and_zero_forgets_at_once(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={}, children_at=clock.now)
    r.delete(keys.worker("h1"))
    co.step([])
    assert "h1" in listed(r)
    r.hset(keys.config_admin(), "worker.forget_after_s", json.dumps(0))
    r.incr(keys.config_generation())
    co.step([])
    assert not r.sismember(keys.workers(), "h1")
    co.step([])
    assert "h1" not in listed(r)


def test_a_host_that_came_back_or_beat_after_the_cutoff_is_not_forgotten(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    lease = co.lease_token
    live_worker(r, "h1", children={}, children_at=clock.now - 700)
    r.rpush(keys.agent_commands("h1"), json.dumps({"op": "load", "model": "a"}))
    # Came back: its record exists.
    assert forget(r, Forget(hosts=("h1",), seen_before=clock.now - 600), lease=lease) == {
        "hosts": [],
        "models": [],
    }
    # Gone again, but it beat after the cutoff the decision was made with.
    r.delete(keys.worker("h1"))
    r.hset(keys.hosts_seen(), "h1", clock.now - 10)
    assert forget(r, Forget(hosts=("h1",), seen_before=clock.now - 600), lease=lease)["hosts"] == []
    assert r.sismember(keys.workers(), "h1")
    assert r.exists(keys.agent_commands("h1"))
    # A deposed leader forgets nothing.
    with pytest.raises(NotLeader):
        forget(r, Forget(hosts=("h1",)), lease="not-the-lease")
    # Last seen before the cutoff: every key of it goes, its sighting too.
    assert forget(r, Forget(hosts=("h1",), seen_before=clock.now - 10), lease=lease)["hosts"] == [
        "h1"
    ]
    assert not r.sismember(keys.workers(), "h1")
    assert not r.exists(keys.agent_commands("h1"))
    assert not r.hexists(keys.hosts_seen(), "h1")
