"""A Redis Sentinel deployment on loopback for tests: a primary, one replica and three sentinels
(quorum 2, ``down-after-milliseconds`` 1000), all run from the server binary the project ships
(``valkey-server``; ``--sentinel`` makes it a sentinel)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import requests

from residency.redis_server import find_binary
from tests.e2e.test_up import free_port

SERVICE = "main"


def eventually(
    pred: Callable[[], bool], what: str, timeout: float = 90, detail: Callable[[], Any] = str
) -> None:
    """Poll real state; the timeout only bounds a broken test (``detail`` says what was seen)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (redis.RedisError, OSError, requests.RequestException):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {detail()}")


class Node:
    """One server process (data node or sentinel) on a loopback port."""

    def __init__(self, directory: Path, port: int, *args: str, sentinel: bool = False) -> None:
        self.dir = directory
        self.port = port
        self.args = args
        self.sentinel = sentinel
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        base = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        base += ["--daemonize", "no", "--logfile", str(self.dir / "server.log")]
        if self.sentinel:
            conf = self.dir / "sentinel.conf"
            if not conf.exists():  # a sentinel rewrites its file: keep what it learned
                conf.write_text("\n".join(self.args) + "\n")
            cmd = [find_binary(), str(conf), "--sentinel", *base]
        else:
            cmd = [find_binary(), *base, "--appendonly", "yes", "--save", "", *self.args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        eventually(lambda: bool(self.client().ping()), f"server on port {self.port}", 30)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused one must see its SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


class SentinelSet:
    """A primary, one replica and three sentinels (quorum 2) watching them as ``SERVICE``."""

    def __init__(self, tmp: Path) -> None:
        p_port, r_port = free_port(), free_port()
        self.primary = Node(tmp / "primary", p_port)
        self.replica = Node(tmp / "replica", r_port, "--replicaof", "127.0.0.1", str(p_port))
        conf = [
            f"sentinel monitor {SERVICE} 127.0.0.1 {p_port} 2",
            f"sentinel down-after-milliseconds {SERVICE} 1000",
            f"sentinel failover-timeout {SERVICE} 5000",
            f"sentinel parallel-syncs {SERVICE} 1",
        ]
        self.sentinels = [
            Node(tmp / f"sentinel{i}", free_port(), *conf, sentinel=True) for i in range(3)
        ]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> None:
        self.primary.start()
        self.replica.start()
        for s in self.sentinels:
            s.start()
        # Failover needs every sentinel to know the replica and the other two sentinels.
        eventually(self._watched, "the sentinels to see the replica and each other", 60)

    def _watched(self) -> bool:
        for s in self.sentinels:
            m = s.client().sentinel_master(SERVICE)
            if m["num-slaves"] < 1 or m["num-other-sentinels"] < 2:
                return False
        info = self.replica.client().info("replication")
        return bool(info.get("master_link_status") == "up")

    def primary_port(self) -> int:
        """The primary every sentinel names (0 while they disagree)."""
        ports = {
            int(s.client().sentinel_get_master_addr_by_name(SERVICE)[1]) for s in self.sentinels
        }
        return ports.pop() if len(ports) == 1 else 0

    def stop(self) -> None:
        for n in [*self.sentinels, self.replica, self.primary]:
            n.stop()
