"""Coordinator failover against real parts: a real Redis, real coordinators (two in this process,
driven by hand, or two `residency coordinator` processes), a real agent and model processes.

A leader holds the lease through its own renewal thread; a standby takes over once the lease
lapses; every write of the leader is fenced by its term's token, so a leader that was paused past
the lease TTL and wakes up changes nothing. Assertions are on Redis state, epochs and counts."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from coordinator import prune, retry
from coordinator.effects import clear_stale_explicit
from coordinator.loop import STANDBY_POLL_S, Coordinator
from residency import errors, keys, work
from residency.box import Box, connect
from residency.lua import NotLeader
from residency.messages import Event, EventType, Kind, Request
from residency.policies import Floor
from residency.pool import snapshot
from residency.pool.autosize import Autosize
from residency.pool.decide import Evict, Forget, Load, Reap, decide
from tests.conftest import OPEN_AUTH_ENV, tiny_models, write_config

#: The standby's takeover is measured from the leader's death to its first record; this is the
#: slack on top of the lease's remaining TTL and one standby poll, for a busy two-core machine.
TAKEOVER_SLACK_S = 1.0


def wait_for(pred: Callable[[], object], timeout: float, what: str) -> Any:
    """Poll real state; the timeout only bounds a broken test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def everything(redis_url: str, *, but: tuple[str, ...] = ()) -> dict[bytes, bytes | None]:
    """Every key of the server and its serialized value (DUMP): two equal results mean nothing
    was written in between (rq's binary job data included). ``but``: keys left out (a running
    agent's heartbeat record changes on its own)."""
    raw = redis.Redis.from_url(redis_url)
    skip = {k.encode() for k in but}
    try:
        return {k: raw.dump(k) for k in sorted(raw.keys("*")) if k not in skip}  # type: ignore[misc]
    finally:
        raw.close()


def health(r: redis.Redis) -> dict[str, Any]:
    return dict(json.loads(str(r.hget(keys.health(), "record"))))


@pytest.fixture
def box(tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path) -> Box:
    """A box on the test's Redis (emptied by ``r``), limit one model per pool."""
    cfg = write_config(
        tmp_path / "config.toml",
        {
            "server": {"model_dirs": [str(models_dir)]},
            "pool": {"max_loaded_models": 1},
            "debug": {"fault_injection": True},
            "models": tiny_models(models_dir),
            "policies": {},
        },
    )
    return Box(
        data_dir=tmp_path / "data",
        config_path=cfg,
        redis_url=redis_url,
        environ={**OPEN_AUTH_ENV, "RESIDENCY_ADMIN_KEY": "test-admin-key"},
    )


def request(model: str) -> Request:
    return Request(
        id=uuid.uuid4().hex,
        kind=Kind.CHAT,
        model=model,
        params={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        stream=False,
        submitted=time.time() - 10,
    )


def plant_trap(r: redis.Redis) -> dict[str, Request]:
    """A pool where a pass has work of every kind: ``a`` and ``b`` ready and idle on a live host
    with room for one (evict the LRU ``a``), ``c`` ready on a host that is gone with a request
    in flight (reap it, hand the request back), ``q8`` loading for an hour (reap it as failed,
    answer its queued request), a stale explicit wish for ``b``, a request queued for the
    embedding model (load it), and an event in the inbox."""
    r.hset(keys.worker("h1"), mapping={"devices": json.dumps(["cpu"]), "memory": "{}"})
    r.sadd(keys.workers(), "h1", "gone-host")
    now = time.time()
    for name, fields in {
        "a": {"state": "ready", "host": "h1", "last_used": now - 100},
        "b": {"state": "ready", "host": "h1", "last_used": now - 50},
        "c": {"state": "ready", "host": "gone-host", "last_used": now - 10},
        "q8": {"state": "loading", "host": "h1", "loading_since": now - 3600},
    }.items():
        r.hset(keys.model(name), mapping={"token": f"t-{name}", "device": "cpu", **fields})
        r.sadd(keys.models_with_state(), name)
    reqs = {"c": request("c"), "q8": request("q8"), "emb": request("emb")}
    r.lpush(keys.processing("c"), reqs["c"].dumps())
    r.lpush(keys.queue("q8"), reqs["q8"].dumps())
    r.lpush(keys.queue("emb"), reqs["emb"].dumps())
    r.hset(keys.explicit(), "b", "load")
    r.rpush(keys.events(), json.dumps(Event(EventType.DEMAND, "emb").to_dict()))
    return reqs


def take_over(standby: Coordinator, deposed: Coordinator) -> None:
    """The deposed leader is paused (nothing of it runs, so nothing renews its lease): the
    standby's polls take the lease once it lapses — within one TTL."""
    epoch = deposed.epoch
    wait_for(standby.try_lead, keys.LEADER_TTL_MS / 1000 + 5, "the standby to take the lease")
    assert standby.epoch == epoch + 1, "another term came in between"
    assert deposed.is_leader, "the paused leader cannot have noticed anything yet"
    standby.r.delete(keys.events())  # the new leader's own start-up event: not part of the trap


def test_a_paused_leader_that_wakes_up_changes_nothing(box: Box, redis_url: str) -> None:
    """A leads and publishes; A pauses; B takes over after the lease lapses and publishes; a
    pool with work of every kind is planted; A wakes up and runs its loop: every key is exactly
    as before (its first write is refused) and the record is B's. Then B's pass does the work
    A would have done, so the trap was real."""
    a = Coordinator(box, connect(redis_url))
    b = Coordinator(box, connect(redis_url))
    assert a.try_lead()
    a.r.delete(keys.events())
    a.step([])
    assert health(a.r)["leader"]["epoch"] == a.epoch

    take_over(b, a)
    b.step([])
    reqs = plant_trap(a.r)
    before = everything(redis_url)

    a.iteration()  # takes its events (refused), and would run a pass
    assert not a.is_leader
    assert a.step([Event(EventType.DEMAND, "emb")]) == []
    assert everything(redis_url) == before
    assert health(a.r)["leader"] == b.leader_record()

    # The trap was armed: the leader's pass does all of it.
    b.step(b.collect_events(0.01))
    states = {m: a.r.hget(keys.model(m), "state") for m in ("a", "b", "c", "q8", "emb")}
    # (b goes too: c's handed-back request wants the one slot.)
    assert states == {
        "a": "draining",
        "b": "draining",
        "c": "unloaded",
        "q8": "failed",
        "emb": "loading",
    }
    assert a.r.lrange(keys.queue("c"), 0, -1) == [reqs["c"].dumps()]  # handed back
    assert a.r.exists(keys.reply(reqs["q8"].id))  # answered
    assert not a.r.hexists(keys.explicit(), "b")
    assert health(a.r)["leader"]["epoch"] == b.epoch


def test_every_write_of_a_deposed_leader_is_refused(box: Box, redis_url: str) -> None:
    """A paused in the middle of a pass, with its decisions in hand: B takes over; A resumes and
    tries every kind of leader write — each action, clearing wishes, the idle watch, failing
    and handing back requests, autosize state, the retry queue, seeding, its inbox, limits,
    health, key pruning. Each is refused, and no key changed."""
    a = Coordinator(box, connect(redis_url))
    b = Coordinator(box, connect(redis_url))
    assert a.try_lead()
    a.r.delete(keys.events())
    reqs = plant_trap(a.r)
    s = a.refresh_settings()
    rd = snapshot.read(a.r, s, time.time())
    actions = decide(rd.snap)
    kinds = {type(x) for x in actions}
    assert {Evict, Reap, Load} <= kinds, actions

    take_over(b, a)
    b.r.rpush(keys.events(), json.dumps(Event(EventType.DEMAND, "emb").to_dict()))
    # A job for A's retry writes to try to drop or replace: finished (so a deferral, too,
    # would replace it).
    assert retry.defer(b.rq, {"llm": 1}, lease=b.lease_token)
    b.rq.hset(f"rq:job:{keys.SHRINK_JOB_ID}", "status", "finished")
    a.r.hdel(keys.registry(), "c")  # A's seeding would put it back
    before = everything(redis_url)

    writes: list[tuple[str, Callable[[], object]]] = [
        *[
            (f"{type(x).__name__} {x.model}", lambda x=x: a.effects.apply([x], rd.snap, {}, s))  # type: ignore[misc]
            for x in actions
            if isinstance(x, (Evict, Reap, Load))
        ],
        ("clear wishes", lambda: clear_stale_explicit(a.scripts, rd.snap, lease=a.lease_token)),
        ("idle watch on", lambda: a.effects.watch_idle(True)),
        ("idle watch off", lambda: a.effects.watch_idle(False)),
        (
            "fail queued",
            lambda: work.fail_queued(
                a.r, "q8", errors.slots_pinned("q8", "llm"), lease=a.lease_token
            ),
        ),
        ("hand back", lambda: work.hand_back(a.r, a.scripts, "c", "x", lease=a.lease_token)),
        ("autosize", lambda: a.tell_autosize(Autosize(True, 1, Floor(2, {"p": 2}, []), 2, False))),
        ("defer", lambda: a.track_deferral({"llm": 1})),
        ("settle", lambda: (setattr(a, "_deferred", True), a.track_deferral({}))),
        ("seed", a.on_lead),
        ("take events", lambda: a.collect_events(0.01)),
    ]
    for what, write in writes:
        with pytest.raises(NotLeader):
            write()
        assert a.is_leader, what  # (the calls above are below the loop, which stands by)
    assert not a.sync_limits(10**9, rd)
    a.publish(10**9, {"status": "stale"}, force=True)
    with pytest.raises(NotLeader):
        prune.forget(a.r, Forget(hosts=("gone-host",), models=("c",)), lease=a.lease_token)
    assert everything(redis_url) == before
    assert a.r.lrange(keys.processing("c"), 0, -1) == [reqs["c"].dumps()]


class _Stall:
    """A clock that, once armed, blocks the pass that reads it until released: a long pass."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> float:
        if self.armed.is_set():
            self.armed.clear()
            self.entered.set()
            self.release.wait(60)
        return time.time()


def test_a_pass_longer_than_the_lease_keeps_it(box: Box, redis_url: str) -> None:
    """The lease is renewed by its own thread: a pass that blocks for longer than the lease TTL
    (renewed at least four times meanwhile, a third of the TTL apart) keeps it — the standby
    never takes over, the epoch does not move — and the pass then publishes as the leader."""
    stall = _Stall()
    stop = threading.Event()
    a = Coordinator(box, connect(redis_url), stop=stop, clock=stall)
    b = Coordinator(box, connect(redis_url), stop=stop)
    threads = [threading.Thread(target=co.run, daemon=True) for co in (a, b)]
    try:
        threads[0].start()
        wait_for(lambda: a.is_leader and a.r.hexists(keys.health(), "record"), 30, "a leading")
        threads[1].start()
        epoch = a.epoch
        stall.armed.set()
        a.r.rpush(keys.events(), json.dumps(Event(EventType.DEMAND, "a").to_dict()))
        wait_for(stall.entered.is_set, 30, "a pass stalled")
        renewals, last = 0, a.r.pttl(keys.leader())
        while renewals < 4:
            ttl = a.r.pttl(keys.leader())
            assert ttl > 0, "the lease lapsed during the long pass"
            renewals += ttl > last
            last = ttl
            time.sleep(0.02)
        assert a.r.get(keys.leader()) == a.lease_token
        assert int(str(a.r.get(keys.leader_epoch()))) == epoch and not b.is_leader
        gen = int(str(a.r.get(keys.generation())))
        stall.release.set()
        wait_for(lambda: health(a.r)["generation"] >= gen, 30, "the long pass published")
        assert health(a.r)["leader"]["epoch"] == epoch and a.is_leader
    finally:
        stall.release.set()
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)


# -- real processes ---------------------------------------------------------------------------


def _coordinator_process(box: Box, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
    env |= {
        "RESIDENCY_REDIS_URL": str(box.redis_url),
        "RESIDENCY_CONFIG": str(box.config_path),
        "RESIDENCY_DATA_DIR": str(box.data_dir),
        "RESIDENCY_ADMIN_KEY": "test-admin-key",
        "RESIDENCY_LOG_LEVEL": "INFO",
    }
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "residency.cli", "coordinator"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def test_the_standby_process_leads_when_the_leader_is_killed(
    box: Box, r: redis.Redis, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Two `residency coordinator` processes and an agent. With a slow load in flight and
    requests queued behind it, the leader is SIGKILLed: the standby leads within the lease's
    remaining TTL plus a poll (one new epoch, its pid in /health), the pool converges to the
    limit, every request is answered once, and no process is left behind."""
    from web.app import create_app
    from workers.agent import Agent

    box.data_dir.mkdir(parents=True, exist_ok=True)
    already = {p.pid for p in psutil.Process().children(recursive=True)}  # the Redis server
    logs = [tmp_path / "coordinator-1.log", tmp_path / "coordinator-2.log"]
    first = _coordinator_process(box, logs[0])
    processes.append(first)
    wait_for(
        lambda: (
            r.hexists(keys.health(), "record")
            and health(r)["leader"]["id"].endswith(f":{first.pid}")
        ),
        60,
        "the first coordinator leading",
    )
    second = _coordinator_process(box, logs[1])
    processes.append(second)
    wait_for(lambda: b"coordinator started" in logs[1].read_bytes(), 60, "the standby running")

    stop = threading.Event()
    agent = Agent(box, connect(str(box.redis_url)), host="testhost", device_list=["cpu"], stop=stop)
    agent_thread = threading.Thread(target=agent.run, daemon=True)
    agent_thread.start()
    kids: list[psutil.Process] = []
    try:
        c = create_app(box).test_client()
        admin = {"Authorization": "Bearer test-admin-key"}

        def chat(model: str) -> Any:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            return c.post("/v1/chat/completions", json={**body, "max_tokens": 2})

        assert chat("a").status_code == 200
        c.post("/admin/faults", json={"load_delay_s": {"b": 60}}, headers=admin)
        results: dict[str, list[Any]] = {"b": [], "c": []}
        threads = [
            threading.Thread(target=lambda m=m: results[m].append(chat(m)), daemon=True)  # type: ignore[misc]
            for m in ("b", "c", "c")
        ]
        threads[0].start()
        wait_for(lambda: r.hget(keys.model("b"), "state") == "loading", 60, "b loading")
        for t in threads[1:]:
            t.start()
        wait_for(lambda: r.llen(keys.queue("c")) == 2, 30, "two requests queued for c")
        kids = [p for p in psutil.Process().children(recursive=True) if p.pid not in already]

        epoch = int(str(r.get(keys.leader_epoch())))
        remaining_s = r.pttl(keys.leader()) / 1000
        killed_at = time.time()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        c.post("/admin/faults", json={"load_delay_s": {"b": 0}}, headers=admin)

        record = wait_for(
            lambda: (h := health(r))["leader"]["id"].endswith(f":{second.pid}") and h,
            60,
            "the standby's first record",
        )
        assert int(str(r.get(keys.leader_epoch()))) == epoch + 1, "exactly one takeover"
        assert record["leader"]["epoch"] == epoch + 1
        took = record["leader"]["since"] - killed_at
        assert took <= remaining_s + STANDBY_POLL_S + TAKEOVER_SLACK_S, (took, remaining_s)

        for t in threads:
            t.join(120)
        assert [resp.status_code for m in ("b", "c") for resp in results[m]] == [200] * 3
        assert sum(len(v) for v in results.values()) == 3  # each answered once
        wait_for(
            lambda: (
                {
                    m["name"]
                    for m in health(r)["models"]
                    if m["type"] == "llm" and m["state"] in ("loading", "ready", "draining")
                }
                == {"c"}
            ),
            60,
            "the pool converged to the limit",
        )
        assert r.llen(keys.queue("c")) == 0 and r.llen(keys.processing("c")) == 0
    finally:
        stop.set()
        agent_thread.join(60)
    assert not agent_thread.is_alive()
    second.send_signal(signal.SIGTERM)
    assert second.wait(60) == 0
    _gone, alive = psutil.wait_procs(kids, timeout=30)
    assert alive == []
    assert not r.exists(keys.leader()), "the stopped standby released its lease"


# -- the retry queue's jobs -------------------------------------------------------------------


class _Planted:
    """What an attacker with write access to Redis plants: unpickling it runs os.mkdir."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_retry_jobs_are_json_and_a_planted_pickle_is_never_run(
    r: redis.Redis, tmp_path: Path
) -> None:
    """The deferred-shrink job is stored as JSON naming its function by import path; a pickled
    job planted in the queue is not loaded (so its code never runs), and the worker goes on to
    run the next job."""
    rq_r = retry.connection(r)
    r.set(keys.leader(), "the-leader")
    assert retry.defer(rq_r, {"llm": 1}, lease="the-leader")
    stored = rq_r.hget(f"rq:job:{keys.SHRINK_JOB_ID}", "data")
    func, _instance, args, kwargs = json.loads(zlib.decompress(stored))  # type: ignore[arg-type]
    assert (func, args, kwargs) == (retry.JOB_FUNC, [], {})

    marker = tmp_path / "planted-code-ran"
    q = retry.queue(rq_r)
    rq_r.hset(
        "rq:job:planted",
        mapping={
            "data": zlib.compress(pickle.dumps(_Planted(marker))),
            "status": "queued",
            "origin": q.name,
            "description": "planted",
            "created_at": "2025-01-01T00:00:00.000000Z",
            "enqueued_at": "2025-01-01T00:00:00.000000Z",
        },
    )
    rq_r.sadd("rq:queues", q.key)
    rq_r.rpush(q.key, "planted")
    after = q.enqueue(retry.JOB_FUNC, job_id="after-the-planted-one")

    stop = threading.Event()
    worker = threading.Thread(target=retry.run_worker, args=(rq_r, stop), daemon=True)
    worker.start()
    try:
        wait_for(lambda: after.get_status(refresh=True) == "finished", 30, "the next job finished")
    finally:
        stop.set()
        worker.join(30)
    assert not marker.exists(), "the planted pickle was loaded"
    assert rq_r.lrange(q.key, 0, -1) == []
    assert after.return_value() == "converged"


def _token_of(pid: int, where: str) -> str:
    return f"{uuid.uuid4().hex}@{where}/{pid}"


def test_a_standby_takes_over_at_once_from_a_dead_holder_on_its_host(
    box: Box, redis_url: str
) -> None:
    """The holder of a lease with a minute left died (its pid is gone): a standby on the same
    host and pid namespace frees that lease and leads at once. Only the dead-holder check can
    explain the takeover here: the lease's TTL is far beyond the bounded wait."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    b = Coordinator(box, connect(redis_url))
    r = connect(redis_url)
    r.set(keys.leader(), _token_of(dead.pid, b._where), px=60_000)
    b.iteration()
    assert b.is_leader
    assert r.get(keys.leader()) == b.lease_token


def test_a_standby_never_takes_a_live_or_foreign_holders_lease(box: Box, redis_url: str) -> None:
    """A holder that is alive, or that lives on another host or pid namespace (whose pids mean
    nothing here), keeps its lease until the TTL ends it."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    b = Coordinator(box, connect(redis_url))
    r = connect(redis_url)
    try:
        for token in (
            _token_of(alive.pid, b._where),
            _token_of(dead.pid, "otherhost/" + b._where.split("/", 1)[1]),
            _token_of(dead.pid, b._where.split("/", 1)[0] + "/4026531999"),
            uuid.uuid4().hex,  # an older token form: no holder named
        ):
            r.set(keys.leader(), token, px=60_000)
            for _ in range(3):
                b.iteration()
            assert not b.is_leader and r.get(keys.leader()) == token
    finally:
        alive.kill()
        alive.wait()
