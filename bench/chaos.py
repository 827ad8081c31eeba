"""Chaos: requests keep flowing while parts of the box are killed.

One run, one box (``residency up``: embedded Redis with AOF, a leader and a standby coordinator,
one agent, web; three tiny llama models c1..c3, all resident, each streamed chunk slowed by
``token_delay_s`` so requests overlap the kills). 8 clients send 300 chat requests (half of them
streaming, models chosen by a seeded RNG) while a chaos loop, every ``--every`` seconds, SIGKILLs
in turn a random model process, the coordinator leader, a model process, the Redis server, ...

Printed:
- accepted (requests sent), answered (a complete response: a body, or a stream up to
  ``[DONE]``), answered with an error (a non-200 status or an error event, after the client's
  own retries: like the ``openai`` client, it tries a 503 or 429 again after its
  ``Retry-After``, up to 5 times), lost (no complete response: target 0);
- duplicated (target 0): requests whose reply stream got more than one final message (a
  generation served twice), counted from Redis MONITOR on the box's own server;
- the longest wait of any request;
- each takeover: time from SIGKILL of the leader to the standby holding the lease (target ≤
  the lease TTL), and each Redis restart: time until it answers again.

    .venv/bin/python bench/chaos.py [--quick] [--every S] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
import requests
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

from residency import keys
from residency.tinymodel import write_tiny_model

BEGIN = "<!-- chaos:begin -->"
END = "<!-- chaos:end -->"
NAMES = ("c1", "c2", "c3")
CLIENTS = 8
REQUESTS = 300
MAX_TOKENS = 24
TOKEN_DELAY_S = 0.02
REQUEST_TIMEOUT_S = 180.0
CHAOS_ORDER = ("model", "leader", "model", "redis")
SEED = 20261203
CLIENT_RETRIES = 5


@dataclass
class Outcome:
    status: int | None  # None: no response at all
    complete: bool
    error: str | None
    seconds: float


@dataclass
class Results:
    outcomes: list[Outcome] = field(default_factory=list)
    kills: Counter[str] = field(default_factory=Counter)
    takeovers: list[float] = field(default_factory=list)
    redis_restarts: list[float] = field(default_factory=list)
    finals: Counter[str] = field(default_factory=Counter)  # reply id -> final messages
    notes: list[str] = field(default_factory=list)
    client_retries: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Box:
    def __init__(self, url: str, redis_url: str, proc: Any) -> None:
        self.url = url
        self.redis_url = redis_url
        self.proc = proc

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=2)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def by_cmdline(self, *words: str) -> list[psutil.Process]:
        out = []
        for p in self.descendants():
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(p.cmdline())
                if all(w in cmd for w in words):
                    out.append(p)
        return out


def one_request(box: Box, i: int, rng: random.Random, res: Results) -> None:
    """One request as the official clients send it: a 503 or 429 with ``Retry-After`` is tried
    again after that wait (up to CLIENT_RETRIES times), like the ``openai`` client does."""
    t0 = time.monotonic()
    model = rng.choice(NAMES)
    for attempt in range(CLIENT_RETRIES + 1):
        out, retry_after = attempt_request(box, i, model)
        if retry_after is None or attempt == CLIENT_RETRIES:
            break
        with res.lock:
            res.client_retries += 1
        time.sleep(min(retry_after, 2.0))
    out.seconds = time.monotonic() - t0
    with res.lock:
        res.outcomes.append(out)


def attempt_request(box: Box, i: int, model: str) -> tuple[Outcome, float | None]:
    """One HTTP exchange; the Retry-After of a 503 or 429 answer, else None."""
    stream = i % 2 == 0
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"request {i}: say something"}],
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }
    t0 = time.monotonic()
    status: int | None = None
    retry_after: float | None = None
    complete, error = False, None
    try:
        with requests.post(
            box.url + "/v1/chat/completions", json=body, stream=stream, timeout=REQUEST_TIMEOUT_S
        ) as r:
            status = r.status_code
            if status in (429, 503) and r.headers.get("Retry-After"):
                with contextlib.suppress(ValueError):
                    retry_after = float(r.headers["Retry-After"])
            if status != 200:
                complete = True
                with contextlib.suppress(ValueError):
                    error = r.json()["error"].get("code") or str(status)
                error = error or str(status)
            elif not stream:
                r.json()
                complete = True
            else:
                for line in r.iter_lines(decode_unicode=True):
                    if not line or not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        complete = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        error = obj["error"].get("code") or "error"
    except (requests.RequestException, ValueError) as e:
        error = f"client: {type(e).__name__}"
    return Outcome(status, complete, error, time.monotonic() - t0), retry_after


def clients(box: Box, total: int, res: Results) -> None:
    counter = iter(range(total))
    lock = threading.Lock()

    def worker(k: int) -> None:
        rng = random.Random(SEED + k)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            one_request(box, i, rng, res)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def watch_finals(box: Box, res: Results, done: threading.Event, attached: threading.Event) -> None:
    """Count the final messages (done / error) written to each reply stream, from MONITOR.
    Reconnects after a Redis restart (commands in between were not executed anyway).
    ``attached`` is set once MONITOR has answered (entering ``monitor()`` reads its OK)."""
    while not done.is_set():
        try:
            with box.client().monitor() as m:
                attached.set()
                for cmd in m.listen():
                    if done.is_set():
                        return
                    c = str(cmd.get("command", ""))
                    if not c.upper().startswith("XADD") or keys.reply("") not in c:
                        continue
                    parts = c.split()
                    if len(parts) >= 5 and parts[3] == "t" and parts[4] in ("done", "error"):
                        with res.lock:
                            res.finals[parts[1]] += 1
        except (redis.RedisError, OSError):
            done.wait(0.2)


def kill_model(box: Box, rng: random.Random, res: Results) -> None:
    """SIGKILL the process of a random resident model (its pid from the model's state: a load
    may have gone to a warm standby process, whose command line names no model)."""
    try:
        r = box.client()
        pids = [int(p) for n in NAMES if (p := r.hget(keys.model(n), "pid"))]
    except redis.RedisError:
        return
    if not pids:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(rng.choice(pids), signal.SIGKILL)
        res.kills["model process"] += 1


def kill_leader(box: Box, res: Results) -> None:
    r = box.client()
    try:
        token = r.get(keys.leader())
        rec = json.loads(str(r.hget(keys.health(), "record") or "{}"))
    except redis.RedisError:
        return
    pid = None
    leader = rec.get("leader") or {}
    if isinstance(leader, dict) and ":" in str(leader.get("id", "")):
        pid = int(str(leader["id"]).rsplit(":", 1)[1])
    coords = box.by_cmdline("residency.cli", "coordinator")
    if pid is None or pid not in {p.pid for p in coords}:
        res.notes.append("leader pid not in /health: killed the older coordinator")
        coords.sort(key=lambda p: p.create_time())
        if not coords:
            return
        pid = coords[0].pid
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    res.kills["coordinator leader"] += 1
    deadline = t0 + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            cur = r.get(keys.leader())
            if cur and cur != token:
                res.takeovers.append(time.monotonic() - t0)
                return
        time.sleep(0.01)
    res.notes.append("no takeover within 30 s")


def kill_redis(box: Box, res: Results) -> None:
    servers = [
        p
        for p in box.descendants()
        if any(n in p.name() for n in ("valkey", "redis-server", "redis"))
    ]
    if not servers:
        return
    t0 = time.monotonic()
    servers[0].kill()
    with contextlib.suppress(psutil.Error):
        servers[0].wait(10)  # dead before polling: never a ping answered by the old server
    res.kills["redis server"] += 1
    r = box.client()
    deadline = t0 + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if r.ping():
                res.redis_restarts.append(time.monotonic() - t0)
                return
        time.sleep(0.01)
    res.notes.append("Redis did not come back within 60 s")


def chaos(box: Box, every: float, res: Results, done: threading.Event) -> None:
    rng = random.Random(SEED)
    i = 0
    while not done.wait(every):
        what = CHAOS_ORDER[i % len(CHAOS_ORDER)]
        i += 1
        if what == "model":
            kill_model(box, rng, res)
        elif what == "leader":
            kill_leader(box, res)
        else:
            kill_redis(box, res)


def box_toml(path: Path, port: int, models: dict[str, Path]) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import write_config  # the test suite's TOML writer

    return write_config(
        path,
        {
            "server": {"port": port},
            "pool": {"max_loaded_models": len(models)},
            "debug": {"fault_injection": True},
            "models": {n: {"path": str(p), "n_ctx": 512} for n, p in models.items()},
        },
    )


def run(tmp: Path, total: int, every: float) -> tuple[Results, float]:
    models = {n: write_tiny_model(tmp / f"{n}.gguf", seed=i) for i, n in enumerate(NAMES)}
    port = free_port()
    cfg = box_toml(tmp / "box.toml", port, models)
    data = tmp / "data"
    res = Results()
    with contextlib.ExitStack() as stack:
        proc = up_box(cfg, data, tmp / "residency.log", stack)
        box = Box(f"http://127.0.0.1:{port}", f"unix://{data / 'redis' / 'redis.sock'}", proc)
        admin = {"Authorization": f"Bearer {(data / 'admin.key').read_text().strip()}"}
        delays = dict.fromkeys(NAMES, TOKEN_DELAY_S)
        requests.post(
            box.url + "/admin/faults", json={"token_delay_s": delays}, headers=admin, timeout=10
        ).raise_for_status()
        for n in NAMES:  # warm: every model resident before the clock starts
            requests.post(
                box.url + "/v1/chat/completions",
                json={"model": n, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                timeout=REQUEST_TIMEOUT_S,
            ).raise_for_status()
        done, attached = threading.Event(), threading.Event()
        watcher = threading.Thread(
            target=watch_finals, args=(box, res, done, attached), daemon=True
        )
        watcher.start()
        if not attached.wait(30):  # MONITOR attached before the first request
            raise RuntimeError("MONITOR did not attach")
        chaos_thread = threading.Thread(target=chaos, args=(box, every, res, done), daemon=True)
        t0 = time.monotonic()
        chaos_thread.start()
        clients(box, total, res)
        elapsed = time.monotonic() - t0
        done.set()
        chaos_thread.join(60)
    return res, elapsed


def report(res: Results, total: int, elapsed: float, every: float) -> tuple[str, str]:
    outs = res.outcomes
    answered = [o for o in outs if o.complete]
    errors = [o for o in answered if o.error]
    lost = total - len(answered)
    dup = sum(1 for n in res.finals.values() if n > 1)
    longest = max((o.seconds for o in outs), default=0.0)
    codes = Counter(o.error for o in errors)
    ttl = keys.LEADER_TTL_MS / 1000
    worst_takeover = max(res.takeovers, default=float("nan"))
    rows = [
        ("accepted", str(len(outs)), ""),
        ("answered", str(len(answered)), ""),
        (
            "answered with an error",
            str(len(errors)),
            ", ".join(f"{k}: {v}" for k, v in codes.most_common()),
        ),
        ("lost", str(lost), "target 0: " + ("met" if lost == 0 else "MISSED")),
        ("duplicated", str(dup), "target 0: " + ("met" if dup == 0 else "MISSED")),
        (
            "longest wait",
            f"{longest:.2f} s",
            f"p50 {percentile([o.seconds for o in outs], 0.5):.2f} s",
        ),
        (
            "standby takeover",
            ", ".join(f"{t:.2f} s" for t in res.takeovers) or "none",
            f"worst {worst_takeover / ttl:.2f}x the lease TTL ({ttl:g} s): "
            + ("met" if res.takeovers and worst_takeover <= ttl else "MISSED"),
        ),
        (
            "Redis back after kill",
            ", ".join(f"{t:.2f} s" for t in res.redis_restarts) or "none",
            "",
        ),
        (
            "kills",
            ", ".join(f"{k}: {v}" for k, v in sorted(res.kills.items())),
            f"every {every:g} s",
        ),
        ("client retries after 503/429", str(res.client_retries), "Retry-After honoured"),
        ("requests' final messages seen", str(sum(res.finals.values())), "from MONITOR"),
    ]
    text = "\n".join(f"{a:<32} {b:<30} {c}" for a, b, c in rows)
    md = [
        f"Run {datetime.date.today().isoformat()} on {machine_facts()}: `{command_line()}`",
        "",
        f"{total} chat requests (half streaming, {MAX_TOKENS} tokens, {TOKEN_DELAY_S * 1000:g} ms "
        f"per chunk) from {CLIENTS} clients over {len(NAMES)} tiny models in {elapsed:.1f} s.",
        "",
        "| what | result | notes |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
    ]
    md += [
        "",
        "- answered with an error: a reply already under way when its model process was killed "
        "(`model_process_exited`: a partial reply is never replayed) or when Redis was killed "
        "(`redis_unavailable`: its reader lost Redis; a 503 before the reply began is retried "
        "by the client and counted once, as its last answer)",
        "- takeover: both coordinators run on this host, so the standby sees the leader's "
        "process gone and frees its lease at its next poll (0.25 s); a standby on another host "
        "waits out the lease: at most the TTL plus one poll",
        "- final messages seen can exceed the requests (a reply finished for an attempt whose "
        "client had got a 503 while Redis was down, and retried as a new request) or fall "
        "short (written while MONITOR was reconnecting after a Redis restart): duplicated "
        "counts the request ids seen with two",
    ]
    if res.notes:
        md += ["", *(f"- {n}" for n in sorted(set(res.notes)))]
        text += "\n" + "\n".join(f"- {n}" for n in sorted(set(res.notes)))
    return text, "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="60 requests instead of 300")
    ap.add_argument("--every", type=float, default=3.0, help="seconds between two kills")
    ap.add_argument("--out", type=Path, help="rewrite this file's chaos section")
    args = ap.parse_args(argv)
    total = 60 if args.quick else REQUESTS
    try:
        with tempfile.TemporaryDirectory(prefix="residency-chaos-") as tmp, cleanup():
            res, elapsed = run(Path(tmp), total, args.every)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    text, md = report(res, total, elapsed, args.every)
    print(text)
    if args.out:
        replace_section(args.out, md, begin=BEGIN, end=END, title="Chaos")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
