"""The web tier under waiting clients: `/readyz` and `PATCH /admin/config` latency with 0, 100
and 1,000 streaming clients waiting in a model's queue (the model held busy by the ``hold``
fault), for each gunicorn worker class — gevent (the default) and gthread (2 workers x 16
threads: what the box ran before).

Each waiting client is a raw socket that sent a streamed chat request and reads nothing; the
probes come from one more client, one at a time. Medians and p99 over ``--probes`` calls.

    .venv/bin/python bench/webtier.py [--clients 0,100,1000] [--probes 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
from overhead import (
    ROOT,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    replace_section,
    up_box,
)

BEGIN = "<!-- webtier:begin -->"
END = "<!-- webtier:end -->"
CLIENTS = (0, 100, 1000)
PROBE_TIMEOUT_S = 20.0


def waiting(url: str) -> int:
    [m] = [
        m for m in requests.get(url + "/health", timeout=60).json()["models"] if m["name"] == "a"
    ]
    return int(m["queued"]) + int(m["in_flight"])


def probe(fn: object, n: int) -> tuple[float, float, int]:
    """Median and p99 latency in ms of ``n`` calls, and how many failed or timed out (after
    three failures it stops: a frozen server would take a timeout per call)."""
    times, failed = [], 0
    for _ in range(n):
        if failed >= 3:
            break
        t0 = time.perf_counter()
        try:
            ok = fn()  # type: ignore[operator]
        except requests.RequestException:
            ok = False
        times.append((time.perf_counter() - t0) * 1000)
        failed += not ok
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))], failed


def run_class(worker_class: str, clients: list[int], probes: int, tmp: Path) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from residency.tinymodel import write_tiny_model
    from tests.conftest import write_config
    from tests.e2e.test_web_tier import open_streams  # the same clients the suite's test uses

    model = tmp / "tiny.gguf"
    write_tiny_model(model, seed=0)
    port = free_port()
    cfg = write_config(
        tmp / f"{worker_class}.toml",
        {
            "server": {"port": port, "web_worker_class": worker_class},
            "pool": {"max_queue_per_model": max(clients) + 10},
            "debug": {"fault_injection": True},
            "models": {"a": {"path": str(model), "n_ctx": 256, "parallel": 1}},
        },
    )
    lines = []
    with contextlib.ExitStack() as stack:
        data = tmp / f"data-{worker_class}"
        up_box(cfg, data, tmp / f"{worker_class}.log", stack)
        url = f"http://127.0.0.1:{port}"
        admin = {"Authorization": f"Bearer {(data / 'admin.key').read_text().strip()}"}
        body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        requests.post(url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
        requests.post(url + "/admin/faults", json={"hold": {"a": True}}, headers=admin, timeout=60)

        def readyz() -> bool:
            return requests.get(url + "/readyz", timeout=PROBE_TIMEOUT_S).status_code == 200

        def patch() -> bool:
            r = requests.patch(
                url + "/admin/config",
                json={"server": {"request_timeout_s": 600}},
                headers=admin,
                timeout=PROBE_TIMEOUT_S,
            )
            return r.status_code == 200

        for n in clients:
            conns = open_streams(port, n)
            deadline = time.monotonic() + 30  # gthread never takes more than its threads
            while waiting(url) < n and time.monotonic() < deadline:
                time.sleep(0.2)
            held = waiting(url)
            r50, r99, rf = probe(readyz, probes)
            p50, p99, pf = probe(patch, probes // 4)
            lines.append(
                f"| {worker_class} | {n} ({held} waiting) | {r50:.1f} / {r99:.1f} | {rf} | "
                f"{p50:.1f} / {p99:.1f} | {pf} |"
            )
            print(lines[-1], flush=True)
            for c in conns:
                c.close()
            deadline = time.monotonic() + 120
            while waiting(url) > 1 and time.monotonic() < deadline:
                time.sleep(0.2)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default=",".join(map(str, CLIENTS)))
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--classes", default="gevent,gthread")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    clients = [int(x) for x in args.clients.split(",")]
    rows = [
        "| worker class | streaming clients waiting | /readyz p50 / p99 ms | failed | "
        "PATCH /admin/config p50 / p99 ms | failed |",
        "|---|---|---|---|---|---|",
    ]
    with cleanup(), tempfile.TemporaryDirectory() as d:
        for wc in args.classes.split(","):
            rows += run_class(wc, clients, args.probes, Path(d))
    print("\n".join(rows))
    if args.out:
        body = "\n".join([machine_facts(), "", f"`{command_line()}`", "", *rows])
        replace_section(
            args.out, body, begin=BEGIN, end=END, title="Web tier under waiting clients"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
