"""End to end: parts of a running `residency up` are SIGKILLed — the coordinator leader, the
embedded Redis server, the agent — and the box carries on: the standby coordinator takes over,
the supervisor restarts what died, every role reconnects, and requests are served again."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import redis
import requests

from residency import keys
from tests.e2e.test_up import Up

pytestmark = pytest.mark.e2e


@pytest.fixture
def up(tmp_path: Path, models_dir: Path) -> Iterator[Up]:
    box = Up(tmp_path, models_dir)
    yield box
    kids = box.descendants()
    if box.proc.poll() is None:
        box.proc.send_signal(signal.SIGTERM)
        assert box.proc.wait(60) == 0
    _gone, alive = psutil.wait_procs(kids, timeout=30)
    assert alive == [], [" ".join(p.cmdline()) for p in alive]


def roles(up: Up, *words: str) -> list[psutil.Process]:
    out = []
    for p in up.descendants():
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if all(w in cmd for w in words):
            out.append(p)
    return out


def client(up: Up) -> redis.Redis:
    return redis.Redis(
        unix_socket_path=str(up.data / "redis" / "redis.sock"),
        decode_responses=True,
        socket_timeout=2,
    )


def chat_ok(up: Up, model: str = "a") -> bool:
    try:
        resp = requests.post(
            up.url + "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            timeout=30,
        )
    except requests.RequestException:
        return False
    return resp.status_code == 200


def eventually(pred: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll real state; the timeout only bounds a broken test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def leader_pid(r: redis.Redis) -> int:
    record = json.loads(str(r.hget(keys.health(), "record") or "{}"))
    return int(str(record["leader"]["id"]).rsplit(":", 1)[1])


def test_up_runs_a_standby_coordinator_that_takes_over(up: Up) -> None:
    coords = roles(up, "residency.cli", "coordinator")
    assert len(coords) == 2
    r = client(up)
    token = r.get(keys.leader())
    epoch = int(r.get(keys.leader_epoch()) or 0)
    pid = leader_pid(r)
    assert token and pid in {p.pid for p in coords}
    psutil.Process(pid).kill()
    # The standby takes the lease (a new epoch), the supervisor starts a new standby.
    eventually(lambda: r.get(keys.leader()) not in (None, token), "the standby to take over")
    assert int(r.get(keys.leader_epoch()) or 0) == epoch + 1
    eventually(lambda: leader_pid(r) not in (pid,), "a record published by the new leader")
    eventually(lambda: len(roles(up, "residency.cli", "coordinator")) == 2, "two coordinators")
    assert chat_ok(up, "b")


def test_a_killed_redis_is_restarted_and_the_box_carries_on(up: Up) -> None:
    assert chat_ok(up)
    r = client(up)
    pid_a = int(r.hget(keys.model("a"), "pid") or 0)
    assert pid_a
    servers = [p for p in up.descendants() if "valkey" in p.name() or "redis" in p.name()]
    assert len(servers) == 1
    servers[0].kill()
    eventually(lambda: bool(client(up).ping()), "the supervisor to restart Redis")
    eventually(lambda: chat_ok(up), "service after the Redis restart")
    # The resident kept its process (no double load, no ghost), and the roles are the same.
    assert int(client(up).hget(keys.model("a"), "pid") or 0) == pid_a
    assert psutil.pid_exists(pid_a)
    assert len(roles(up, "residency.cli", "coordinator")) == 2
    assert len(roles(up, "workers.model_process", "--command")) <= 1
