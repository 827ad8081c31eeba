"""The web tier under a thousand waiting clients, end to end: `residency up` with its default
gunicorn gevent workers, a model held busy (the ``hold`` fault), 1,000 streaming requests
waiting in its queue on their own connections — and the probes, the admin API and a new
request still answered; every waiting stream gets keep-alive comments; and when the clients
leave, their requests leave the queue.

Nothing here asserts a time: the probes and the admin call must answer (a timeout only bounds
a broken test); their latency under this load is measured by bench/load.py."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import requests

from tests.conftest import OPEN_AUTH, tiny_models, write_config

pytestmark = pytest.mark.e2e

CLIENTS = 1000
BOUND_S = 180.0  # bounds a broken test only


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Box:
    """`residency up` on a free port; ``server`` and ``pool``: settings of those sections
    (default: this file's, a thousand clients' worth of queue and two models)."""

    def __init__(
        self,
        tmp: Path,
        models_dir: Path,
        server: dict[str, Any] | None = None,
        pool: dict[str, Any] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data = tmp / "data"
        cfg = write_config(
            tmp / "box.toml",
            {
                "server": {"port": self.port, **(server or {"sse_keepalive_s": 0.5})},
                "auth": OPEN_AUTH,
                "pool": pool or {"max_queue_per_model": CLIENTS + 10, "max_loaded_models": 2},
                "debug": {"fault_injection": True},
                "models": tiny_models(models_dir),
            },
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
        self.log = tmp / "up.log"
        with self.log.open("wb") as out:
            args = ["up", "--config", str(cfg), "--data-dir", str(data)]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "residency.cli", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for(lambda: "residency is up" in self.log.read_text(errors="replace"), "the box")
        self.admin = {"Authorization": f"Bearer {(data / 'admin.key').read_text().strip()}"}

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kw)

    def model(self, name: str) -> dict[str, Any]:
        [m] = [m for m in self.get("/health").json()["models"] if m["name"] == name]
        return dict(m)

    def faults(self, **body: Any) -> None:
        r = requests.post(self.url + "/admin/faults", json=body, headers=self.admin, timeout=30)
        assert r.status_code == 200, r.text

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def box(tmp_path: Path, models_dir: Path) -> Iterator[Box]:
    b = Box(tmp_path, models_dir)
    yield b
    b.stop()


def open_streams(port: int, n: int) -> list[socket.socket]:
    body = json.dumps(
        {
            "model": "a",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(head + body)
        out.append(s)
    return out


def read_keepalives(conns: list[socket.socket]) -> dict[socket.socket, bytes]:
    """Read every connection until each has shown a keep-alive comment."""
    got = {c: b"" for c in conns}
    sel = selectors.DefaultSelector()
    for c in conns:
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)
    pending = set(conns)
    deadline = time.monotonic() + BOUND_S
    while pending and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1):
            c = cast(socket.socket, key.fileobj)
            data = c.recv(65536)
            assert data, "a waiting stream was closed"
            got[c] += data
            if b": keep-alive\n\n" in got[c]:
                pending.discard(c)
                sel.unregister(c)
    sel.close()
    assert not pending, f"{len(pending)} streams got no keep-alive"
    return got


def test_a_thousand_waiting_streams_leave_probes_admin_and_new_requests_answered(
    box: Box,
) -> None:
    ok = requests.post(
        box.url + "/v1/chat/completions",
        json={"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    box.faults(hold={"a": True})
    conns = open_streams(box.port, CLIENTS)
    try:
        wait_for(
            lambda: (m := box.model("a"))["queued"] + m["in_flight"] == CLIENTS,
            "every request waiting",
        )
        # Every one of them holds an open stream that the server keeps alive.
        streams = read_keepalives(conns)
        assert all(v.startswith(b"HTTP/1.1 200") for v in streams.values())
        # With all of them waiting: the probes, the admin API and another model (loaded into the
        # second slot) answer.
        assert box.get("/livez").status_code == 200
        assert box.get("/readyz").status_code == 200
        patched = requests.patch(
            box.url + "/admin/config",
            json={"server": {"request_timeout_s": 300}},
            headers=box.admin,
            timeout=30,
        )
        assert patched.status_code == 200, patched.text
        other = requests.post(
            box.url + "/v1/completions",
            json={"model": "b", "prompt": "x", "max_tokens": 2},
            timeout=60,
        )
        assert other.status_code == 200, other.text
    finally:
        for c in conns:
            c.close()
    # The clients left: web withdraws every request still queued.
    wait_for(lambda: box.model("a")["queued"] == 0, "the queue emptied")
    box.faults(hold={"a": False})
    wait_for(lambda: box.model("a")["in_flight"] == 0, "the held request ended")
