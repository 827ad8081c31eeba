"""Fairness between models: two users, two models, one slot — with yielding and without.

One run, one box (``residency up``, tiny llama models t1 and t2, ``max_loaded_models = 1``,
``[debug] fault_injection = true`` so each request does some work: ``token_delay_s``). Each user
keeps its own model busy with clients that send its requests back to back. Both users start
together; each mode lasts ``DURATION_S``. Per user it reports the requests answered 200 and
failed (a request that waits ``server.request_timeout_s`` for a slot is answered 503), the p50 /
p99 / longest time from sending a request to its answer, and the loads in the mode:

- yielding, 1 client per user: ``pool.max_busy_s = MAX_BUSY_S``, ``pool.min_resident_s =
  MIN_RESIDENT_S``. The model is idle for a moment between its client's requests; within
  ``min_resident_s`` that gap does not hand its slot over (its turn), after it it does;
- yielding, 2 clients per user: its model always has a request queued, so it is never idle and
  only a yield hands the slot over;
- no turns, 1 client per user: ``max_busy_s = 0``, ``min_resident_s = 0`` — the behavior before
  turns: every gap between a user's requests hands the slot to the other (a load per request);
- no yielding, 2 clients per user: ``max_busy_s = 0`` — whichever model loads first keeps the
  slot, and the other user's requests time out.

The settings are live: one box, changed through ``PATCH /admin/config`` between the modes.

    .venv/bin/python bench/fairness.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from alternation import loads_ok
from overhead import (
    ROOT,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    percentile,
    replace_section,
    up_box,
)

from residency.tinymodel import write_tiny_model

USERS = {"alice": "t1", "bob": "t2"}
DURATION_S = 30.0
QUICK_DURATION_S = 15.0
MAX_BUSY_S = 2.0
MIN_RESIDENT_S = 2.0
REQUEST_TIMEOUT_S = 10.0  # server.request_timeout_s: how long a starved request waits
TOKEN_DELAY_S = 0.02  # work per generated token (the tiny model alone takes ~1 ms)
MAX_TOKENS = 8
SETTLE_TIMEOUT_S = 60.0


@dataclass
class Run:
    """One mode: each answer as (user, seconds from send to answer, HTTP status), and loads."""

    mode: str
    answers: list[tuple[str, float, int]] = field(default_factory=list)
    loads: int = 0


class Box:
    def __init__(self, url: str, admin_key: str) -> None:
        self.url = url
        self.admin = {"Authorization": f"Bearer {admin_key}"}

    def admin_call(self, method: str, path: str, body: dict[str, object]) -> None:
        r = requests.request(method, self.url + path, json=body, headers=self.admin, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path} {body}: {r.status_code} {r.text}")

    def queued(self) -> int:
        h = requests.get(self.url + "/health", timeout=10).json()
        return sum(int(m["queued"]) + int(m["in_flight"]) for m in h["models"])


def client(box: Box, user: str, stop: threading.Event, run: Run, lock: threading.Lock) -> None:
    body = {
        "model": USERS[user],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": MAX_TOKENS,
    }
    with requests.Session() as s:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status = s.post(
                    box.url + "/v1/chat/completions", json=body, timeout=120
                ).status_code
            except requests.RequestException:
                status = 0
            with lock:
                run.answers.append((user, time.perf_counter() - t0, status))


def measure(box: Box, mode: str, loops: int, fairness: dict[str, float], duration: float) -> Run:
    box.admin_call("PATCH", "/admin/config", {"pool": fairness})
    run = Run(mode)
    before = loads_ok(box.url)
    stop, lock = threading.Event(), threading.Lock()
    threads = [
        threading.Thread(target=client, args=(box, u, stop, run, lock), daemon=True)
        for u in USERS
        for _ in range(loops)
    ]
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 60)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while box.queued() and time.monotonic() < deadline:
        time.sleep(0.1)
    run.loads = loads_ok(box.url) - before
    return run


def rows(run: Run) -> list[list[str]]:
    out = []
    for user, model in USERS.items():
        ok = [s for u, s, code in run.answers if u == user and code == 200]
        failed = sum(1 for u, _, code in run.answers if u == user and code != 200)
        waits = [s for u, s, _ in run.answers if u == user]
        p = (
            [f"{percentile(waits, q):.2f}" for q in (0.5, 0.99)] + [f"{max(waits):.2f}"]
            if waits
            else ["-", "-", "-"]
        )
        out.append([run.mode, f"{user} ({model})", str(len(ok)), str(failed), *p, str(run.loads)])
    return out


def table(all_rows: list[list[str]]) -> str:
    head = ["mode", "user", "200", "failed", "p50 s", "p99 s", "max s", "loads (both)"]
    widths = [max(len(r[i]) for r in [head, *all_rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *all_rows]
    )


def box_toml(path: Path, port: int, models: dict[str, Path]) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import write_config  # the test suite's TOML writer

    return write_config(
        path,
        {
            "server": {"port": port, "web_workers": 1, "request_timeout_s": REQUEST_TIMEOUT_S},
            "pool": {"max_loaded_models": 1},
            "debug": {"fault_injection": True},
            "models": {n: {"path": str(p), "n_ctx": 512, "parallel": 1} for n, p in models.items()},
        },
    )


def run_all(tmp: Path, duration: float) -> list[Run]:
    models = {m: write_tiny_model(tmp / f"{m}.gguf", seed=i) for i, m in enumerate(USERS.values())}
    port = free_port()
    cfg = box_toml(tmp / "box.toml", port, models)
    data = tmp / "data"
    with contextlib.ExitStack() as stack:
        up_box(cfg, data, tmp / "residency.log", stack)
        box = Box(f"http://127.0.0.1:{port}", (data / "admin.key").read_text().strip())
        delays = dict.fromkeys(USERS.values(), TOKEN_DELAY_S)
        box.admin_call("POST", "/admin/faults", {"token_delay_s": delays})
        yielding = {"max_busy_s": MAX_BUSY_S, "min_resident_s": MIN_RESIDENT_S}
        turns = f"({MAX_BUSY_S:g} s / {MIN_RESIDENT_S:g} s)"
        modes: list[tuple[str, int, dict[str, float]]] = [
            (f"yielding {turns}, 1 client/user", 1, yielding),
            (f"yielding {turns}, 2 clients/user", 2, yielding),
            ("no turns (0 s / 0 s), 1 client/user", 1, {"max_busy_s": 0.0, "min_resident_s": 0.0}),
            ("no yielding (0 s / 2 s), 2 clients/user", 2, {**yielding, "max_busy_s": 0.0}),
        ]
        return [measure(box, label, n, pool, duration) for label, n, pool in modes]


BEGIN = "<!-- fairness:begin -->"
END = "<!-- fairness:end -->"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_DURATION_S:g} s per mode")
    ap.add_argument("--out", type=Path, help="markdown file whose fairness section is rewritten")
    args = ap.parse_args(argv)
    duration = QUICK_DURATION_S if args.quick else DURATION_S
    try:
        with tempfile.TemporaryDirectory(prefix="residency-fairness-") as tmp, cleanup():
            runs = run_all(Path(tmp), duration)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    setup = (
        f"{len(USERS)} users, {duration:g} s per mode, max_loaded_models = 1, "
        f"request_timeout_s = {REQUEST_TIMEOUT_S:g}, {MAX_TOKENS} tokens x {TOKEN_DELAY_S:g} s"
    )
    result = table([r for run in runs for r in rows(run)])
    print(f"{command_line()}\n{machine_facts()}\n{setup}\n\n{result}")
    if args.out:
        body = f"{machine_facts()}\n\n`{command_line()}`\n\n{setup}\n\n```\n{result}\n```"
        replace_section(args.out, body, begin=BEGIN, end=END, title="Fairness between models")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
