"""State that no process backs is reaped: a model left ``ready`` or ``draining`` on a live host
whose agent no longer reports its process (the agent forgot the child before releasing it, and a
Redis error in between kept the release from happening). Real Redis, a coordinator driven by
hand; the worker record is planted as the agent's heartbeat writes it."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from residency import keys
from residency.messages import Event, EventType
from residency.pool.decide import DRAIN_TIMEOUT_S
from tests.integration.hand_leader import (
    Clock,
    hand_leader,
    live_worker,
    plant_model,
    queue,
    reply_of,
)


def events(r: redis.Redis) -> list[Event]:
    return [Event.loads(e) for e in r.lrange(keys.events(), 0, -1)]


def test_a_ready_model_its_agent_does_not_back_is_reaped_and_its_work_handed_back(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock, pool={"max_loaded_models": 2})
    loaded_at = clock.now - 30
    plant_model(r, "a", state="ready", token="T1", host="h1", device="cpu", loaded_at=loaded_at)
    req = queue(r, "a", clock.now - 5)
    r.rpoplpush(keys.queue("a"), keys.processing("a"))  # in flight on the vanished process
    live_worker(r, "h1", children={}, children_at=loaded_at + 1)

    co.step([])

    # Reaped: the in-flight request (no output yet) went back to the queue, unanswered, and
    # the demand it carries started a fresh load of a new token on the live host.
    assert r.llen(keys.processing("a")) == 0
    assert [json.loads(x)["id"] for x in r.lrange(keys.queue("a"), 0, -1)] == [req.id]
    assert reply_of(r, req) == []
    assert r.hget(keys.model("a"), "state") == "loading"
    token = r.hget(keys.model("a"), "token")
    assert token not in (None, "T1")
    commands = [json.loads(c) for c in r.lrange(keys.agent_commands("h1"), 0, -1)]
    assert [(c["model"], c["token"]) for c in commands] == [("a", token)]
    gone = [e for e in events(r) if e.type is EventType.GONE and e.model == "a"]
    assert [e.data["reason"] for e in gone] == ["no_process"]


def test_a_model_whose_process_is_reported_or_too_new_to_judge_is_kept(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock, pool={"max_loaded_models": 3})
    loaded_at = clock.now - 30
    # a: its process is in the report. b: the report was read before b's process committed,
    # so its absence proves nothing. c: on a host whose agent does not report children.
    plant_model(r, "a", state="ready", token="Ta", host="h1", device="cpu", loaded_at=loaded_at)
    plant_model(r, "b", state="ready", token="Tb", host="h1", device="cpu", loaded_at=loaded_at)
    plant_model(r, "c", state="ready", token="Tc", host="h2", device="cpu", loaded_at=loaded_at)
    live_worker(r, "h1", children={"a": "Ta"}, children_at=loaded_at - 1)
    live_worker(r, "h2", children={}, children_at=loaded_at + 1)
    r.hdel(keys.worker("h2"), "children", "children_at")
    for _ in range(2):
        co.step([])
    for name, token in (("a", "Ta"), ("b", "Tb"), ("c", "Tc")):
        assert r.hmget(keys.model(name), ["state", "token"]) == ["ready", token], name
    # Once a report read after b's commit still lacks it, b goes; a stays.
    live_worker(r, "h1", children={"a": "Ta"}, children_at=loaded_at + 1)
    co.step([])
    assert r.hget(keys.model("b"), "state") == "unloaded"
    assert r.hmget(keys.model("a"), ["state", "token"]) == ["ready", "Ta"]


def test_a_model_draining_past_the_bound_without_a_process_is_reaped(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    """``draining_since`` is checked: an agent that does not report children (so the report
    cannot show the process) still cannot leave a drain stranded forever."""
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock, pool={"max_loaded_models": 2})
    for name in ("a", "b"):
        plant_model(r, name, state="draining", token=f"T{name}", host="h1", device="cpu")
    r.hset(keys.model("a"), "draining_since", clock.now - DRAIN_TIMEOUT_S - 1)
    r.hset(keys.model("b"), "draining_since", clock.now - DRAIN_TIMEOUT_S + 5)
    live_worker(r, "h1", children={}, children_at=clock.now)
    r.hdel(keys.worker("h1"), "children", "children_at")

    co.step([])
    assert r.hget(keys.model("a"), "state") == "unloaded"
    assert not r.hexists(keys.model("a"), "draining_since")
    assert r.hget(keys.model("b"), "state") == "draining"

    clock.now += 10
    co.step([])
    assert r.hget(keys.model("b"), "state") == "unloaded"
