"""Fairness between models against real parts: a real Redis, the coordinator and agent running,
real model processes (llama.cpp, tiny GGUF, one slot each), requests through the Flask app.

A busy model whose slot another model has waited ``pool.max_busy_s`` for *yields*: it takes
nothing new, finishes what it runs, is evicted with its queued requests kept, and those get a
slot in turn. The ``hold`` and ``token_delay_s`` faults make "busy" deterministic; assertions are
on outcomes, counts and orders (and one bound of loads by ``min_resident_s``), never on how long
something took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from coordinator.loop import Coordinator
from residency import keys, metrics
from residency.box import Box, connect
from residency.lua import NotLeader
from residency.pool import snapshot
from residency.pool.decide import Resume, Yield
from tests.conftest import Pool, tiny_models, write_config
from tests.integration.test_bounded_work import configure, faults
from tests.integration.test_failover import everything, take_over
from tests.integration.test_live_limits import counter, health
from tests.integration.test_pool import chat, client_for, in_thread, loads


def model_record(pool: Pool, name: str) -> dict[str, Any]:
    models = health(pool)["models"]
    assert isinstance(models, list)
    return next(m for m in models if m["name"] == name)


class Clients:
    """``n`` clients per model, each sending requests for its model back to back (after
    ``think_s`` of its own between an answer and its next request) until ``stop``; every
    answer's status is recorded in the order the answers came."""

    def __init__(self, pool: Pool, n: int, *models: str, think_s: float = 0.0) -> None:
        self.pool = pool
        self.think_s = think_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.answers: list[tuple[str, int]] = []
        self.threads = [
            threading.Thread(target=self._loop, args=(m,), daemon=True)
            for m in models
            for _ in range(n)
        ]
        for t in self.threads:
            t.start()

    def _loop(self, model: str) -> None:
        c = client_for(self.pool)
        while not self.stop.is_set():
            status = chat(c, model).status_code
            with self.lock:
                self.answers.append((model, status))
            self.stop.wait(self.think_s)

    def count(self, model: str) -> int:
        with self.lock:
            return sum(1 for m, _ in self.answers if m == model)

    def end(self) -> list[tuple[str, int]]:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads), "a client never got its answer"
        return list(self.answers)


def test_a_busy_model_yields_its_slot_and_its_queued_requests_wait_their_turn(
    start_pool: Callable[..., Pool],
) -> None:
    """``a`` is held busy (one request in flight, one queued) while ``b`` waits for the only
    slot: after max_busy_s ``a`` yields — it stays loaded while its request runs, takes nothing
    new, /health says for whom — and once the held request ends it is evicted with its queue
    kept: ``b`` is answered first, then every queued ``a`` request, none failed."""
    pool = start_pool(
        pool={"max_loaded_models": 1, "max_busy_s": 1.0, "min_resident_s": 0.0},
        debug={"fault_injection": True},
    )
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pid_a = pool.pid("a")
    faults(c, hold={"a": True})
    order: list[str] = []
    lock = threading.Lock()

    def ask(model: str) -> int:
        status = chat(client_for(pool), model).status_code
        with lock:
            order.append(model)
        return int(status)

    asked = [in_thread(lambda: ask("a"))]
    pool.wait_for(lambda: pool.r.llen(keys.processing("a")) == 1, what="a in flight")
    asked.append(in_thread(lambda: ask("a")))
    pool.wait_for(lambda: pool.r.llen(keys.queue("a")) == 1, what="a queued")
    asked.append(in_thread(lambda: ask("b")))

    pool.wait_for(lambda: pool.r.hget(keys.model("a"), "yielding") == "b", what="a yielding")
    pool.wait_for(lambda: model_record(pool, "a")["yielding"] is not None, what="in /health")
    shown = model_record(pool, "a")["yielding"]
    assert shown["for"] == "b" and isinstance(shown["since"], float)
    assert counter(pool, metrics.YIELDS_TOTAL, model="a") == 1
    # It takes nothing new: a request that comes now waits in its queue behind the other.
    asked.append(in_thread(lambda: ask("a")))
    pool.wait_for(lambda: pool.r.llen(keys.queue("a")) == 2, what="a third request queued")
    passes = pool.coordinator.passes
    pool.wait_for(lambda: pool.coordinator.passes >= passes + 3, what="coordinator passes")
    assert pool.r.llen(keys.queue("a")) == 2 and pool.r.llen(keys.processing("a")) == 1
    assert pool.state("a") == "ready" and pool.pid("a") == pid_a, "a busy model was evicted"
    assert pool.state("b") == "unloaded" and order == []

    faults(c, hold={"a": False})
    for t, _ in asked:
        t.join(120)
    assert [out[0] for _, out in asked] == [200, 200, 200, 200]
    # The held request ends first; then b gets the slot a gave up; then a's queue its turn.
    assert order == ["a", "b", "a", "a"]
    # a's eviction was a yield; b may yield in its turn too (a has waited more than max_busy_s
    # when b takes its request, and min_resident_s is 0), whether a pass sees b busy is timing.
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="yield") >= 1
    assert loads(pool, "a") == 2 and loads(pool, "b") == 1
    assert pool.state("a") == "ready" and pool.pid("a") != pid_a
    # Loaded again, it starts not yielding.
    assert not pool.r.hexists(keys.model("a"), "yielding")
    pool.wait_for(lambda: model_record(pool, "a")["state"] == "ready", what="a ready in /health")
    assert model_record(pool, "a")["yielding"] is None


def test_clients_looping_on_one_model_do_not_starve_another(
    start_pool: Callable[..., Pool],
) -> None:
    """Two clients send requests for ``a`` back to back (so ``a`` is never idle) with one slot:
    a request for ``b`` is answered while they keep sending, and every one of theirs is
    answered too (max_busy_s set live, through the admin API)."""
    pool = start_pool(pool={"max_loaded_models": 1}, debug={"fault_injection": True})
    c = client_for(pool)
    configure(c, "pool", max_busy_s=1.0, min_resident_s=0.0)
    faults(c, token_delay_s={"a": 0.05})
    clients = Clients(pool, 2, "a")
    pool.wait_for(lambda: clients.count("a") >= 2, what="a serving", timeout=60)
    try:
        resp = chat(client_for(pool), "b")
        assert resp.status_code == 200, resp.get_json()
        during = clients.count("a")
        assert all(t.is_alive() for t in clients.threads), "a's clients stopped sending"
        # a's queued requests get their slot back: its clients are answered again.
        pool.wait_for(lambda: clients.count("a") > during, what="a served again", timeout=60)
    finally:
        answers = clients.end()
    assert {status for _, status in answers} == {200}
    assert counter(pool, metrics.YIELDS_TOTAL, model="a") >= 1
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="yield") >= 1


@pytest.mark.parametrize("per_model", [1, 2], ids=["one-client-each", "two-clients-each"])
def test_two_busy_models_take_turns_without_thrash(
    start_pool: Callable[..., Pool], per_model: int
) -> None:
    """Clients keep both ``a`` and ``b`` busy with one slot: both are served, in turns, and no
    turn is cut shorter than min_resident_s — the loads stay within what it allows. With one
    client per model its model sits idle between that client's requests (0.1 s of the client's
    own, long enough for the coordinator to see it idle): that gap must not hand the slot over,
    the model is in its turn."""
    min_resident_s = 1.5
    pool = start_pool(
        pool={"max_loaded_models": 1, "max_busy_s": 0.5, "min_resident_s": min_resident_s},
        debug={"fault_injection": True},
    )
    c = client_for(pool)
    faults(c, token_delay_s={"a": 0.05, "b": 0.05})
    started = time.monotonic()
    clients = Clients(pool, per_model, "a", "b", think_s=0.1 if per_model == 1 else 0.0)
    try:
        pool.wait_for(
            lambda: loads(pool, "a") >= 3 and loads(pool, "b") >= 3, what="turns", timeout=120
        )
    finally:
        answers = clients.end()
    elapsed = time.monotonic() - started
    assert {status for _, status in answers} == {200}
    # Each model served between the other's turns: the answers alternate in runs.
    runs = [m for i, (m, _) in enumerate(answers) if i == 0 or answers[i - 1][0] != m]
    assert len(runs) >= 4 and set(runs) == {"a", "b"}
    # Every load after the first needs a resident made to yield, never before min_resident_s.
    assert loads(pool, "a") + loads(pool, "b") <= elapsed / min_resident_s + 2
    if per_model == 2:  # never idle: every turn ends with a yield
        assert counter(pool, metrics.YIELDS_TOTAL, model="a") >= 2
        assert counter(pool, metrics.YIELDS_TOTAL, model="b") >= 2


@pytest.fixture
def box(tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path) -> Box:
    """A box on the test's Redis (emptied by ``r``) with no role running: coordinators are
    driven by hand."""
    cfg = write_config(
        tmp_path / "config.toml",
        {
            "server": {"model_dirs": [str(models_dir)]},
            "pool": {"max_loaded_models": 1},
            "models": tiny_models(models_dir),
        },
    )
    return Box(data_dir=tmp_path / "data", config_path=cfg, redis_url=redis_url, environ={})


def test_a_deposed_leaders_yield_and_resume_change_nothing(box: Box, redis_url: str) -> None:
    """Marking a model yielding (or calling it off) is a leader write like any other: fenced by
    the lease, so a leader paused past its lease that wakes up changes no key."""
    a = Coordinator(box, connect(redis_url))
    b = Coordinator(box, connect(redis_url))
    assert a.try_lead()
    a.r.hset(keys.model("a"), mapping={"state": "ready", "token": "t-a", "host": "h1"})
    a.r.hset(keys.model("b"), mapping={"state": "ready", "token": "t-b", "yielding": "c"})
    s = a.refresh_settings()
    snap = snapshot.read(a.r, s, time.time()).snap
    take_over(b, a)
    before = everything(redis_url)
    for action in (Yield("a", "t-a", "c"), Resume("b", "t-b")):
        with pytest.raises(NotLeader):
            a.effects.apply([action], snap, {}, s)
    assert everything(redis_url) == before
    # The leader's own writes go through.
    b.effects.apply([Yield("a", "t-a", "c"), Resume("b", "t-b")], snap, {}, s)
    assert b.r.hget(keys.model("a"), "yielding") == "c"
    assert not b.r.hexists(keys.model("b"), "yielding")
