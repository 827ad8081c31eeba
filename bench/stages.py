"""Where residency's time goes in one request: each stage timed from Redis's own MONITOR clock.

Starts the box with the tiny model, sends sequential streamed chat requests like
``bench/overhead.py`` does, records every Redis command with its server timestamp (a raw MONITOR
connection dumped to a file by a separate process, so the recording costs the box little), and
prints the median and p90 of each stage next to direct llama.cpp's whole request:

    .venv/bin/python bench/stages.py [-n 100]

Stages are found from the commands each role sends (the submit script's first key is the model's
queue; the model process's first command after taking a request reads its cancel flag; replies
are XADDs to the reply stream), so they follow ``residency.keys``; MONITOR itself slows Redis a
little, so the sum is a bit above bench/overhead.py's figure.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overhead import (
    TINY_PROMPTS,
    Case,
    Direct,
    Http,
    cleanup,
    percentile,
    spawn,
    start_residency,
    stop,
)

from residency import keys
from residency.tinymodel import write_tiny_model

# Dumps a MONITOR connection's raw bytes to a file; argv: socket path, output file.
DUMPER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"MONITOR\\r\\n")
with open(sys.argv[2], "wb", buffering=0) as out:
    while chunk := s.recv(1 << 16):
        out.write(chunk)
"""
LINE = re.compile(r'^\+(\d+\.\d+) \[\d+ ([^\]]+)\] "([^"]+)"(.*)$')


@dataclass(frozen=True)
class Command:
    t: float
    client: str
    name: str
    args: str


@dataclass(frozen=True)
class Window:
    """One request as the client saw it (time.time() clock, as Redis's MONITOR uses)."""

    start: float
    first: float
    end: float


def parse(text: str) -> list[Command]:
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out.append(Command(float(m[1]), m[2], m[3].upper(), m[4]))
    return out


def stages(w: Window, cmds: list[Command], model: str) -> dict[str, float]:
    """Seconds per stage of one request."""
    inside = [c for c in cmds if w.start <= c.t <= w.end]
    submit = next(c.t for c in inside if c.name == "EVALSHA" and f'"{keys.queue(model)}"' in c.args)
    cancel = keys.cancel("")
    taken = next(c.t for c in inside if c.name == "EXISTS" and cancel in c.args and c.t > submit)
    replies = [c for c in inside if c.name == "XADD" and keys.reply("") in c.args]
    chunks = [c.t for c in replies if '"t" "chunk"' in c.args]
    done = next(c.t for c in replies if '"t" "done"' in c.args)
    return {
        "client -> web -> submit script": submit - w.start,
        "queue -> taken by the model process": taken - submit,
        "model: prompt + 1st token -> 1st reply write": chunks[0] - taken,
        "model: other tokens -> last chunk write": chunks[-1] - chunks[0],
        "model: last chunk -> done write": done - chunks[-1],
        "done write -> client has the whole reply": w.end - done,
        "client: first content chunk (TTFT)": w.first - w.start,
        "client: whole request": w.end - w.start,
        "Redis commands during the request (count)": sum(c.client != "lua" for c in inside),
    }


def requests_timed(n: int, request: Callable[[int], tuple[float, float]]) -> list[Window]:
    out = []
    for i in range(n):
        start = time.time()
        ttft, total = request(i)
        out.append(Window(start, start + ttft, start + total))
    return out


def report(rows: list[dict[str, float]], direct_ms: float) -> str:
    lines = [f"{'stage':46s} {'median':>9s} {'p90':>9s}"]
    for name in rows[0]:
        values = [r[name] for r in rows]
        scale = 1 if "count" in name else 1000
        unit = "" if "count" in name else " ms"
        med, p90 = statistics.median(values) * scale, percentile(values, 0.9) * scale
        lines.append(f"{name:46s} {med:9.2f} {p90:9.2f}{unit}")
    lines.append(f"{'direct llama.cpp, whole request':46s} {direct_ms:9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=100, help="requests to time (default 100)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="residency-stages-") as tmp, cleanup() as stack:
        d = Path(tmp)
        case = Case("tiny", write_tiny_model(d / "tiny.gguf"), 512, None, args.n, 8, TINY_PROMPTS)
        direct = Direct([case])
        stack.callback(direct.close)
        url, _pid = start_residency(d, [case], stack)
        http = Http("residency", url)
        stack.callback(http.close)
        for i in range(5):  # load the model, warm both up
            http.request(case, i)
            direct.request(case, i)
        direct_ms = statistics.median(direct.request(case, i).total_s for i in range(args.n)) * 1000
        sock = next((d / "data").rglob("*.sock"))
        dump = d / "monitor.txt"
        mon = spawn([sys.executable, "-c", DUMPER, str(sock), str(dump)], d / "monitor.log")
        stack.callback(stop, mon)
        time.sleep(0.5)

        def one(i: int) -> tuple[float, float]:
            s = http.request(case, i)
            return s.ttft_s, s.total_s

        windows = requests_timed(args.n, one)
        time.sleep(0.3)
        cmds = parse(dump.read_text(errors="replace"))
        rows = [stages(w, cmds, case.name) for w in windows]
    print(f"{args.n} sequential streamed chat requests, tiny model, max_tokens 8")
    print(report(rows, direct_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
