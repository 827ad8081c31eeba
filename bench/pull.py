"""Pull throughput: the agent's download path (``workers.pull``: read, write, sha256, progress
written to Redis every 0.25 s) against ``curl -o`` of the same file from the same local server.

The file is a tiny GGUF model padded with random bytes to ~200 MB, served by a small HTTP
server that sends it with ``sendfile`` (so neither client waits on the server). Runs are
interleaved (curl, pull, curl, pull, ...) so background load on a shared machine hits both
alike; the medians and their ratio are printed (target: pull >= 0.9 x curl) and written to a
markdown section with ``--out``. Registration is not part of it (the tests check that).

    .venv/bin/python bench/pull.py [--runs 5] [--mb 200] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.overhead import replace_section
from residency import pull_store
from residency.box import Box, connect
from residency.redis_server import EmbeddedRedis
from residency.tinymodel import write_tiny_model
from workers.pull import PullRunner

BEGIN = "<!-- pull:begin -->"
END = "<!-- pull:end -->"
TARGET = 0.9


def make_file(path: Path, mb: int) -> str:
    """A tiny model padded with random bytes to ``mb`` MiB; its sha256."""
    write_tiny_model(path, seed=1)
    digest = hashlib.sha256(path.read_bytes())
    with path.open("ab") as f:
        left = (mb << 20) - path.stat().st_size
        while left > 0:
            block = os.urandom(min(left, 8 << 20))
            f.write(block)
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def serve(path: Path) -> tuple[ThreadingHTTPServer, str]:
    size = path.stat().st_size

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()

        def do_GET(self) -> None:
            self.do_HEAD()
            self.wfile.flush()
            with path.open("rb") as f:
                self.connection.sendfile(f)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}/model.gguf"


def time_curl(url: str, out: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["curl", "-sf", "-o", str(out), url], check=True)
    dt = time.perf_counter() - t0
    out.unlink()
    return dt


def time_pull(runner: PullRunner, url: str, out: Path, size: int, sha: str) -> float:
    pull_id = pull_store.new_id()
    runner.r.hset(f"rsd:pull:{pull_id}", mapping={"id": pull_id, "state": "downloading"})
    t0 = time.perf_counter()
    runner._download(pull_id, url, out, size, sha, 0, size)
    dt = time.perf_counter() - t0
    out.unlink()
    return dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = tmp / "model.gguf"
        sha = make_file(src, args.mb)
        size = src.stat().st_size
        srv, url = serve(src)
        redis_srv = EmbeddedRedis(tmp / "redis", appendonly=False)
        r = connect(redis_srv.start())
        box = Box(data_dir=tmp / "data", config_path=None, redis_url=None, environ={})
        runner = PullRunner(box, r, "bench", threading.Event())
        curl_s: list[float] = []
        pull_s: list[float] = []
        try:
            time_curl(url, tmp / "warm.gguf")  # page cache warm for both
            for i in range(args.runs):
                curl_s.append(time_curl(url, tmp / "c.gguf"))
                pull_s.append(time_pull(runner, url, tmp / "p.gguf", size, sha))
                print(f"run {i + 1}: curl {curl_s[-1]:.3f}s  pull {pull_s[-1]:.3f}s", flush=True)
        finally:
            srv.shutdown()
            r.close()
            redis_srv.stop()
    mib = size / (1 << 20)
    curl_rate = mib / statistics.median(curl_s)
    pull_rate = mib / statistics.median(pull_s)
    ratio = pull_rate / curl_rate
    verdict = "met" if ratio >= TARGET else f"MISSED (target {TARGET}x)"
    summary = (
        f"curl {curl_rate:.0f} MiB/s, pull {pull_rate:.0f} MiB/s (with sha256): "
        f"ratio {ratio:.2f} — {verdict}"
    )
    print(summary)
    if args.out:
        body = "\n".join(
            [
                f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores (shared), "
                f"a {mib:.0f} MiB file from a local HTTP server (sendfile), {args.runs} "
                "interleaved runs each, medians:",
                "",
                "| client | MiB/s | median s |",
                "|---|---|---|",
                f"| `curl -o` | {curl_rate:.0f} | {statistics.median(curl_s):.3f} |",
                f"| pull (`workers.pull`, sha256, progress) | {pull_rate:.0f} | "
                f"{statistics.median(pull_s):.3f} |",
                "",
                f"Ratio pull / curl: **{ratio:.2f}** (target ≥ {TARGET}): {verdict}.",
                "",
                "Written by `bench/pull.py`.",
            ]
        )
        replace_section(args.out, body, begin=BEGIN, end=END, title="Model pulls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
