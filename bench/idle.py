"""Idle cost: CPU each role of an idle box spends per second, with three tiny models resident
and nothing asked of them (and the standby process waiting for the next load).

What an idle box costs is taken from the cores a generating model needs: every wake-up of an
idle process is a context switch on them. Measured over ``--seconds`` after the loads settle.

    .venv/bin/python bench/idle.py [--seconds N] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests
from overhead import (
    ROOT,
    box_processes,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    replace_section,
    up_box,
)

BEGIN = "<!-- idle:begin -->"
END = "<!-- idle:end -->"
MODELS = 3


def cpu_by_role(root_pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for role, p in box_processes(root_pid):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            key = "model process" if role.startswith("model") else role
            out[key] = out.get(key, 0.0) + t.user + t.system
    return out


def run(seconds: float, tmp: Path, stack: contextlib.ExitStack) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from residency.tinymodel import write_tiny_model
    from tests.conftest import write_config

    models = {}
    for i in range(MODELS):
        path = tmp / f"tiny{i}.gguf"
        write_tiny_model(path, seed=i)
        models[f"m{i}"] = {"path": str(path), "n_ctx": 512}
    port = free_port()
    cfg = write_config(
        tmp / "box.toml",
        {
            "server": {"port": port, "web_workers": 1},
            "pool": {"max_loaded_models": MODELS},
            "models": models,
        },
    )
    proc = up_box(cfg, tmp / "data", tmp / "residency.log", stack)
    url = f"http://127.0.0.1:{port}"
    for name in models:
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        requests.post(url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
    time.sleep(3)  # the standby process starts and settles
    before = cpu_by_role(proc.pid)
    t0 = time.monotonic()
    time.sleep(seconds)
    after = cpu_by_role(proc.pid)
    wall = time.monotonic() - t0
    lines = [f"Idle for {wall:.0f} s with {MODELS} tiny models resident; % of one core:", ""]
    total = 0.0
    for role in sorted(after):
        pct = 100 * (after[role] - before.get(role, after[role])) / wall
        total += pct
        lines.append(f"- {role}: {pct:.2f}%")
    lines.append(f"- all: {total:.2f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    with cleanup() as stack, tempfile.TemporaryDirectory() as d:
        lines = run(args.seconds, Path(d), stack)
    print("\n".join(lines))
    if args.out:
        body = "\n".join([machine_facts(), "", f"`{command_line()}`", "", *lines])
        replace_section(args.out, body, begin=BEGIN, end=END, title="Idle cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
