"""Keys that go away: a host that is gone leaves no key once its models are reaped, a model
deleted from the registry leaves none once it holds nothing, and a pass reads known keys (no
SCAN of the keyspace). Real Redis, a coordinator driven by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
import redis

from residency import keys
from residency.lua import NotLeader
from residency.pool.snapshot import adopt_model_keys
from tests.integration.hand_leader import Clock, hand_leader, live_worker, plant_model, queue


def keys_naming(r: redis.Redis, word: str) -> list[str]:
    # KEYS is fine in a test: it inspects the whole keyspace on purpose.
    return sorted(str(k) for k in r.keys(f"*{word}*"))


def scans(r: redis.Redis) -> int:
    stats = cast(dict[str, dict[str, int]], r.info("commandstats"))
    return int(stats.get("cmdstat_scan", {}).get("calls", 0))


def test_a_gone_host_leaves_no_key_once_its_models_are_reaped(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock, pool={"max_loaded_models": 2})
    live_worker(r, "deadhost", children={"a": "T1"}, children_at=clock.now)
    live_worker(r, "box1", children={}, children_at=clock.now)
    plant_model(r, "a", state="ready", token="T1", host="deadhost", device="cpu")
    r.rpush(keys.agent_commands("deadhost"), json.dumps({"op": "load", "model": "c"}))
    r.rpush(keys.agent_taken("deadhost"), json.dumps({"op": "load", "model": "b"}))

    co.step([])  # the host is alive: nothing of it goes
    assert r.sismember(keys.workers(), "deadhost")
    assert keys.agent_commands("deadhost") in keys_naming(r, "deadhost")

    r.delete(keys.worker("deadhost"))  # its heartbeat lapsed
    co.step([])
    co.step([])

    assert r.hget(keys.model("a"), "state") == "unloaded"  # reaped (host_gone) at once
    # Listed as gone until it has been gone worker.forget_after_s (default 600 s) ...
    assert r.sismember(keys.workers(), "deadhost")
    clock.now += 600
    co.step([])
    # ... then nothing of it is left.
    assert keys_naming(r, "deadhost") == []
    assert not r.hexists(keys.hosts_seen(), "deadhost")
    assert not r.sismember(keys.workers(), "deadhost")
    assert r.sismember(keys.workers(), "box1")
    assert r.exists(keys.worker("box1"))
    # A host that comes back registers again with its next heartbeat.
    live_worker(r, "deadhost", children={}, children_at=clock.now)
    co.step([])
    assert r.sismember(keys.workers(), "deadhost")


def test_a_gone_host_is_kept_while_a_model_still_holds_a_slot_on_it(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    """Until its models are reaped, the host stays known (the reap needs to find them)."""
    from coordinator.prune import forget
    from residency.pool.decide import Forget

    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={}, children_at=clock.now)
    plant_model(r, "a", state="ready", token="T1", host="h1", device="cpu")
    # Asked to forget a host that is alive (its record exists), the script refuses.
    assert forget(r, Forget(hosts=("h1",)), lease=co.lease_token) == {"hosts": [], "models": []}
    # A deposed leader forgets nothing.
    r.delete(keys.worker("h1"))
    with pytest.raises(NotLeader):
        forget(r, Forget(hosts=("h1",)), lease="not-the-lease")
    assert r.sismember(keys.workers(), "h1")


def test_a_deleted_models_keys_go_once_it_holds_nothing(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={}, children_at=clock.now)
    # "old" was deleted from the registry while it failed; "queued-old" still has a request.
    plant_model(r, "old", state="failed", token="T1", error="boom", last_used=5)
    r.zadd(keys.load_failures("old"), {json.dumps({"token": "T1", "error": "boom"}): clock.now})
    r.rpush(keys.control("old"), json.dumps({"op": "unload", "token": "T0"}))
    r.set(keys.progress("old"), clock.now, ex=3600)
    r.set(keys.service("old"), "0.5", ex=3600)
    r.hset(keys.footprint("old"), mapping={"bytes": 1, "estimate": 1, "spec": "x"})
    plant_model(r, "queued-old", state="unloaded")
    queue(r, "queued-old", clock.now)
    # "a" is registered: its hash stays even though it is unloaded.
    plant_model(r, "a", state="unloaded", last_used=7)

    co.step([])

    assert keys_naming(r, ":old") == []
    assert not r.sismember(keys.models_with_state(), "old")
    assert r.exists(keys.model("queued-old")) and r.llen(keys.queue("queued-old")) == 1
    assert r.hget(keys.model("a"), "last_used") == "7"
    assert r.sismember(keys.models_with_state(), "a")


def test_a_pass_reads_known_keys_and_never_scans(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={}, children_at=clock.now)
    for i in range(50):  # conversation keys a scan would have walked over
        r.set(keys.conversation(f"c{i}"), "a", ex=60)
    # A resident of a model deleted from the registry is still found, through the set.
    plant_model(r, "deleted", state="ready", token="T1", host="h1", device="cpu")
    r.hset(keys.worker("h1"), "children", json.dumps({"deleted": "T1"}))

    before = scans(r)
    co.step([])
    assert scans(r) == before
    assert r.hget(keys.model("deleted"), "state") == "draining"  # evicted: it was found
    assert [json.loads(c)["op"] for c in r.lrange(keys.control("deleted"), 0, -1)] == ["unload"]


def test_a_load_adds_the_model_to_the_known_set_and_old_hashes_are_adopted(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={}, children_at=clock.now)
    queue(r, "b", clock.now)
    co.step([])
    assert r.hget(keys.model("b"), "state") == "loading"
    assert r.smembers(keys.models_with_state()) == {"b"}
    # A hash written before the set existed is adopted once, when a coordinator takes the lead.
    r.hset(keys.model("legacy"), mapping={"state": "unloaded"})
    assert adopt_model_keys(r) == 1
    assert r.smembers(keys.models_with_state()) == {"b", "legacy"}
