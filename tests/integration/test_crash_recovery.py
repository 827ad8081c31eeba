"""Model processes and agents that die or stall, against real parts: a real Redis, the
coordinator and agent running, real model processes (llama.cpp, tiny GGUF) killed with SIGKILL.

Each test asserts that every accepted request is answered exactly once (a result or a clean
error), that the pool converges, and that no process is left behind. The ``hold`` and
``token_delay_s`` faults only make "in flight" deterministic; the kills are real.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from residency import keys, work
from residency.lua import Scripts
from residency.messages import Kind, Request
from tests.conftest import Pool
from tests.integration.test_pool import ADMIN, chat, client_for, in_thread
from workers.agent import HEARTBEAT_S


def in_flight(pool: Pool, model: str) -> int:
    return int(pool.r.llen(keys.processing(model)))


def kill_when_in_flight(pool: Pool, model: str, *, not_pid: int | None = None) -> int:
    """SIGKILL the process of ``model`` once it has a request in flight; returns its pid."""
    pool.wait_for(
        lambda: in_flight(pool, model) == 1 and pool.pid(model) not in (None, not_pid),
        what=f"a request in flight on {model}",
    )
    pid = pool.pid(model)
    assert pid
    os.kill(pid, signal.SIGKILL)
    return pid


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie until its parent (the agent, in this process) reaps it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def test_a_request_in_flight_when_its_model_is_killed_is_served_after_the_reload(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    c.post("/admin/faults", json={"hold": {"a": True}}, headers=ADMIN)
    t, out = in_thread(lambda: chat(c, "a"))
    first = kill_when_in_flight(pool, "a")
    # Requeued with one attempt counted, and taken by the reloaded process.
    pool.wait_for(
        lambda: in_flight(pool, "a") == 1 and pool.pid("a") not in (None, first),
        what="the request taken again after the reload",
    )
    held = Request.loads(str(pool.r.lindex(keys.processing("a"), 0)))
    assert held.attempts == 1
    c.post("/admin/faults", json={"hold": {"a": False}}, headers=ADMIN)
    t.join(60)
    assert out and out[0].status_code == 200, out and out[0].get_json()
    assert gone(first)


def test_a_request_that_crashes_its_model_twice_is_refused(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    c.post("/admin/faults", json={"hold": {"a": True}}, headers=ADMIN)
    t, out = in_thread(lambda: chat(c, "a"))
    first = kill_when_in_flight(pool, "a")
    kill_when_in_flight(pool, "a", not_pid=first)
    t.join(60)
    assert out, "the request was never answered"
    resp = out[0]
    assert resp.status_code == 500
    err = resp.get_json()["error"]
    assert err["code"] == "model_crashed"
    assert "a" in err["message"] and "2 times" in err["message"]
    # Nothing is left queued or in flight for it, and the model serves the next request.
    assert in_flight(pool, "a") == 0 and pool.r.llen(keys.queue("a")) == 0
    c.post("/admin/faults", json={"hold": {"a": False}}, headers=ADMIN)
    assert chat(c, "a").status_code == 200


def test_a_stream_cut_by_a_crash_ends_with_a_clean_error_event(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    c.post("/admin/faults", json={"token_delay_s": {"a": 0.2}}, headers=ADMIN)
    t, out = in_thread(lambda: chat(c, "a", stream=True, max_tokens=200).get_data(as_text=True))

    def streaming() -> bool:
        raw = pool.r.lindex(keys.processing("a"), 0)
        return raw is not None and bool(pool.r.exists(keys.reply(Request.loads(str(raw)).id)))

    pool.wait_for(streaming, what="a stream with output")
    pid = pool.pid("a")
    assert pid
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert out, "the stream never ended"
    events = [e for e in out[0].split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == "model_process_exited"
    # Partial output is never replayed: the request is not requeued.
    assert pool.r.llen(keys.queue("a")) == 0


def test_the_heartbeat_runs_while_the_agent_loop_is_stuck(
    start_pool: Callable[..., Pool],
) -> None:
    """A stuck agent loop (a slow stop, a slow spawn) must not let the worker record lapse: the
    coordinator would reap every model of a host whose processes still generate."""
    pool = start_pool()
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    stuck, release = threading.Event(), threading.Event()
    original = pool.agent.watch_children  # looked up on each loop iteration

    def blocked() -> None:
        stuck.set()
        release.wait(60)
        original()

    pool.agent.watch_children = blocked
    try:
        assert stuck.wait(30)
        beats: set[str] = set()

        def beat_seen() -> bool:
            beats.add(str(pool.r.hget(keys.worker("testhost"), "last_heartbeat")))
            return len(beats) >= 4

        # Four distinct beats span more than the record's TTL (WORKER_TTL_S / HEARTBEAT_S
        # beats), all while the loop does nothing.
        assert keys.WORKER_TTL_S / HEARTBEAT_S <= 5
        pool.wait_for(beat_seen, timeout=60, what="heartbeats while the loop is stuck")
        assert pool.state("a") == "ready"
        children = json.loads(str(pool.r.hget(keys.worker("testhost"), "children")))
        assert children == {"a": pool.r.hget(keys.model("a"), "token")}
    finally:
        release.set()
        pool.agent.watch_children = original
    assert chat(c, "a").status_code == 200


def plant_loading(pool: Pool, model: str, token: str) -> str:
    """A load the coordinator decided (state ``loading`` for ``token`` on the test host) and
    its command, as start_load.lua writes them; returns the command."""
    from residency import registry

    entry = registry.get(pool.r, model)
    assert entry is not None
    cmd = json.dumps(
        {
            "op": "load",
            "model": model,
            "token": token,
            "device": "cpu",
            "spec": entry.spec.model_dump(),
            "fault_injection": False,
            "limits_generation": 0,
        }
    )
    pool.r.hset(
        keys.model(model),
        mapping={
            "state": "loading",
            "token": token,
            "host": "testhost",
            "device": "cpu",
            "loading_since": time.time(),
            "pool": "standard",
        },
    )
    return cmd


def test_a_command_taken_before_an_agent_crash_is_carried_out_after_its_restart(
    start_pool: Callable[..., Pool], redis_url: str
) -> None:
    from residency.box import connect
    from workers.agent import Agent

    pool = start_pool(pool={"max_loaded_models": 2})
    # The first agent took the command (it sits on the taken list) and died before acting.
    token = uuid.uuid4().hex
    cmd = plant_loading(pool, "b", token)
    agent = Agent(pool.box, connect(redis_url), host="host2", device_list=["cpu"])
    pool.r.hset(keys.model("b"), "host", "host2")
    pool.r.rpush(keys.agent_taken("host2"), cmd)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        pool.wait_for(lambda: pool.state("b") == "ready", what="the re-driven load")
        assert pool.r.hget(keys.model("b"), "token") == token
        assert pool.r.llen(keys.agent_taken("host2")) == 0
        assert pool.r.llen(keys.agent_commands("host2")) == 0
    finally:
        agent.stop.set()
        t.join(30)
    assert not t.is_alive()


def test_a_stale_load_command_is_dropped(start_pool: Callable[..., Pool]) -> None:
    """A command queued for a load that was since failed (e.g. while its agent was down) is
    not run: no process starts, and it leaves the lists."""
    pool = start_pool()
    token = uuid.uuid4().hex
    cmd = plant_loading(pool, "c", token)
    # The state moves on (the load timed out) before the agent reads the command.
    pool.r.hset(keys.model("c"), mapping={"state": "failed", "error": "load_timeout"})
    pool.r.rpush(keys.agent_commands("testhost"), cmd)
    pool.wait_for(
        lambda: (
            pool.r.llen(keys.agent_commands("testhost")) == 0
            and pool.r.llen(keys.agent_taken("testhost")) == 0
        ),
        what="the command taken and dropped",
    )
    assert "c" not in pool.agent.children
    assert pool.state("c") == "failed"


def test_hand_back_counts_attempts_only_for_crashes(r: Any) -> None:
    """A process stopped on purpose (shutdown, stale state) hands its work back unchanged; a
    crash counts one attempt, and the second crash answers the request with the crash."""
    scripts = Scripts(r)
    req = Request(uuid.uuid4().hex, Kind.CHAT, "a", {"messages": []}, False, time.time())
    r.rpush(keys.processing("a"), req.dumps())
    assert work.hand_back(r, scripts, "a", "stopped with 0")["requeued"] == 1
    assert Request.loads(str(r.rpop(keys.queue("a")))).attempts == 0

    r.rpush(keys.processing("a"), req.dumps())
    assert work.hand_back(r, scripts, "a", "exited with -9", crashed=True)["requeued"] == 1
    again = Request.loads(str(r.rpop(keys.queue("a"))))
    assert again.attempts == 1

    r.rpush(keys.processing("a"), again.dumps())
    assert work.hand_back(r, scripts, "a", "exited with -9", crashed=True)["refused"] == 1
    assert r.llen(keys.queue("a")) == 0 and r.llen(keys.processing("a")) == 0
    msgs = r.xrange(keys.reply(req.id))
    assert len(msgs) == 1
    assert json.loads(msgs[0][1]["d"])["error"]["code"] == "model_crashed"
