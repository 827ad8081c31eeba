"""Load failures against a real Redis, with a coordinator driven by hand: a late ``load_failed``
event never fails the requests of the load that followed it; failures are counted once each,
in one place, and three within the window put the model in backoff (its requests answered at
once with the cause) until an admin loads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from coordinator.failures import record
from residency import keys
from residency.lua import NotLeader
from residency.messages import Event, EventType
from residency.pool import snapshot
from tests.integration.hand_leader import (
    Clock,
    hand_leader,
    live_worker,
    plant_model,
    queue,
    reply_of,
)


def failures(r: redis.Redis, model: str) -> list[dict[str, object]]:
    return [json.loads(m) for m in r.zrange(keys.load_failures(model), 0, -1)]


def load_failed(model: str, token: str, error: str = "boom") -> Event:
    return Event(EventType.LOAD_FAILED, model, {"token": token, "error": error})


def test_a_late_load_failed_event_leaves_the_next_loads_queue_alone(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    """The agent reported the process of load T1 gone before its load failure; a pass in
    between started load T2 for the waiting requests. T1's failure arrives now."""
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={"b": "T2"}, children_at=clock.now)
    plant_model(r, "b", state="loading", token="T2", host="h1", device="cpu")
    r.hset(keys.model("b"), "loading_since", clock.now)
    reqs = [queue(r, "b", clock.now - 1) for _ in range(2)]

    co.step([load_failed("b", "T1")])

    assert r.llen(keys.queue("b")) == 2
    assert all(reply_of(r, q) == [] for q in reqs)
    assert r.hmget(keys.model("b"), ["state", "token"]) == ["loading", "T2"]
    # The failure itself still counts toward the model's crash loop.
    assert [f["token"] for f in failures(r, "b")] == ["T1"]


def test_a_load_failed_event_answers_the_requests_of_its_own_load(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={}, children_at=clock.now)
    plant_model(r, "b", state="failed", token="T1", error="bad magic")
    req = queue(r, "b", clock.now - 1)

    co.step([load_failed("b", "T1", "bad magic")])

    assert r.llen(keys.queue("b")) == 0
    [(kind, data)] = reply_of(r, req)
    assert kind == "error"
    assert data["error"]["code"] == "model_load_failed"
    assert "bad magic" in data["error"]["message"]


def test_a_failure_is_counted_once_whether_reaped_or_reported(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    """A load the reaper gives up on (timeout) counts once, and its model process's own report
    of the same load, arriving later, does not count it again."""
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock, pool={"load_timeout_s": 30})
    live_worker(r, "h1", children={"c": "T1"}, children_at=clock.now)
    plant_model(r, "c", state="loading", token="T1", host="h1", device="cpu")
    r.hset(keys.model("c"), "loading_since", clock.now - 31)

    co.step([])
    assert r.hget(keys.model("c"), "state") == "failed"
    assert [(f["token"], f["error"]) for f in failures(r, "c")] == [("T1", "load_timeout")]

    co.step([load_failed("c", "T1")])
    assert len(failures(r, "c")) == 1
    assert 0 < r.ttl(keys.load_failures("c")) <= keys.LOAD_FAILURE_WINDOW_S
    # A deposed leader records nothing.
    with pytest.raises(NotLeader):
        record(r, "c", "T9", "boom", clock.now, lease="not-the-lease")
    assert len(failures(r, "c")) == 1


def test_a_process_that_dies_after_its_load_is_no_load_failure(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    """Killed after it loaded (out of memory, an operator), or stopped politely: neither says the
    model cannot load, so neither counts toward its backoff (a request that keeps crashing it is
    refused by its own attempt count)."""
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    for i in range(4):
        crash = {"token": f"T{i}", "reason": "process exited with -9", "crashed": True}
        co.step([Event(EventType.GONE, "a", crash)])
    co.step([Event(EventType.GONE, "a", {"token": "T9", "reason": "stopped with 0"})])
    assert failures(r, "a") == []


def test_three_failures_fail_fast_until_an_admin_load_clears_them(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={}, children_at=clock.now)
    for i in (1, 2, 3):
        clock.now += 60
        # Load T<i> failed: its state, then its event.
        plant_model(r, "b", state="failed", token=f"T{i}", error=f"bad magic {i}")
        co.step([load_failed("b", f"T{i}", f"bad magic {i}")])
    first = clock.now - 120  # the time of the first of the three

    req = queue(r, "b", clock.now)
    clock.now += 1
    co.step([Event(EventType.DEMAND, "b")])

    # Answered at once with the last cause; no new load was started.
    [(kind, data)] = reply_of(r, req)
    assert kind == "error"
    assert data["status"] == 503
    assert data["error"]["code"] == "model_load_backoff"
    assert "bad magic 3" in data["error"]["message"]
    assert data["retry_after"] == int(first + keys.LOAD_FAILURE_WINDOW_S - clock.now)
    assert r.hget(keys.model("b"), "state") == "failed"
    assert r.llen(keys.agent_commands("h1")) == 0
    rd = snapshot.read(r, co.settings, clock.now)
    [b] = [m for m in snapshot.health_record(rd, co.settings)["models"] if m["name"] == "b"]
    assert b["backoff"] == {
        "failures": 3,
        "until": first + keys.LOAD_FAILURE_WINDOW_S,
        "last_error": "bad magic 3",
    }

    # Once the first failure leaves the window, a request loads it again.
    clock.now = first + keys.LOAD_FAILURE_WINDOW_S
    queue(r, "b", clock.now)
    co.step([Event(EventType.DEMAND, "b")])
    assert r.hget(keys.model("b"), "state") == "loading"


def test_a_pass_before_the_failure_event_answers_the_load_instead_of_retrying_it(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    """The model process wrote ``failed`` and its event is still on the way when a pass runs
    (a demand, a timer): that pass settles the failure — counts it, answers the requests that
    waited for the load — instead of starting another load for them. The late event then
    changes nothing; a request that arrives after the settling gets a new load."""
    clock = Clock()
    co = hand_leader(tmp_path, redis_url, models_dir, clock)
    live_worker(r, "h1", children={}, children_at=clock.now)
    plant_model(r, "b", state="failed", token="T1", error="bad magic")
    waiting = queue(r, "b", clock.now - 1)

    co.step([Event(EventType.DEMAND, "b")])

    [(kind, data)] = reply_of(r, waiting)
    assert kind == "error" and data["error"]["code"] == "model_load_failed"
    assert r.hmget(keys.model("b"), ["state", "token"]) == ["failed", "T1"]
    assert [f["token"] for f in failures(r, "b")] == ["T1"]

    later = queue(r, "b", clock.now)
    co.step([load_failed("b", "T1", "bad magic")])
    assert reply_of(r, later) == []
    assert r.hget(keys.model("b"), "state") == "loading"
    assert [f["token"] for f in failures(r, "b")] == ["T1"]
