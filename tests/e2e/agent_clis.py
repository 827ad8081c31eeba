"""The coding agents the box is checked against — OpenAI's Codex CLI (``codex exec``) and
Anthropic's Claude Code (``claude -p``) — installed from npm into a cache folder outside the
repository, each run in a temporary home and work directory and configured with nothing but a
base URL and an API key; and a recording reverse proxy that shows what they send.

Used by tests/e2e/test_coding_agents.py and bench/coding_agents.py.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

# The versions these tests were written against (both move fast: a new one may send new
# fields, which is what the tests are for, but on purpose).
CODEX_PACKAGE = "@openai/codex"
CODEX_VERSION = "0.171.0"
CLAUDE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_VERSION = "2.1.332"
#: The variable Codex reads the key from (its provider's ``env_key``).
CODEX_KEY_ENV = "RESIDENCY_API_KEY"


def npm_prefix() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "residency" / "npm"


@dataclass(frozen=True)
class Agents:
    codex: list[str]  # the command line that runs each (before its own arguments)
    claude: list[str]


def _installed(prefix: Path, package: str, version: str) -> bool:
    manifest = prefix / "node_modules" / package / "package.json"
    try:
        return bool(json.loads(manifest.read_text())["version"] == version)
    except (OSError, ValueError, KeyError):
        return False


def install(prefix: Path | None = None) -> Agents:
    """Both agents at the pinned versions (npm install once; reused while the versions match).
    Raises RuntimeError naming what failed."""
    prefix = prefix or npm_prefix()
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError("npm is not installed")
    wanted = [(CODEX_PACKAGE, CODEX_VERSION), (CLAUDE_PACKAGE, CLAUDE_VERSION)]
    if not all(_installed(prefix, p, v) for p, v in wanted):
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [npm, "install", "--prefix", str(prefix), "--no-fund", "--no-audit", "--no-save"]
            + [f"{p}@{v}" for p, v in wanted],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode != 0:
            raise RuntimeError(f"npm install failed ({done.returncode}):\n{done.stderr[-4000:]}")
    bin_dir = prefix / "node_modules" / ".bin"
    claude = [str(bin_dir / "claude")]
    # Claude Code's postinstall copies its native binary over a stub; where npm ran no install
    # scripts, its wrapper finds the same binary.
    if not _runs([*claude, "--version"]):
        wrapper = prefix / "node_modules" / CLAUDE_PACKAGE / "cli-wrapper.cjs"
        claude = [shutil.which("node") or "node", str(wrapper)]
    agents = Agents(codex=[str(bin_dir / "codex")], claude=claude)
    for name, cmd in (("codex", agents.codex), ("claude", agents.claude)):
        if not _runs([*cmd, "--version"]):
            raise RuntimeError(f"{name} does not run: {cmd}")
    return agents


def _runs(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _base_env(home: Path) -> dict[str, str]:
    """A clean environment: nothing of ours (no other keys, no RESIDENCY_*), a temporary home."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }


def codex_command(
    agents: Agents, base_url: str, key: str, model: str, prompt: str, home: Path, work: Path
) -> tuple[list[str], dict[str, str]]:
    """``codex exec`` on a custom provider: the box's Responses API at ``base_url`` (no /v1),
    the key in ``CODEX_KEY_ENV``. No retries (a refusal shows at once), no analytics or update
    checks (no network beyond the box). Codex's own sandbox is bypassed: it runs in ``work``,
    a temporary directory, and a container may not allow the user namespaces it needs."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    config = {
        "model_provider": '"residency"',
        "model_providers.residency.name": '"residency"',
        "model_providers.residency.base_url": json.dumps(base_url + "/v1"),
        "model_providers.residency.env_key": json.dumps(CODEX_KEY_ENV),
        "model_providers.residency.wire_api": '"responses"',
        "model_providers.residency.request_max_retries": "0",
        "model_providers.residency.stream_max_retries": "0",
        "analytics.enabled": "false",
        "check_for_update_on_startup": "false",
    }
    argv = [*agents.codex, "exec", "--skip-git-repo-check", "--ephemeral", "-C", str(work)]
    argv += ["--dangerously-bypass-approvals-and-sandbox", "-m", model, "--color", "never"]
    argv += ["-o", str(home / "last-message.txt")]
    for k, v in config.items():
        argv += ["-c", f"{k}={v}"]
    argv += ["--", prompt]
    env = _base_env(home) | {"CODEX_HOME": str(codex_home), CODEX_KEY_ENV: key}
    return argv, env


def claude_command(
    agents: Agents, base_url: str, key: str, model: str, prompt: str, home: Path
) -> tuple[list[str], dict[str, str]]:
    """``claude -p`` against the box's Messages API at ``base_url``, the key as
    ``ANTHROPIC_API_KEY``; every background model is the same one; no telemetry, error
    reports, update checks or other non-essential traffic; Bash allowed without asking."""
    argv = [*agents.claude, "-p", "--model", model, "--allowedTools", "Bash", "--", prompt]
    env = _base_env(home) | {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }
    return argv, env


@dataclass
class Exchange:
    """One request through the proxy: what was sent, the status, and when (monotonic): sent,
    the reply's first body bytes, its end, and each body chunk as it was relayed."""

    method: str
    path: str
    body: Any
    status: int = 0
    reply: bytes = b""
    sent: float = 0.0
    first_byte: float = 0.0
    done: float = 0.0
    chunks: list[tuple[float, bytes]] = field(default_factory=list)


@dataclass
class Recorder:
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


# Hop-by-hop headers (and the ones the proxy sets itself) are not passed on.
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "date"}
_HOP |= {"server", "accept-encoding", "content-encoding"}


def _handler(rec: Recorder) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
            ex = Exchange(self.command, self.path, body, sent=time.monotonic())
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            try:
                up = requests.request(
                    self.command,
                    rec.upstream + self.path,
                    data=raw or None,
                    headers=headers,
                    stream=True,
                    timeout=900,
                )
            except requests.RequestException as e:
                ex.status, ex.done = 502, time.monotonic()
                with rec.lock:
                    rec.exchanges.append(ex)
                self.send_error(502, repr(e))
                return
            ex.status = up.status_code
            self.send_response(up.status_code)
            for k, v in up.headers.items():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            got = bytearray()
            # Relayed as it comes (a stream's events are timed as the client sees them).
            for chunk in up.raw.stream(8192, decode_content=True):
                if not chunk:
                    continue
                now = time.monotonic()
                if not got:
                    ex.first_byte = now
                ex.chunks.append((now, chunk))
                got += chunk
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            ex.done = time.monotonic()
            ex.reply = bytes(got)
            with rec.lock:
                rec.exchanges.append(ex)

        do_GET = do_POST = do_PUT = do_DELETE = _relay

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def recording_proxy(upstream: str) -> Iterator[tuple[str, Recorder]]:
    """A reverse proxy to ``upstream`` on a free loopback port: (its base URL, the record)."""
    rec = Recorder(upstream.rstrip("/"))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(rec))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", rec
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


def run(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
