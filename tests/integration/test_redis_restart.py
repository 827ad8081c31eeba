"""A Redis restart (SIGKILL of the server, then a start on the same AOF) under a running pool:
every role reconnects instead of exiting, a resident model keeps its process (no double load,
no ghost resident), and a request accepted before the outage is still answered.

These tests get a Redis server of their own (AOF on), since they kill it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from residency import keys
from residency.redis_server import EmbeddedRedis
from tests.conftest import Pool
from web.app import create_app

ADMIN = {"Authorization": "Bearer test-admin-key"}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "redis-aof", appendonly=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """Overrides the suite's shared server for this module."""
    return redis_server.url


def chat(c: FlaskClient, model: str, **kw: Any) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    return c.post("/v1/chat/completions", json=body)


def restart(server: EmbeddedRedis) -> None:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    server.start()


def test_a_redis_restart_keeps_every_resident_and_its_process(
    start_pool: Callable[..., Pool], redis_server: EmbeddedRedis
) -> None:
    pool = start_pool(pool={"max_loaded_models": 2})
    c = create_app(pool.box).test_client()
    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    assert pid
    restart(redis_server)
    # Every role reconnects by itself; the next request is served by the same process.
    pool.wait_for(lambda: _ok(c, "a"), timeout=60, what="service after the restart")
    assert pool.pid("a") == pid
    os.kill(pid, 0)  # still running
    assert pool.resident() == {"a"}
    # The agent's heartbeat and the coordinator's passes resumed.
    pool.wait_for(lambda: bool(pool.r.exists(keys.worker("testhost"))), what="heartbeat")
    gen = int(pool.r.hget(keys.health(), "generation") or 0)
    pool.wait_for(
        lambda: int(pool.r.hget(keys.health(), "generation") or 0) > gen,
        what="a coordinator pass after the restart",
    )


def test_a_request_queued_before_a_restart_is_answered_after_it(
    start_pool: Callable[..., Pool], redis_server: EmbeddedRedis
) -> None:
    pool = start_pool(pool={"max_loaded_models": 2}, debug={"fault_injection": True})
    c = create_app(pool.box).test_client()
    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    c.post("/admin/faults", json={"hold": {"a": True}}, headers=ADMIN)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(chat(c, "a")), daemon=True)
    t.start()
    pool.wait_for(lambda: pool.r.llen(keys.processing("a")) == 1, what="a request in flight")
    restart(redis_server)
    pool.wait_for(lambda: _try_hdel_hold(pool), timeout=60, what="Redis back")
    t.join(90)
    assert out, "the request was never answered"
    # Answered once: a result, or a clean error naming the outage (its reader lost Redis).
    resp = out[0]
    assert resp.status_code in (200, 503), resp.get_json()
    if resp.status_code == 503:
        assert resp.get_json()["error"]["code"] in ("redis_unavailable", "not_ready")
        assert resp.headers.get("Retry-After")
    pool.wait_for(lambda: pool.r.llen(keys.processing("a")) == 0, what="nothing left in flight")
    assert pool.pid("a") == pid


def _ok(c: FlaskClient, model: str) -> bool:
    try:
        return bool(chat(c, model).status_code == 200)
    except Exception:
        return False


def _try_hdel_hold(pool: Pool) -> bool:
    try:
        pool.r.hdel(keys.faults(), "hold:a")
        return True
    except Exception:
        return False


def test_a_request_left_on_a_live_processs_list_is_handed_back(
    start_pool: Callable[..., Pool],
) -> None:
    """A Redis killed between fsyncs comes back from an older state: a request whose finish was
    lost sits on the processing list of a model process that is alive and serves nothing of
    it. Nothing else takes it off (the agent hands back only a dead process's list): the
    process hands it back itself — requeued, served, and the list is empty again; the process
    lives on."""
    from residency.messages import Kind, Request, new_request_id

    pool = start_pool()
    c = create_app(pool.box).test_client()
    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    assert pool.r.llen(keys.processing("a")) == 0
    # What the older state brings back: a request "in flight" that no thread of it serves.
    orphan = Request(
        new_request_id(),
        Kind.CHAT,
        "a",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        False,
        0.0,
    )
    pool.r.lpush(keys.processing("a"), orphan.dumps())
    pool.wait_for(lambda: pool.r.llen(keys.processing("a")) == 0, what="orphan handed back")
    # Requeued (it had no output) and served: its reply is complete.
    pool.wait_for(
        lambda: any(f.get("t") == "done" for _, f in pool.r.xrange(keys.reply(orphan.id))),
        what="the orphan served",
    )
    assert pool.pid("a") == pid and pool.state("a") == "ready"
