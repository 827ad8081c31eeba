"""The router that knows what is loaded: ``choose = "first"`` against ``choose = "fastest"``.

One ``residency up`` on this machine with two equivalent local candidates, ``a`` and ``b`` (tiny
models, ``b`` a layer deeper), and a remote fallback ``r`` (llama-server serving another tiny
model, registered with ``base_url``); ``pool.max_loaded_models = 1`` with
``llm_pool_autosize = false`` (autosize would lift the limit to the two local candidates), two
slots a model. Two policies over [a, b, r], made through the admin API once the warm-up measured
a load: rule ``long`` (at least ``LONG_MIN_CHARS`` bytes) lists [b, a, r], the default
[a, b, r]. ``auto-first`` takes the first listed (the content decides: with one model resident,
loads thrash between a and b); ``auto-fastest`` takes the least predicted wait, with
``max_wait_s`` at ``MAX_WAIT_LOADS`` measured loads (past it on both, the remote). Two policies
rather than one changed live: ``/health`` keeps each policy's prediction error apart.

The workload: 8 client threads, each sending bursts of 2-4 streamed chats back to back with
short think times between bursts, each burst short prompts or long ones; the same kinds and
think times for both modes in a round, the modes interleaved (their order alternates by round).
Per request: the wait (time to the first content chunk) and the candidate that served it (the
third field of ``x-residency-route``). Per mode: p50 and p99 wait, loads (``/metrics``
``residency_model_loads_total{outcome="ok"}`` around each run), each candidate's share, and the
median relative prediction error ``/health`` publishes for the policy.

    .venv/bin/python bench/routing.py [--rounds N] [--quick] [--llama-server PATH] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from load import TINY_WORDS, Model, find_llama_server, start_llama_server
from overhead import (
    REQUEST_TIMEOUT_S,
    ROOT,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    percentile,
    replace_section,
    spawn,
    stop,
    wait_for,
)

sys.path.insert(0, str(ROOT))
from residency.tinymodel import TINY, Shape, write_tiny_model

BEGIN = "<!-- routing:begin -->"
END = "<!-- routing:end -->"
CANDIDATES = ("a", "b", "r")
MODES = ("first", "fastest")
SLOTS = 2
N_CTX = 2048  # per slot: a long prompt is ~300 tokens
CLIENTS = 8
MAX_TOKENS = 8
LONG_MIN_CHARS = 600
LONG_WORDS = 240  # ~1.2 KB: the `long` rule fires
SHORT_WORDS = 8
P_LONG = 0.4  # share of bursts of long prompts
BURST = (2, 4)  # requests a burst, back to back
THINK_S = (0.2, 1.5)  # between a client's bursts
BURSTS = 4
QUICK_BURSTS = 2
ROUNDS = 4
QUICK_ROUNDS = 1
MAX_WAIT_LOADS = 2.5  # fastest's max_wait_s, in measured loads of a candidate
HEALTH_WAIT_S = 30.0  # the coordinator publishes the routing error every ~10 s
TARGET_P99 = 0.5  # fastest p99 wait / first's, at most
TARGET_LOADS = 0.5  # fastest loads / first's, at most
TARGET_ERROR = 0.25  # fastest's median relative prediction error, at most


def policy_name(mode: str) -> str:
    return f"auto-{mode}"


@dataclass
class Sample:
    mode: str
    round: int
    kind: str  # "long" | "short"
    wait_s: float | None = None  # None: it failed
    candidate: str = ""
    reason: str = ""  # why it won among several listed ("first", "fastest", "over_max_wait"...)
    predicted_s: float | None = None  # the router's predicted wait for it (a local candidate)
    route: str = ""
    error: str = ""

    def parse_route(self, header: str) -> None:
        """``policy:rule:candidate``, then (a choice among several) ``; reason; name=1.234s
        name=remote ...``."""
        self.route = header
        parts = [p.strip() for p in header.split(";")]
        fields = parts[0].split(":")
        self.candidate = fields[2] if len(fields) > 2 else ""
        self.reason = parts[1] if len(parts) > 1 else ""
        for item in parts[2].split() if len(parts) > 2 else []:
            name, _, value = item.partition("=")
            if name == self.candidate and value.endswith(("s", "s+evicts")):
                with contextlib.suppress(ValueError):
                    self.predicted_s = float(value.split("s", 1)[0])


@dataclass
class ModeResult:
    samples: list[Sample] = field(default_factory=list)
    loads: int = 0
    seconds: float = 0.0  # wall time of its runs
    error: dict[str, Any] | None = None  # /health's prediction error for its policy
    note: str = ""  # why it was not run

    @property
    def waits(self) -> list[float]:
        return [s.wait_s for s in self.samples if s.wait_s is not None]

    @property
    def failed(self) -> int:
        return sum(1 for s in self.samples if s.wait_s is None)

    def share(self, name: str) -> float:
        served = [s for s in self.samples if s.wait_s is not None]
        return sum(1 for s in served if s.candidate == name) / max(1, len(served))

    def reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.samples:
            # A `first` choice keeps the header as it always was: no reason in it.
            why = s.reason or ("first" if s.route else "?")
            out[why] = out.get(why, 0) + 1
        return dict(sorted(out.items()))

    def client_error(self) -> float | None:
        """Median |predicted - measured| / measured over the requests whose header carried the
        chosen candidate's prediction: the wait measured here includes HTTP and the stream's
        first event, so it is a cross-check of ``/health``'s, not the same number."""
        rel = [
            abs(s.predicted_s - s.wait_s) / s.wait_s
            for s in self.samples
            if s.predicted_s is not None and s.wait_s
        ]
        return statistics.median(rel) if rel else None


# --- the box -----------------------------------------------------------------------------------


class Box:
    def __init__(self, url: str, admin_key: str) -> None:
        self.url = url
        self.admin = {"Authorization": f"Bearer {admin_key}"}

    def metric_sum(self, name: str, label: str = "") -> float:
        """The samples of ``name`` on ``/metrics`` whose labels contain ``label``, summed."""
        text = requests.get(self.url + "/metrics", headers=self.admin, timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and label in line.split("}", 1)[0]:
                with contextlib.suppress(ValueError, IndexError):
                    total += float(line.rsplit(None, 1)[1])
        return total

    def loads(self) -> int:
        return round(self.metric_sum("residency_model_loads_total", 'outcome="ok"'))

    def load_time(self) -> float | None:
        """Mean seconds of the loads so far (``residency_model_load_seconds``)."""
        n = self.metric_sum("residency_model_load_seconds_count")
        return self.metric_sum("residency_model_load_seconds_sum") / n if n else None

    def health(self) -> dict[str, Any]:
        r = requests.get(self.url + "/health", headers=self.admin, timeout=10)
        return dict(r.json())

    def put_policy(self, name: str, spec: dict[str, Any]) -> str:
        """'' when stored, else the box's answer."""
        r = requests.put(
            f"{self.url}/admin/policies/{name}", json=spec, headers=self.admin, timeout=30
        )
        return "" if r.status_code in (200, 201) else f"HTTP {r.status_code}: {r.text[:400]}"

    def routing(self, policy: str) -> dict[str, Any] | None:
        with contextlib.suppress(requests.RequestException, ValueError, AttributeError):
            section = (self.health().get("routing") or {}).get(policy)
            return section if isinstance(section, dict) else None
        return None


def start_box(d: Path, paths: dict[str, Path], remote_url: str, stack: contextlib.ExitStack) -> Box:
    from tests.conftest import write_config  # the test suite's TOML writer

    port = free_port()
    models: dict[str, dict[str, Any]] = {
        name: {"path": str(paths[name]), "n_ctx": N_CTX, "parallel": SLOTS} for name in ("a", "b")
    }
    models["r"] = {"type": "llm", "base_url": remote_url + "/v1"}
    cfg = write_config(
        d / "box.toml",
        {
            # The remote is llama-server on this host: loopback.
            "server": {"port": port, "web_workers": 1, "allow_local_remotes": True},
            "auth": {"required": False, "public_health": True},
            "pool": {"max_loaded_models": 1, "llm_pool_autosize": False},
            "models": models,
        },
    )
    log = d / "residency.log"
    args = ["-m", "residency.cli", "up", "--config", str(cfg), "--data-dir", str(d / "data")]
    proc = spawn([sys.executable, *args], log)
    stack.callback(stop, proc)
    wait_for(proc, log, lambda: "residency is up" in log.read_text(errors="replace"), "residency")
    return Box(f"http://127.0.0.1:{port}", (d / "data" / "admin.key").read_text().strip())


def policy(mode: str, max_wait_s: float) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "candidates": list(CANDIDATES),
        "default": ["a", "b", "r"],
        "rules": [
            {"id": "long", "match": {"min_chars": LONG_MIN_CHARS}, "route_to": ["b", "a", "r"]}
        ],
        "choose": mode,
    }
    if mode == "fastest":
        spec["max_wait_s"] = round(max_wait_s, 2)
    return spec


def legacy_policy() -> dict[str, Any]:
    """``first`` as a box without candidate lists routes: each rule names its first candidate."""
    return {
        "candidates": list(CANDIDATES),
        "default": "a",
        "rules": [{"id": "long", "match": {"min_chars": LONG_MIN_CHARS}, "route_to": "b"}],
    }


# --- the requests ------------------------------------------------------------------------------


def prompt(tag: str, kind: str, rng: random.Random) -> str:
    n = LONG_WORDS if kind == "long" else SHORT_WORDS
    # A new tag and new words every request: no prompt is another's cached prefix.
    return f"{tag}: " + " ".join(rng.choice(TINY_WORDS) for _ in range(n))


def ask(session: requests.Session, url: str, model: str, text: str, sample: Sample) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.7,
        "stream": True,
    }
    t0 = time.perf_counter()
    try:
        with session.post(
            url + "/v1/chat/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT_S
        ) as r:
            sample.parse_route(r.headers.get("x-residency-route", ""))
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return sample
            first: float | None = None
            # Read to the end of the body: the connection goes back to the session's pool.
            for raw in r.iter_lines():
                if first is not None or not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                    continue
                for choice in json.loads(raw[6:]).get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        first = time.perf_counter()
            sample.wait_s = (first if first is not None else time.perf_counter()) - t0
    except (requests.RequestException, ValueError) as e:
        sample.error = f"{type(e).__name__}: {e}"
    return sample


def client(
    url: str, mode: str, rnd: int, c: int, bursts: int, out: list[Sample], done: threading.Event
) -> None:
    # Seeded by round and client only: both modes see the same kinds and think times.
    plan = random.Random(1000 * rnd + c)
    words = random.Random(f"{mode}-{rnd}-{c}")
    with requests.Session() as session:
        for k in range(bursts):
            if done.is_set():
                return
            time.sleep(plan.uniform(*THINK_S))
            kind = "long" if plan.random() < P_LONG else "short"
            for j in range(plan.randint(*BURST)):
                text = prompt(f"{mode} round {rnd} client {c} burst {k}.{j}", kind, words)
                s = ask(session, url, policy_name(mode), text, Sample(mode, rnd, kind))
                out.append(s)


def run_mode(box: Box, mode: str, rnd: int, bursts: int, res: ModeResult) -> None:
    out: list[Sample] = []
    done = threading.Event()
    before = box.loads()
    t0 = time.perf_counter()
    threads = [
        threading.Thread(
            target=client, args=(box.url, mode, rnd, c, bursts, out, done), daemon=True
        )
        for c in range(CLIENTS)
    ]
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():  # a timed join: Ctrl-C gets through
                th.join(0.5)
    finally:
        done.set()
    res.seconds += time.perf_counter() - t0
    res.loads += box.loads() - before
    res.samples += out
    failed = [s for s in out if s.wait_s is None]
    waits = [s.wait_s for s in out if s.wait_s is not None]
    p99 = f"{percentile(waits, 0.99):.2f}" if waits else "-"
    print(
        f"round {rnd + 1} {mode}: {len(out)} requests, {len(failed)} failed, "
        f"p99 wait {p99} s, loads {box.loads() - before}",
        file=sys.stderr,
        flush=True,
    )
    for s in failed[:3]:
        print(f"  failed ({s.kind}): {s.error}", file=sys.stderr)


def warm_up(box: Box) -> tuple[float, float | None]:
    """Switch a, b, a, b (each switch a load with one model resident) and ask r: every
    candidate has a measured pace. Returns what a switch costs a client (its first request's
    wait less the median of the warm ones) and the mean of ``residency_model_load_seconds``."""
    cold: list[float] = []
    warm: list[float] = []
    with requests.Session() as session:
        for k, name in enumerate(("a", "b", "a", "b", "r")):
            for j, kind in enumerate(("short", "short", "long")):
                text = prompt(f"warm-up {k}.{j}", kind, random.Random(10 * k + j))
                s = ask(session, box.url, name, text, Sample("warm-up", -1, kind))
                if s.wait_s is None:
                    raise RuntimeError(f"warm-up request to {name} failed: {s.error}")
                if name != "r" and kind == "short":
                    (cold if j == 0 else warm).append(s.wait_s)
    switch_s = max(0.0, statistics.median(cold) - statistics.median(warm))
    return switch_s, box.load_time()


def prediction_error(box: Box, mode: str, res: ModeResult) -> dict[str, Any] | None:
    """The policy's error section on ``/health`` once the record counts every request of the
    run (its choices) and every one a local candidate served (its samples), or after
    ``HEALTH_WAIT_S`` the last one seen: the coordinator publishes it every ~10 s."""
    sent = len([s for s in res.samples if s.route])
    local = len([s for s in res.samples if s.wait_s is not None and s.candidate in ("a", "b")])
    deadline = time.monotonic() + HEALTH_WAIT_S
    error: dict[str, Any] | None = None
    while True:
        section = box.routing(policy_name(mode)) or {}
        got = section.get("error")
        if isinstance(got, dict):
            error = got
            choices = section.get("choices") or {}
            counted = sum(v for v in choices.values() if isinstance(v, int))
            if counted >= sent and int(section.get("samples") or 0) >= local:
                return error
        if time.monotonic() > deadline:
            return error
        time.sleep(1.0)


def run(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    paths = {
        "a": write_tiny_model(tmp / "tiny-a.gguf", seed=11),
        # A layer more: equivalent for the router, a little slower and larger.
        "b": write_tiny_model(tmp / "tiny-b.gguf", seed=12, shape=Shape(n_layer=TINY.n_layer + 1)),
        "r": write_tiny_model(tmp / "tiny-r.gguf", seed=13),
    }
    binary, why = find_llama_server(args.llama_server)
    if binary is None:
        raise SystemExit(f"routing bench: {why}")
    remote = Model("r", paths["r"], None, "{}", (TINY_WORDS,), TINY_WORDS)
    threads = max(1, (os.cpu_count() or 2) // 2)
    remote_url, _ = start_llama_server(binary, tmp, remote, SLOTS, threads, stack)
    (tmp / "box").mkdir()
    box = start_box(tmp / "box", paths, remote_url, stack)
    load_s, metric_load_s = warm_up(box)
    max_wait_s = max(1.0, MAX_WAIT_LOADS * load_s)
    print(
        f"a switch costs a client {load_s:.2f} s (residency_model_load_seconds mean "
        f"{metric_load_s or 0:.3f} s): fastest's max_wait_s = {max_wait_s:.2f}",
        file=sys.stderr,
    )

    results = {m: ModeResult() for m in MODES}
    for mode in MODES:
        problem = box.put_policy(policy_name(mode), policy(mode, max_wait_s))
        if problem and mode == "first":
            # A box without candidate lists yet: today's routing is `first`.
            legacy = box.put_policy(policy_name(mode), legacy_policy())
            if legacy:
                raise RuntimeError(f"the box refused the first policy: {problem}; {legacy}")
            results[mode].note = "one candidate per rule (the box refused candidate lists)"
        elif problem:
            results[mode].note = f"not run: the box refused the policy: {problem}"
            print(f"{mode}: {results[mode].note}", file=sys.stderr)
    modes = [m for m in MODES if not results[m].note.startswith("not run")]
    for rnd in range(args.rounds):
        for mode in modes if rnd % 2 == 0 else list(reversed(modes)):
            run_mode(box, mode, rnd, args.bursts, results[mode])
    for mode in modes:
        results[mode].error = prediction_error(box, mode, results[mode])
    routing = {m: box.routing(policy_name(m)) for m in modes}
    if args.samples is not None:
        # Every request's predicted and actual wait, for a look at which term is off.
        import redis

        from residency import keys

        r = redis.Redis(unix_socket_path=str(tmp / "box" / "data" / "redis" / "redis.sock"))
        dump = {
            m: [json.loads(x) for x in r.lrange(keys.route_samples(policy_name(m)), 0, -1)]
            for m in modes
        }
        args.samples.write_text(json.dumps(dump, indent=1))
    return {
        "results": results,
        "load_s": load_s,
        "metric_load_s": metric_load_s,
        "max_wait_s": max_wait_s,
        "routing": routing,
        "remote": f"llama-server ({binary}), {SLOTS} slots, {threads} threads",
    }


# --- the report --------------------------------------------------------------------------------


def median_rel(error: dict[str, Any] | None) -> float | None:
    v = (error or {}).get("median_rel")
    return float(v) if isinstance(v, int | float) else None


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISSED"


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    results: dict[str, ModeResult] = res["results"]
    lines = [
        f"Rounds: {args.rounds}, {CLIENTS} clients x {args.bursts} bursts of {BURST[0]}-{BURST[1]} "
        f"streamed chats ({MAX_TOKENS} tokens; {P_LONG:.0%} of bursts long prompts of "
        f"~{LONG_WORDS} words), the modes interleaved. {machine_facts()}",
        "",
        f"Candidates a, b (tiny models, b a layer deeper; {SLOTS} slots each, "
        f"`max_loaded_models = 1`, autosize off) and r (remote: {res['remote']}). "
        f"A switch between a and b cost a client {res['load_s']:.2f} s in the warm-up "
        f"(`residency_model_load_seconds` mean {res['metric_load_s'] or 0:.3f} s); "
        f"fastest's `max_wait_s` = {res['max_wait_s']:.2f} s, `evict_penalty_s` default.",
        "",
        "| choose | requests | failed | wait p50 | wait p99 | loads | a | b | r "
        "| prediction error (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        r = results[mode]
        if not r.samples:
            lines.append(f"| {mode} | {r.note or 'not run'} |" + " |" * 8)
            continue
        waits = r.waits
        p50 = f"{statistics.median(waits):.2f} s" if waits else "-"
        p99 = f"{percentile(waits, 0.99):.2f} s" if waits else "-"
        err = median_rel(r.error)
        cells = [mode, str(len(r.samples)), str(r.failed), p50, p99, str(r.loads)]
        cells += [f"{r.share(c):.0%}" for c in CANDIDATES]
        cells.append(f"{err:.0%}" if err is not None else "not published")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    first, fast = results["first"], results["fastest"]
    if first.waits and fast.waits:
        p99_ratio = percentile(fast.waits, 0.99) / max(percentile(first.waits, 0.99), 1e-9)
        p50_ratio = statistics.median(fast.waits) / max(statistics.median(first.waits), 1e-9)
        loads_ratio = fast.loads / first.loads if first.loads else float("inf")
        err = median_rel(fast.error)
        lines.append(f"fastest / first: p50 wait {p50_ratio:.2f}x, p99 wait {p99_ratio:.2f}x, ")
        lines[-1] += f"loads {fast.loads} / {first.loads} = {loads_ratio:.2f}x."
        lines.append("")
        lines.append(
            f"- p99 wait of fastest <= {TARGET_P99}x first: "
            f"{verdict(p99_ratio <= TARGET_P99)} ({p99_ratio:.2f}x)"
        )
        lines.append(
            f"- loads of fastest <= {TARGET_LOADS}x first: "
            f"{verdict(loads_ratio <= TARGET_LOADS)} ({loads_ratio:.2f}x)"
        )
        shown = f"{err:.0%}" if err is not None else "not published on /health"
        ok = err is not None and err <= TARGET_ERROR
        lines.append(
            f"- fastest's median relative prediction error <= {TARGET_ERROR:.0%}: "
            f"{verdict(ok)} ({shown})"
        )
    else:
        lines.append(f"fastest: {fast.note or 'no samples'}; no ratios.")
    lines.append("")
    for mode in MODES:
        r = results[mode]
        if not r.samples:
            continue
        reasons = ", ".join(f"{k} {v}" for k, v in r.reasons().items())
        cross = r.client_error()
        line = f"- {mode}: choices by reason: {reasons}"
        if cross is not None:
            line += (
                f"; median relative error of the header's prediction against the wait "
                f"measured by the client (HTTP included): {cross:.0%}"
            )
        if r.note:
            line += f"; {r.note}"
        lines.append(line)
    lines.append("")
    lines.append(f"Command: `{command_line()}`, {datetime.date.today().isoformat()}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--bursts", type=int, default=BURSTS, help="bursts a client, a round")
    ap.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} round of {QUICK_BURSTS} bursts"
    )
    ap.add_argument("--llama-server", type=Path, help="llama-server binary (the remote)")
    ap.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    ap.add_argument("--samples", type=Path, help="write every route sample (JSON) here")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.bursts = QUICK_ROUNDS, QUICK_BURSTS
    try:
        with cleanup() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-routing-")))
            res = run(args, tmp, stack)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    body = report(res, args)
    print(body)
    for mode, section in res["routing"].items():
        print(f"/health routing.{policy_name(mode)}: {json.dumps(section)[:1500]}", file=sys.stderr)
    if args.write:
        replace_section(
            ROOT / "docs" / "benchmarks.md",
            body,
            begin=BEGIN,
            end=END,
            title="Routing to what is loaded",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
