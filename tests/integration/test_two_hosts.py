"""More than one host: two worker agents as separate processes on this machine, each with its own
``RESIDENCY_HOST`` (alpha, beta) and device list, one coordinator, requests through the Flask
app. Loads spread over both hosts; a host whose agent is SIGKILLed (with its model processes)
has its models reaped (``host_gone``) once its record expires, and they are served again from
the surviving host; the gone host is listed in /health until ``worker.forget_after_s``; an agent
restarted with the same id takes its host back. Assertions are on states and counts, each
reached by polling real state (the worker record's TTL is a fixed 10 s)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from flask.testing import FlaskClient

from residency import keys, metrics
from residency.box import Box, connect
from tests.conftest import OPEN_AUTH_ENV, tiny_models, write_config
from web.app import create_app

ADMIN = {"Authorization": "Bearer test-admin-key"}
# The worker record outlives its last heartbeat by keys.WORKER_TTL_S; waits are bounded well
# above it (they only bound a broken test).
WAIT_S = 120.0


def wait_for(pred: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Agents:
    """`residency worker` processes, each the leader of its own process group: its model
    processes (spawned without a session of their own) are in that group, so killing the group
    leaves nothing of the host running."""

    def __init__(self, box: Box, logs: Path) -> None:
        self.box, self.logs = box, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, host: str, devices: str, extra: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
        env |= extra or {}
        env |= {
            "RESIDENCY_REDIS_URL": str(self.box.redis_url),
            "RESIDENCY_CONFIG": str(self.box.config_path),
            "RESIDENCY_DATA_DIR": str(self.box.data_dir),
            "RESIDENCY_ADMIN_KEY": "test-admin-key",
            "RESIDENCY_HOST": host,
            "RESIDENCY_DEVICES": devices,
        }
        with (self.logs / f"agent-{host}.log").open("ab") as out:
            p = subprocess.Popen(
                [sys.executable, "-m", "residency.cli", "worker"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[host] = p
        return p

    def kill(self, host: str) -> None:
        """SIGKILL the agent and every process of its group at once (its model processes)."""
        p = self.procs[host]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)

    def stop(self, host: str) -> None:
        p = self.procs[host]
        p.terminate()
        p.wait(60)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(30)
            # Whatever is left of the group (a model process) goes too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            if p.poll() is None:
                p.wait(30)


@pytest.fixture
def box(tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path) -> Box:
    cfg = write_config(
        tmp_path / "config.toml",
        {
            "server": {"model_dirs": [str(models_dir)]},
            "pool": {"max_loaded_models": 2},
            # No warm standby processes: two agents on a small machine, and loads stay plain.
            "worker": {"standby_process": False},
            "models": tiny_models(models_dir),
            "policies": {},
        },
    )
    data = tmp_path / "data"
    data.mkdir()
    return Box(
        data_dir=data,
        config_path=cfg,
        redis_url=redis_url,
        environ={**OPEN_AUTH_ENV, "RESIDENCY_ADMIN_KEY": "test-admin-key"},
    )


@pytest.fixture
def agents(box: Box, tmp_path: Path) -> Iterator[Agents]:
    a = Agents(box, tmp_path)
    yield a
    a.close()


@pytest.fixture
def coordinator(box: Box) -> Iterator[None]:
    from coordinator.loop import Coordinator

    stop = threading.Event()
    co = Coordinator(box, connect(str(box.redis_url)), stop=stop)
    t = threading.Thread(target=co.run, name="coordinator", daemon=True)
    t.start()
    yield
    stop.set()
    t.join(30)
    assert not t.is_alive()


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie whose new parent has not reaped it yet does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def health(c: FlaskClient) -> dict[str, Any]:
    resp = c.get("/health", headers=ADMIN)
    assert resp.status_code == 200
    return resp.get_json()


def hosts_in(c: FlaskClient) -> dict[str, dict[str, Any]]:
    return {w["host"]: w for w in health(c).get("workers", [])}


def chat(c: FlaskClient, model: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return c.post("/v1/chat/completions", json=body)


def model_hash(r: redis.Redis, model: str) -> dict[str, str]:
    return dict(r.hgetall(keys.model(model)))


def test_two_hosts_spread_lose_one_and_serve_from_the_other(
    box: Box, r: redis.Redis, agents: Agents, coordinator: None
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    devs = {"alpha": f"cpu:{cores[0]}", "beta": f"cpu:{cores[-1]}"}
    if devs["alpha"] == devs["beta"]:  # one core: still two distinct device lists
        devs["beta"] = f"cpu:{cores[0]}-{cores[0]}"
    for host, dev in devs.items():
        agents.start(host, dev)
    c = create_app(box).test_client()
    wait_for(lambda: r.hexists(keys.health(), "record"), "the first health record")
    wait_for(
        lambda: {h for h, w in hosts_in(c).items() if w["alive"]} == {"alpha", "beta"},
        "both hosts alive in /health",
    )
    assert {h: w["devices"] for h, w in hosts_in(c).items()} == {
        "alpha": [devs["alpha"]],
        "beta": [devs["beta"]],
    }

    # Two models, room for both: one on each host.
    assert chat(c, "a").status_code == 200
    assert chat(c, "b").status_code == 200
    placed = {m: model_hash(r, m) for m in ("a", "b")}
    assert {m: h["state"] for m, h in placed.items()} == {"a": "ready", "b": "ready"}
    assert sorted(h["host"] for h in placed.values()) == ["alpha", "beta"]
    for h in placed.values():
        assert h["device"] == devs[h["host"]]
    victim = placed["a"]["host"]
    survivor = placed["b"]["host"]
    pid_a = int(placed["a"]["pid"])

    # The host of a dies with its model processes: nothing of it survives.
    agents.kill(victim)
    wait_for(lambda: not running(pid_a), "the model process of a gone")
    # Once its record expires, a is reaped (host_gone) and the host is listed as gone, with
    # when it was last seen (forget_after_s is 600 s by default: it stays listed).
    wait_for(
        lambda: model_hash(r, "a").get("error") == "host_gone",
        "a reaped because its host is gone",
    )
    assert model_hash(r, "a")["state"] == "unloaded"
    gone = wait_for(
        lambda: (w := hosts_in(c).get(victim)) is not None and not w["alive"] and w,
        f"{victim} listed as gone",
    )
    assert gone["last_seen"] is not None
    assert float(str(r.hget(keys.hosts_seen(), victim))) == gone["last_seen"]
    assert model_hash(r, "b")["state"] == "ready"  # the survivor's model is untouched

    # Asked for again, a is loaded on the surviving host and answers.
    resp = chat(c, "a")
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["choices"][0]["message"]["content"] is not None
    again = model_hash(r, "a")
    assert (again["state"], again["host"]) == ("ready", survivor)
    assert set(r.smembers(keys.workers())) == {"alpha", "beta"}

    # An agent restarted with the same RESIDENCY_HOST takes its host back: no new host.
    restarted = agents.start(victim, devs[victim])
    back = wait_for(
        lambda: (w := hosts_in(c).get(victim)) is not None and w["alive"] and w,
        f"{victim} alive again",
    )
    assert back["pid"] == restarted.pid
    assert set(hosts_in(c)) == {"alpha", "beta"}
    assert set(r.smembers(keys.workers())) == {"alpha", "beta"}

    # Stopped (its record goes at once) and gone longer than a lowered forget_after_s, the host
    # is forgotten: it leaves /health and the host set; the survivor stays.
    agents.stop(victim)
    wait_for(lambda: not hosts_in(c)[victim]["alive"], f"{victim} gone after its stop")
    resp = c.patch("/admin/config", json={"worker": {"forget_after_s": 2}}, headers=ADMIN)
    assert resp.status_code == 200, resp.get_json()
    wait_for(lambda: victim not in hosts_in(c), f"{victim} forgotten")
    assert set(r.smembers(keys.workers())) == {survivor}
    assert not r.hexists(keys.hosts_seen(), victim)
    assert hosts_in(c)[survivor]["alive"] is True
    assert chat(c, "b").status_code == 200


def test_a_worker_with_a_bad_residency_host_exits_naming_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
    for bad in ("has:colon", "two words", ""):
        res = subprocess.run(
            [sys.executable, "-m", "residency.cli", "worker", "--data-dir", str(tmp_path)],
            env={
                **env,
                "RESIDENCY_HOST": bad,
                "RESIDENCY_REDIS_URL": "redis://127.0.0.1:9/0",
                "RESIDENCY_DEVICES": "cpu",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 2, res.stderr
        assert "RESIDENCY_HOST" in res.stderr, res.stderr


def test_loads_go_where_the_ledger_has_room_and_a_lost_hosts_model_makes_room_elsewhere(
    tmp_path: Path, redis_url: str, r: redis.Redis, models_dir: Path
) -> None:
    from coordinator.loop import Coordinator
    from tests.integration.test_ledger import SPEC, _expected

    cfg = write_config(
        tmp_path / "ledger.toml",
        {
            "server": {"model_dirs": [str(models_dir)]},
            "pool": {"max_loaded_models": -1},  # bytes are the only limit
            "worker": {"standby_process": False},
            "models": tiny_models(models_dir, a=SPEC, b=SPEC, c=SPEC),
            "policies": {},
        },
    )
    (tmp_path / "ledger-data").mkdir()
    box = Box(
        data_dir=tmp_path / "ledger-data",
        config_path=cfg,
        redis_url=redis_url,
        environ={**OPEN_AUTH_ENV, "RESIDENCY_ADMIN_KEY": "test-admin-key"},
    )
    # alpha holds one of them, beta two (counted by estimate or measurement, each within 15%
    # of the other: 1 x 1.15 < 1.3 < 2 x 0.85 and 2 x 1.15 < 2.42 < 3 x 0.85).
    need = _expected(models_dir)
    budget = {"alpha": int(1.3 * need) >> 20, "beta": int(2.42 * need) >> 20}
    agents = Agents(box, tmp_path)
    stop = threading.Event()
    co = Coordinator(box, connect(redis_url), stop=stop)
    t = threading.Thread(target=co.run, name="coordinator", daemon=True)
    t.start()
    try:
        for host in ("alpha", "beta"):
            agents.start(host, "cpu", {"RESIDENCY_WORKER_DEVICE_BUDGET_MB": str(budget[host])})
        c = create_app(box).test_client()
        wait_for(lambda: r.hexists(keys.health(), "record"), "the first health record")
        wait_for(
            lambda: (
                {d["host"]: d["budget_bytes"] for d in health(c).get("devices", [])}
                == {h: b << 20 for h, b in budget.items()}
            ),
            "both devices' budgets in the ledger",
        )
        for m in ("a", "b", "c"):
            assert chat(c, m).status_code == 200
        where = {m: model_hash(r, m)["host"] for m in ("a", "b", "c")}
        # Each load went where it fit: one on alpha, two on beta, nothing evicted for room.
        assert sorted(where.values()) == ["alpha", "beta", "beta"]
        assert all(model_hash(r, m)["state"] == "ready" for m in where)
        # beta dies with its two models; one of them is asked for again: alpha has no room
        # until its idle resident goes, so that one is evicted by bytes and the load follows.
        on_alpha = next(m for m, h in where.items() if h == "alpha")
        lost = sorted(m for m, h in where.items() if h == "beta")
        agents.kill("beta")
        wait_for(
            lambda: all(model_hash(r, m).get("error") == "host_gone" for m in lost),
            "beta's models reaped",
        )
        assert chat(c, lost[0]).status_code == 200
        assert model_hash(r, lost[0])["host"] == "alpha"
        assert model_hash(r, on_alpha)["state"] == "unloaded"
        room = r.hget(keys.metric_counters(), f'{metrics.EVICTIONS_TOTAL}|{{"reason":"room"}}')
        assert float(str(room or 0)) == 1
    finally:
        stop.set()
        t.join(30)
        agents.close()
