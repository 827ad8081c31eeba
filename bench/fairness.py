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

Users on one model (``--part users``): one model (t1, one slot), users with API keys (made
through ``/admin/users``). A heavy user keeps ``HEAVY_QUEUED`` requests waiting (that many
clients, each sending its next request when the last is answered); three light users each send
one request a second (each in its own thread: a slow answer does not delay the next send) for
the mode's duration. Modes: ``pool.fair_queues = true`` (users take turns) and ``false`` (first
come, first served). Per user: answers within the window, the p50 / p99 / longest wait (send to
answer) of every request sent in it, and per mode Jain's fairness index over per-user
throughput in the window, each user's throughput divided by its max-min fair share of the
model's (a light user's demand is one a second; 1.0 = every user got its share).

    .venv/bin/python bench/fairness.py [--quick] [--part models|users|all] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import math
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

# Users on one model.
SHARED_MODEL = "t1"
HEAVY = "heavy"
LIGHT = ("light1", "light2", "light3")
HEAVY_QUEUED = 200  # the heavy user's clients: requests it keeps waiting
LIGHT_RATE_S = 1.0  # each light user sends one request this often
USERS_QUEUE_BOUND = 512  # pool.max_queue_per_model for this part: room for the heavy user
USERS_TIMEOUT_S = 300.0  # server.request_timeout_s for this part: FIFO waits are long
FILL_TIMEOUT_S = 120.0


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


@dataclass
class UsersRun:
    """One mode of the users part: each answer as (user, sent, answered, status), both times
    relative to the window's start, and the queued requests per user seen mid-window."""

    mode: str
    duration: float
    answers: list[tuple[str, float, float, int]] = field(default_factory=list)
    queued_mid: dict[str, int] = field(default_factory=dict)


def make_users(box: Box) -> dict[str, str]:
    """An API key per user (the box must have user keys: ``POST /admin/users``)."""
    out = {}
    for name in (HEAVY, *LIGHT):
        r = requests.post(box.url + "/admin/users", json={"name": name}, headers=box.admin)
        if r.status_code == 404:
            raise SystemExit("this box has no users API (/admin/users): cannot run --part users")
        if r.status_code not in (201, 409):
            raise RuntimeError(f"POST /admin/users {name}: {r.status_code} {r.text}")
        r = requests.post(f"{box.url}/admin/users/{name}/keys", json={}, headers=box.admin)
        if r.status_code != 201:
            raise RuntimeError(f"POST /admin/users/{name}/keys: {r.status_code} {r.text}")
        out[name] = str(r.json()["key"])
    return out


def queued_by_user(box: Box) -> dict[str, int]:
    h = requests.get(box.url + "/health", timeout=10).json()
    m = next((m for m in h["models"] if m["name"] == SHARED_MODEL), {})
    return {str(u): int(n) for u, n in (m.get("queued_by_user") or {}).items()}


def ask(session: requests.Session, box: Box, key: str) -> int:
    body = {
        "model": SHARED_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": MAX_TOKENS,
    }
    headers = {"Authorization": f"Bearer {key}"}
    try:
        url = box.url + "/v1/chat/completions"
        return session.post(
            url, json=body, headers=headers, timeout=USERS_TIMEOUT_S + 60
        ).status_code
    except requests.RequestException:
        return 0


def measure_users(
    box: Box, mode: str, fair: bool, keys_: dict[str, str], duration: float
) -> UsersRun:
    box.admin_call(
        "PATCH",
        "/admin/config",
        {
            "pool": {"fair_queues": fair, "max_queue_per_model": USERS_QUEUE_BOUND},
            "server": {"request_timeout_s": USERS_TIMEOUT_S},
        },
    )
    run = UsersRun(mode, duration)
    stop, lock = threading.Event(), threading.Lock()
    t0 = [0.0]  # the window's start, set once the heavy user's queue is full

    def record(user: str, sent: float, status: int) -> None:
        with lock:
            run.answers.append((user, sent - t0[0], time.perf_counter() - t0[0], status))

    def heavy_loop() -> None:
        with requests.Session() as s:
            while not stop.is_set():
                sent = time.perf_counter()
                record(HEAVY, sent, ask(s, box, keys_[HEAVY]))

    def light_once(user: str) -> None:
        with requests.Session() as s:
            sent = time.perf_counter()
            record(user, sent, ask(s, box, keys_[user]))

    threads = [threading.Thread(target=heavy_loop, daemon=True) for _ in range(HEAVY_QUEUED)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + FILL_TIMEOUT_S
    while queued_by_user(box).get(HEAVY, 0) < HEAVY_QUEUED * 0.9 and time.monotonic() < deadline:
        time.sleep(0.2)
    t0[0] = time.perf_counter()
    sends = 0
    while (now := time.perf_counter() - t0[0]) < duration:
        if now >= sends * LIGHT_RATE_S:
            for user in LIGHT:
                t = threading.Thread(target=light_once, args=(user,), daemon=True)
                t.start()
                threads.append(t)
            sends += 1
            if not run.queued_mid and now >= duration / 2:
                run.queued_mid = queued_by_user(box)
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(USERS_TIMEOUT_S + 90)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while box.queued() and time.monotonic() < deadline:
        time.sleep(0.1)
    return run


def max_min_shares(capacity: float, demands: dict[str, float]) -> dict[str, float]:
    """Each user's max-min fair share of ``capacity``: users that ask for less than an equal
    split get what they ask for, the rest is split equally among the others."""
    shares: dict[str, float] = {}
    left, users = capacity, sorted(demands, key=lambda u: demands[u])
    while users:
        equal = left / len(users)
        u = users[0]
        if demands[u] <= equal:
            shares[u] = demands[u]
            left -= demands[u]
            users.pop(0)
        else:
            for u in users:
                shares[u] = equal
            break
    return shares


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1.0 when all are equal, 1/n when one gets everything."""
    squares = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * squares) if squares else math.nan


def users_rows(run: UsersRun) -> tuple[list[list[str]], float]:
    """Rows per user, and the mode's Jain index over throughput / max-min fair share."""
    inside = [a for a in run.answers if a[2] <= run.duration and a[2] >= 0 and a[3] == 200]
    thr = {u: sum(1 for a in inside if a[0] == u) / run.duration for u in (HEAVY, *LIGHT)}
    demands = {HEAVY: math.inf, **dict.fromkeys(LIGHT, 1.0 / LIGHT_RATE_S)}
    shares = max_min_shares(sum(thr.values()), demands)
    index = jain([thr[u] / shares[u] for u in thr if shares[u] > 0])
    out = []
    for u in (HEAVY, *LIGHT):
        sent = [a for a in run.answers if a[0] == u and 0 <= a[1] < run.duration]
        waits = [a[2] - a[1] for a in sent]
        failed = sum(1 for a in sent if a[3] != 200)
        p = (
            [f"{percentile(waits, q):.2f}" for q in (0.5, 0.99)] + [f"{max(waits):.2f}"]
            if waits
            else ["-", "-", "-"]
        )
        out.append(
            [
                run.mode,
                u,
                f"{thr[u]:.2f}",
                f"{shares[u]:.2f}",
                str(failed),
                *p,
                str(run.queued_mid.get(u, 0)),
                f"{index:.3f}",
            ]
        )
    return out, index


def users_table(all_rows: list[list[str]]) -> str:
    head = [
        "mode",
        "user",
        "answers/s",
        "fair share/s",
        "failed",
        "p50 wait s",
        "p99 wait s",
        "max s",
        "queued (mid)",
        "Jain",
    ]
    widths = [max(len(r[i]) for r in [head, *all_rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *all_rows]
    )


def run_users(tmp: Path, duration: float) -> list[UsersRun]:
    models = {m: write_tiny_model(tmp / f"{m}.gguf", seed=i) for i, m in enumerate(USERS.values())}
    port = free_port()
    cfg = box_toml(tmp / "box.toml", port, models)
    data = tmp / "data"
    with contextlib.ExitStack() as stack:
        up_box(cfg, data, tmp / "residency.log", stack)
        box = Box(f"http://127.0.0.1:{port}", (data / "admin.key").read_text().strip())
        box.admin_call("POST", "/admin/faults", {"token_delay_s": {SHARED_MODEL: TOKEN_DELAY_S}})
        keys_ = make_users(box)
        return [
            measure_users(box, label, fair, keys_, duration)
            for label, fair in (("fair queues", True), ("first come, first served", False))
        ]


BEGIN = "<!-- fairness:begin -->"
END = "<!-- fairness:end -->"
USERS_BEGIN = "<!-- fairness-users:begin -->"
USERS_END = "<!-- fairness-users:end -->"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_DURATION_S:g} s per mode")
    ap.add_argument("--out", type=Path, help="markdown file whose fairness section is rewritten")
    ap.add_argument(
        "--part",
        choices=("models", "users", "all"),
        default="all",
        help="between models (two users, two models), users on one model, or both",
    )
    args = ap.parse_args(argv)
    duration = QUICK_DURATION_S if args.quick else DURATION_S
    runs: list[Run] = []
    users_runs: list[UsersRun] = []
    try:
        with tempfile.TemporaryDirectory(prefix="residency-fairness-") as tmp, cleanup():
            if args.part in ("models", "all"):
                (Path(tmp) / "models").mkdir()
                runs = run_all(Path(tmp) / "models", duration)
            if args.part in ("users", "all"):
                (Path(tmp) / "users").mkdir()
                users_runs = run_users(Path(tmp) / "users", duration)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    if users_runs:
        report_users(users_runs, duration, args.out)
    if not runs:
        return 0
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


def report_users(runs: list[UsersRun], duration: float, out: Path | None) -> None:
    setup = (
        f"one model ({SHARED_MODEL}, 1 slot), {duration:g} s per mode; {HEAVY}: "
        f"{HEAVY_QUEUED} requests kept waiting; {', '.join(LIGHT)}: one request every "
        f"{LIGHT_RATE_S:g} s each; {MAX_TOKENS} tokens x {TOKEN_DELAY_S:g} s; Jain's index over "
        "answers/s in the window / max-min fair share"
    )
    result = users_table([r for run in runs for r in users_rows(run)[0]])
    print(f"{command_line()}\n{machine_facts()}\n{setup}\n\n{result}")
    if out:
        body = f"{machine_facts()}\n\n`{command_line()}`\n\n{setup}\n\n```\n{result}\n```"
        replace_section(out, body, begin=USERS_BEGIN, end=USERS_END, title="Fairness between users")


if __name__ == "__main__":
    raise SystemExit(main())
