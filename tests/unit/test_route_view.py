"""The router's view of its candidates (``residency.route_view``): the pure mapping from what
was read to ``route_wait.View``, and ``route_view.lua`` against a real Redis (the queued
requests ahead of a caller's turn, the caller's own prefix record)."""

from __future__ import annotations

import json
import time

import redis

from residency import keys
from residency.lua import Scripts
from residency.messages import Kind, Request, new_request_id
from residency.route_view import Caller, Row, cached_bytes, read, view
from residency.route_wait import Service
from residency.settings import ModelSpec

SPEC = ModelSpec(path="/models/x.gguf", parallel=2)
REMOTE = ModelSpec(base_url="http://10.0.0.5:8080/v1")
ROOM = {
    "models": {
        "cold": {
            "fits": True,
            "reason": "after_evictions",
            "evict": ["busy"],
            "turn_left": {"busy": 0.0},
            "load_s": 2.5,
            "load_bytes": 1000,
        },
        "huge": {"fits": False, "reason": "too_large", "evict": []},
    },
    "max_busy_s": 7.0,
}


def test_a_ready_candidate_keeps_its_live_numbers() -> None:
    row = Row(
        state="ready", parallel=4, in_flight=3, ahead=2, service=Service(1.5, 0.2, 50, 2500, 10)
    )
    v = view("r", SPEC, row, ROOM, {}, now=0.0, caller=Caller(), cached=10)
    assert (v.state, v.parallel, v.in_flight, v.ahead) == ("ready", 4, 3, 2)
    assert v.service.service_s == 1.5 and v.cached_bytes == 10 and v.max_busy_s == 7.0


def test_a_cold_candidate_takes_its_room_and_its_victims_live_counts() -> None:
    busy = Row(state="ready", parallel=1, in_flight=1, queued=3, service=Service(4.0))
    v = view("cold", SPEC, Row(), ROOM, {"busy": busy}, now=0.0, caller=Caller(), cached=0)
    assert v.state == "cold" and v.load_s == 2.5 and v.load_bytes == 1000
    (o,) = v.victims
    assert (o.name, o.in_flight, o.queued, o.service_s) == ("busy", 1, 3, 4.0)


def test_each_victim_takes_its_measured_unload_from_the_room() -> None:
    room = {
        "models": {
            "cold": {
                "fits": True,
                "reason": "after_evictions",
                "evict": ["slow", "never", "bad"],
                "turn_left": {"slow": 0.0, "never": 2.0, "bad": 0.0},
                # "never" was never unloaded (or not since the field existed); "bad" is damaged.
                "unload_s": {"slow": 4.5, "bad": "nan"},
                "load_s": 2.5,
            }
        },
    }
    v = view("cold", SPEC, Row(), room, {}, now=0.0, caller=Caller(), cached=0)
    assert [(o.name, o.unload_s, o.turn_left_s) for o in v.victims] == [
        ("slow", 4.5, 0.0),
        ("never", 0.0, 2.0),
        ("bad", 0.0, 0.0),
    ]
    # A room published before the field existed: no unload time, as before.
    before = view("cold", SPEC, Row(), ROOM, {}, now=0.0, caller=Caller(), cached=0)
    assert [o.unload_s for o in before.victims] == [0.0]


def test_what_the_pool_says_cannot_load_is_unavailable() -> None:
    v = view("huge", SPEC, Row(), ROOM, {}, now=0.0, caller=Caller(), cached=0)
    assert v.state == "unavailable" and v.excluded == "too_large"


def test_a_loading_candidate_counts_how_long_its_load_ran() -> None:
    row = Row(state="loading", loading_since=100.0)
    v = view("cold", SPEC, row, ROOM, {}, now=101.5, caller=Caller(), cached=0)
    assert v.state == "loading" and v.loading_for_s == 1.5 and v.load_s == 2.5


def test_the_callers_key_decides_what_it_may_be_routed_to() -> None:
    no_b = Caller(may_use=lambda n: n != "b", may_load=False)
    assert (
        view("b", SPEC, Row(state="ready"), {}, {}, now=0, caller=no_b, cached=0).excluded == "key"
    )
    cold = view("a", SPEC, Row(), ROOM, {}, now=0, caller=no_b, cached=0)
    assert cold.excluded == "may_load"
    ready = view("a", SPEC, Row(state="ready"), ROOM, {}, now=0, caller=no_b, cached=0)
    assert ready.excluded == ""
    far = view("far", REMOTE, Row(), ROOM, {}, now=0, caller=no_b, cached=0)
    assert far.remote and far.excluded == ""
    assert view("x", None, Row(), ROOM, {}, now=0, caller=no_b, cached=0).excluded


def test_damaged_numbers_never_become_nan() -> None:
    row = Row.parse(["ready", "nan", "inf", "", "x", "2", "1", "nan 1 2", "-3"])
    assert row.parallel is None and row.loading_since is None and row.service.service_s is None
    assert (row.queued, row.in_flight) == (2, 1)


def test_a_prefix_counts_only_where_it_is_still_held() -> None:
    seen = {"a": [100.0, 800]}
    same = Row(state="ready", loaded_at=90.0)
    reloaded = Row(state="ready", loaded_at=110.0)
    assert cached_bytes("a", same, seen, 1000, slot_cache=False) == 800
    assert cached_bytes("a", same, seen, 500, slot_cache=False) == 500  # at most this prompt
    assert cached_bytes("a", reloaded, seen, 1000, slot_cache=False) == 0
    assert cached_bytes("a", reloaded, seen, 1000, slot_cache=True) == 800  # saved at unload
    assert cached_bytes("b", same, seen, 1000, slot_cache=True) == 0
    assert cached_bytes("a", same, {"a": ["x", 1]}, 1000, slot_cache=True) == 0


def _queue(scripts: Scripts, model: str, user: str) -> None:
    raw = Request(
        id=new_request_id(),
        kind=Kind.CHAT,
        model=model,
        params={"messages": []},
        stream=False,
        submitted=time.time(),
        user=user,
    ).dumps()
    scripts.submit(model, raw, bound=-1, demand_event={}, user=user, weight=1.0, fair=True)


def test_only_the_requests_before_the_callers_turn_are_ahead(r: redis.Redis) -> None:
    scripts = Scripts(r)
    r.hset(keys.model("m"), mapping={"state": "ready", "parallel": "1"})
    for _ in range(5):
        _queue(scripts, "m", "flood")
    # The model took one: in flight, four queued, all the flooder's.
    r.lmove(keys.queue("m"), keys.processing("m"), "RIGHT", "LEFT")
    _, _, (mine,) = scripts.route_view(["m"], user="carol", fair=True, prefix_key="-")
    _, _, (theirs,) = scripts.route_view(["m"], user="flood", fair=True, prefix_key="-")
    _, _, (fifo,) = scripts.route_view(["m"], user="carol", fair=False, prefix_key="-")
    assert Row.parse(mine).queued == 4 and Row.parse(mine).in_flight == 1
    assert Row.parse(mine).ahead == 0
    assert Row.parse(theirs).ahead == 4
    assert Row.parse(fifo).ahead == 4


def test_the_prefix_record_is_the_callers_own(r: redis.Redis) -> None:
    """A caller's routing reads only its own conversation record: whether another caller sent
    the same conversation never shows in its predictions."""
    scripts = Scripts(r)
    r.hset(keys.model("m"), mapping={"state": "ready", "parallel": "1", "loaded_at": "1"})
    r.set(keys.route_prefix("user:alice", "d1"), json.dumps({"m": [time.time(), 4000]}))
    specs = [("m", SPEC)]
    common = {"fair": True, "prompt_bytes": 4000, "now": time.time(), "caller": Caller()}
    alice = read(scripts, specs, user="alice", prefix_key=keys.route_prefix("user:alice", "d1"),
                 slot_cache=False, **common)  # fmt: skip
    bob = read(scripts, specs, user="bob", prefix_key=keys.route_prefix("user:bob", "d1"),
               slot_cache=False, **common)  # fmt: skip
    assert alice.views[0].cached_bytes == 4000
    assert bob.views[0].cached_bytes == 0


def test_room_on_its_way_is_a_cold_load_not_unavailable() -> None:
    """The pool may answer that the room is not there yet (a slot or bytes draining): the
    candidate is predicted as a cold load, never left out (only a refusal or a failure is)."""
    room = {"models": {"x": {"fits": False, "reason": "slot_draining", "evict": []}}}
    v = view("x", SPEC, Row(), room, {}, now=0.0, caller=Caller(), cached=0)
    assert v.state == "cold" and v.excluded == ""
    for reason in ("too_large", "memory_pinned", "slots_pinned", "backoff", "no_worker"):
        room = {"models": {"x": {"fits": False, "reason": reason, "evict": []}}}
        v = view("x", SPEC, Row(), room, {}, now=0.0, caller=Caller(), cached=0)
        assert v.state == "unavailable" and v.excluded == reason
