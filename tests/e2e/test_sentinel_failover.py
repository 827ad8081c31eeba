"""End to end on Redis Sentinel: `residency up` on a `redis+sentinel://` URL (a primary, a replica
and three sentinels on loopback, run from the server binary the project ships), clients sending
chat completions and an admin writing config changes, then the primary is SIGKILLed.

The sentinels promote the replica and the box carries on: every request ends with a result or a
clean error (never a hang), every role reconnects (service, a leader, coordinator passes, a new
load), and no admin change that was acknowledged is lost — an admin write is answered only once
a replica holds it (503 ``not_replicated`` otherwise, shown with the replica paused and again
after the failover, before the old primary rejoins as a replica).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from residency import keys
from tests.conftest import OPEN_AUTH, tiny_models, write_config
from tests.e2e.test_up import free_port
from tests.sentinels import SentinelSet, eventually

pytestmark = pytest.mark.e2e

CLIENTS = 3
# The client's own limit: a request that hits it hung (the box's request timeout is far above
# what these tiny requests need, so a healthy box never comes near it).
CLIENT_TIMEOUT_S = 90


@dataclass
class Box:
    proc: subprocess.Popen[str]
    url: str
    admin: dict[str, str]
    lines: list[str] = field(default_factory=list)

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    s = SentinelSet(tmp_path / "redis")
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture
def box(tmp_path: Path, models_dir: Path, sentinels: SentinelSet) -> Iterator[Box]:
    port = free_port()
    cfg = write_config(
        tmp_path / "box.toml",
        {
            "server": {"port": port, "web_workers": 1, "redis_wait_ms": 1000},
            "auth": OPEN_AUTH,
            "pool": {"max_loaded_models": 1},
            "models": tiny_models(models_dir),
        },
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
    env["RESIDENCY_REDIS_URL"] = sentinels.url
    data = tmp_path / "data"
    args = ["-m", "residency.cli", "up", "--config", str(cfg), "--data-dir", str(data)]
    proc = subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "residency is up" in line:
            break
    else:
        raise AssertionError("residency up exited:\n" + "".join(lines))
    # Keep reading its output, so a full pipe never blocks it.
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    key = (data / "admin.key").read_text().strip()
    b = Box(proc, f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}, lines)
    yield b
    kids = b.descendants()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-40:])
    _gone, alive = psutil.wait_procs(kids, timeout=30)
    assert alive == [], [" ".join(p.cmdline()) for p in alive]


# --- clients ----------------------------------------------------------------------------------


def chat(box: Box, model: str, *, stream: bool = False) -> requests.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": stream,
    }
    return requests.post(
        box.url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S, stream=stream
    )


def outcome(box: Box, stream: bool) -> str:
    """What one request ended with: ``ok``; ``error:<code>`` (a JSON error envelope, or an SSE
    error event followed by the end of the stream); ``hang`` (the client's timeout); ``broken``
    (anything else: a cut connection, a truncated stream, a body that is not an answer)."""
    try:
        resp = chat(box, "a", stream=stream)
        if resp.status_code != 200:
            return "error:" + str(resp.json()["error"]["code"])
        if not stream:
            return "ok" if resp.json()["choices"] else "broken"
        data = [ln[6:] for ln in resp.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
        if not data or data[-1] != "[DONE]":
            return "broken"
        events = [json.loads(d) for d in data[:-1]]
        errs = [e["error"]["code"] for e in events if "error" in e]
        return f"error:{errs[0]}" if errs else "ok"
    except requests.Timeout:
        return "hang"
    except (requests.RequestException, ValueError, KeyError):
        return "broken"


def client_loop(box: Box, stop: threading.Event, out: list[str], i: int) -> None:
    n = 0
    while not stop.is_set():
        out.append(outcome(box, stream=(i + n) % 2 == 0))
        n += 1


def patch(box: Box, key: str, value: Any) -> requests.Response:
    section, _, name = key.partition(".")
    return requests.patch(
        box.url + "/admin/config",
        json={section: {name: value}},
        headers=box.admin,
        timeout=CLIENT_TIMEOUT_S,
    )


@dataclass
class AdminLog:
    acked: list[int] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)


def admin_loop(box: Box, stop: threading.Event, log: AdminLog) -> None:
    """Raise ``pool.max_queue_per_model`` one step at a time: every value is above the ones
    before it, so the value in force after the failover must be at least the last one that
    was acknowledged."""
    value = 1000
    while not stop.is_set():
        value += 1
        try:
            resp = patch(box, "pool.max_queue_per_model", value)
        except requests.RequestException as e:
            log.refused[type(e).__name__] += 1
            continue
        if resp.status_code == 200:
            assert resp.json()["updated"] == {"pool.max_queue_per_model": value}
            log.acked.append(value)
        else:
            log.refused[str(resp.json()["error"]["code"])] += 1
        stop.wait(0.05)


def config_value(box: Box, key: str) -> Any:
    section, _, name = key.partition(".")
    resp = requests.get(box.url + "/admin/config", headers=box.admin, timeout=10)
    assert resp.status_code == 200
    return resp.json()["config"][section][name]


def health(box: Box) -> dict[str, Any]:
    resp = requests.get(box.url + "/health", headers=box.admin, timeout=10)
    return dict(resp.json()) if resp.status_code == 200 else {}


def ready(box: Box) -> bool:
    return requests.get(box.url + "/readyz", timeout=10).status_code == 200


# --- the test ---------------------------------------------------------------------------------


def test_the_box_survives_a_sentinel_failover(box: Box, sentinels: SentinelSet) -> None:
    old_primary = sentinels.primary
    assert sentinels.primary_port() == old_primary.port
    assert chat(box, "a").status_code == 200

    # An admin write is answered only once the replica holds it: with the replica paused, 503.
    os.kill(sentinels.replica.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        resp = patch(box, "pool.max_queue_per_model", 500)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "not_replicated"
    finally:
        os.kill(sentinels.replica.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
    assert patch(box, "pool.max_queue_per_model", 600).status_code == 200

    # Traffic and admin changes flow while the primary dies.
    stop_clients, stop_admin = threading.Event(), threading.Event()
    results: list[list[str]] = [[] for _ in range(CLIENTS)]
    admin = AdminLog()
    threads = [
        threading.Thread(target=client_loop, args=(box, stop_clients, results[i], i), daemon=True)
        for i in range(CLIENTS)
    ]
    threads.append(threading.Thread(target=admin_loop, args=(box, stop_admin, admin), daemon=True))
    for t in threads:
        t.start()
    eventually(lambda: len(admin.acked) >= 3, "admin changes acknowledged before the failover")
    eventually(lambda: all(r.count("ok") >= 2 for r in results), "requests served before it")
    acked_before = len(admin.acked)
    served_before = [len(r) for r in results]

    old_primary.kill()

    # The sentinels promote the replica.
    eventually(lambda: sentinels.primary_port() == sentinels.replica.port, "the promotion")
    new_primary = sentinels.replica.client()
    assert new_primary.info("replication")["role"] == "master"
    # Every role reconnects: requests are served again, by a process that reached the new
    # primary; the coordinator leads and publishes again; the agent's heartbeat is back.
    gen_at_promotion = int(new_primary.hget(keys.health(), "generation") or 0)
    eventually(
        lambda: all(
            len(r) > n + 2 and r[-1] == "ok" for r, n in zip(results, served_before, strict=True)
        ),
        "requests served after the failover",
        detail=lambda: ([r[-8:] for r in results], "".join(box.lines[-60:])),
    )
    eventually(lambda: ready(box), "a leader and a live agent (readyz)")
    stop_clients.set()
    stop_admin.set()
    for t in threads:
        t.join(CLIENT_TIMEOUT_S + 10)
        assert not t.is_alive()

    # Every request ended with a result or a clean error (a JSON error envelope, or an SSE
    # error event and the end of the stream); none hung, none was cut off.
    counts = Counter(o for r in results for o in r)
    assert counts["hang"] == 0 and counts["broken"] == 0, counts
    assert counts["ok"] > sum(served_before), counts

    # No acknowledged admin change is lost: the value in force is at least the last one
    # acknowledged (a later one may have landed without its answer: the value only grows).
    in_force = config_value(box, "pool.max_queue_per_model")
    assert admin.acked[acked_before - 1] <= admin.acked[-1] <= in_force, (in_force, admin)
    # No replica now: an admin write cannot be promised to survive a failover, and is refused.
    refused = patch(box, "pool.max_queue_per_model", in_force + 1)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_replicated"

    # The coordinator keeps deciding: a model never loaded before is loaded (evicting "a"),
    # in a pass stamped after the promotion, published by a leader.
    resp = chat(box, "b")
    assert resp.status_code == 200, resp.text
    assert int(new_primary.hget(keys.health(), "generation") or 0) > gen_at_promotion
    assert health(box)["leader"]["id"]

    # The old primary comes back as it would after a crash (thinking it is the primary); the
    # sentinels make it a replica of the new one, and admin changes are acknowledged again.
    old_primary.args = ()
    old_primary.start()
    eventually(
        lambda: (
            old_primary.client().info("replication").get("master_link_status") == "up"
            and int(old_primary.client().info("replication")["master_port"])
            == sentinels.replica.port
        ),
        "the old primary to rejoin as a replica",
    )
    value = in_force + 2
    resp = patch(box, "pool.max_queue_per_model", value)
    assert resp.status_code == 200, resp.text
    assert config_value(box, "pool.max_queue_per_model") == value
    # Acknowledged means the replica holds it.
    assert old_primary.client().hget(keys.config_admin(), "pool.max_queue_per_model") == str(value)
