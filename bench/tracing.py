"""What tracing costs a request: three boxes (``residency up``) on the same tiny model, one with
no ``OTEL_*`` variables at all (the baseline), one with ``OTEL_*`` variables but no endpoint
(tracing off), one exporting to a local OTLP/HTTP receiver that discards what it gets (tracing
on, every request sampled). Requests go to the three in turn, in a shuffled order each round,
one at a time; the figure is the median of each round's difference from the baseline, with a
bootstrap 95% interval. Targets: on adds at most 0.5 ms at the median; off adds nothing
measurable (its interval holds 0).

    .venv/bin/python -m bench.tracing [--rounds N] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests

from bench.overhead import ROOT, cleanup, free_port, replace_section, stop, wait_for
from residency import procs
from residency.tinymodel import write_tiny_model

BEGIN = "<!-- tracing:begin -->"
END = "<!-- tracing:end -->"
TARGET_ON_MS = 0.5
BODY = {"model": "t", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


class Discard:
    """An OTLP/HTTP receiver that reads each export and answers 200 (counts them)."""

    def __init__(self) -> None:
        self.posts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.posts += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def box(
    name: str, tmp: Path, model: Path, otel: dict[str, str], stack: contextlib.ExitStack
) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import write_config

    port = free_port()
    cfg = write_config(
        tmp / f"{name}.toml",
        {
            "server": {"port": port, "web_workers": 1},
            "auth": {"required": False},
            "models": {"t": {"path": str(model), "n_ctx": 256, "parallel": 1}},
        },
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RESIDENCY_") and not k.startswith("OTEL_")
    }
    env.update(otel)
    log = tmp / f"{name}.log"
    args = ["-m", "residency.cli", "up", "--config", str(cfg), "--data-dir", str(tmp / name)]
    with log.open("ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=procs.die_with_parent(),
        )
    stack.callback(stop, proc)
    wait_for(proc, log, lambda: "residency is up" in log.read_text(errors="replace"), name)
    return f"http://127.0.0.1:{port}/v1/chat/completions"


def timed(session: requests.Session, url: str) -> float:
    t0 = time.perf_counter()
    resp = session.post(url, json=BODY, timeout=60)
    took = time.perf_counter() - t0
    resp.raise_for_status()
    return took * 1000.0


def run(rounds: int, tmp: Path, stack: contextlib.ExitStack) -> tuple[str, bool]:
    model = write_tiny_model(tmp / "tiny.gguf")
    sink = Discard()
    stack.callback(sink.close)
    boxes = {
        "baseline (no OTEL_*)": {},
        "off (OTEL_* without an endpoint)": {
            "OTEL_SERVICE_NAME": "bench",
            "OTEL_TRACES_SAMPLER": "always_on",
        },
        "on (exporting, all sampled)": {
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
            "OTEL_TRACES_SAMPLER": "always_on",
        },
    }
    urls = {
        name: box(f"box{i}", tmp, model, env, stack) for i, (name, env) in enumerate(boxes.items())
    }
    sessions = {name: requests.Session() for name in urls}
    for name, url in urls.items():  # the first request loads the model
        for _ in range(5):
            timed(sessions[name], url)
    samples: dict[str, list[float]] = {name: [] for name in urls}
    rng = random.Random(0)
    names = list(urls)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            samples[name].append(timed(sessions[name], urls[name]))
    base_name = next(iter(urls))
    rows = [
        "| box | median ms | p90 ms | added: median of per-round differences (95% interval) |",
        "|---|---|---|---|",
    ]
    added: dict[str, float] = {}
    spans: dict[str, tuple[float, float]] = {}
    for name, xs in samples.items():
        med = statistics.median(xs)
        p90 = sorted(xs)[int(0.9 * (len(xs) - 1))]
        # Paired within a round (the same moment's load on the machine): steadier than the
        # difference of two medians on a shared machine.
        diffs = [x - b for x, b in zip(xs, samples[base_name], strict=True)]
        added[name] = statistics.median(diffs)
        spans[name] = interval(diffs, rng)
        lo, hi = spans[name]
        rows.append(
            f"| {name} | {med:.2f} | {p90:.2f} | {added[name]:+.2f} ms ({lo:+.2f} … {hi:+.2f}) |"
        )
    on_name, off_name = names_of(urls)
    on_ok = added[on_name] <= TARGET_ON_MS
    off_ok = spans[off_name][0] <= 0.0 <= spans[off_name][1]
    verdicts = [
        f"- on: {added[on_name]:+.2f} ms at the median (target ≤ {TARGET_ON_MS} ms): "
        + ("met" if on_ok else "MISSED"),
        f"- off: {added[off_name]:+.2f} ms, interval "
        f"{spans[off_name][0]:+.2f} … {spans[off_name][1]:+.2f} ms: "
        + ("unchanged (holds 0)" if off_ok else "MISSED (0 outside it)"),
        f"- the receiver took {sink.posts} exports",
    ]
    head = (
        f"{rounds} rounds of one non-stream chat request (max_tokens 1, tiny model, one slot) to "
        f"each box in a shuffled order, one at a time; {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}."
    )
    return "\n".join([head, "", *rows, "", *verdicts]), on_ok and off_ok


def interval(diffs: list[float], rng: random.Random, n: int = 1000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median of ``diffs``."""
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def names_of(urls: dict[str, str]) -> tuple[str, str]:
    names = list(urls)
    return names[2], names[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--out", type=Path, help="markdown file whose tracing section is rewritten")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="residency-bench-") as tmp, cleanup() as stack:
        body, ok = run(args.rounds, Path(tmp), stack)
    print(body)
    if args.out is not None:
        replace_section(args.out, body, begin=BEGIN, end=END, title="Tracing")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
