"""Live limits: the admin API and enforcement while the pool is loading or busy.

One run, one box (``residency up``, tiny llama models t1..t4, ``[debug] fault_injection = true``
so a load can be made slow and a model busy on purpose):

1. PATCH latency: ``PATCH /admin/config`` (``pool.max_loaded_models`` toggled 4 <-> 5, nothing to
   evict) one after another, first with the box idle, then while a 20 s load of t4 is in flight
   (``load_delay_s``). A server that enforces inside the admin call (REFERENCE.md: "the admin
   config endpoint could block for the whole load timeout") answers only after the load: its
   latency is the rest of the load time.
2. Convergence, idle residents: four idle residents, the limit lowered 4 -> 1; time from the
   PATCH returning to ``/health`` showing at most one LLM resident. Repeated.
3. Convergence, all busy: three residents held busy (``hold``), the limit lowered 3 -> 1 (the
   shrink is deferred, nothing is killed), then the holds released at once; time from the last of
   the three responses arriving to ``/health`` showing at most one LLM resident. Repeated.
4. Coalescing: 20 PATCHes back to back (limits 4, 3, 2, ... ending at 2) with four idle
   residents; enforcement passes counted from ``residency_enforcement_passes_total`` (by
   trigger), and the end state checked against the last change.

    .venv/bin/python bench/control.py [--quick] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from alternation import metric_sum
from overhead import (
    REQUEST_TIMEOUT_S,
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

BEGIN = "<!-- control:begin -->"
END = "<!-- control:end -->"
NAMES = ("t1", "t2", "t3", "t4")
SLOW = "t4"
LOAD_DELAY_S = 20.0
PATCH_GAP_S = 0.05  # between two PATCHes of the latency phase
POLL_S = 0.005  # /health polling while timing convergence
SETTLE_TIMEOUT_S = 60.0
OCCUPYING = ("loading", "ready", "draining")
TARGET_PATCH_P99_MS = 50.0
TARGET_CONVERGE_S = 1.0
BURST = 20


class Box:
    """A running ``residency up`` and the HTTP calls this benchmark makes to it."""

    def __init__(self, url: str, admin_key: str) -> None:
        self.url = url
        self.s = requests.Session()
        self.admin = {"Authorization": f"Bearer {admin_key}"}

    def patch_limit(self, limit: int) -> float:
        """Seconds the PATCH took; raises unless it was accepted."""
        body = {"pool": {"max_loaded_models": limit}}
        t0 = time.perf_counter()
        r = self.s.patch(self.url + "/admin/config", json=body, headers=self.admin, timeout=60)
        took = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"PATCH max_loaded_models={limit}: {r.status_code} {r.text}")
        return took

    def faults(self, body: dict[str, Any]) -> None:
        r = self.s.post(self.url + "/admin/faults", json=body, headers=self.admin, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"POST /admin/faults {body}: {r.status_code} {r.text}")

    def health(self) -> dict[str, Any]:
        return dict(self.s.get(self.url + "/health", timeout=10).json())

    def chat(self, model: str) -> float:
        """One short chat request on its own connection; returns when its response arrived."""
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"chat {model}: {r.status_code} {r.text}")
        return time.perf_counter()

    def passes(self, trigger: str = "") -> float:
        label = f'trigger="{trigger}"' if trigger else ""
        return metric_sum(self.url, "residency_enforcement_passes_total", label)


def resident(h: dict[str, Any]) -> list[str]:
    return [m["name"] for m in h["models"] if m["type"] == "llm" and m["state"] in OCCUPYING]


def states(h: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["state"] for m in h["models"]}


def until(box: Box, pred: Callable[[dict[str, Any]], bool], what: str) -> float:
    """Poll /health until ``pred`` holds; the time it first did."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        if pred(box.health()):
            return time.perf_counter()
        time.sleep(POLL_S)
    raise RuntimeError(f"timed out waiting for {what}: {states(box.health())}")


def warm(box: Box, names: tuple[str, ...]) -> None:
    """Make ``names`` resident and idle, and let the coordinator publish that."""
    for n in names:
        box.chat(n)
    until(box, lambda h: set(names) <= {n for n in resident(h)}, f"{names} resident")


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # reported by the caller
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# --- the phases --------------------------------------------------------------------------------


@dataclass
class Results:
    idle_ms: list[float] = field(default_factory=list)
    loading_ms: list[float] = field(default_factory=list)
    load_s: float = 0.0
    converge_idle_s: list[float] = field(default_factory=list)
    converge_busy_s: list[float] = field(default_factory=list)
    deferred_seen: int = 0
    killed_while_busy: int = 0
    burst_passes: dict[str, float] = field(default_factory=dict)
    burst_end: str = ""
    notes: list[str] = field(default_factory=list)


def phase_patch_latency(box: Box, n: int, res: Results) -> None:
    print("PATCH latency: idle", flush=True)
    box.patch_limit(4)
    warm(box, NAMES[:3])
    for i in range(n):
        res.idle_ms.append(box.patch_limit(5 if i % 2 == 0 else 4) * 1000)
        time.sleep(PATCH_GAP_S)
    print(f"PATCH latency: during a {LOAD_DELAY_S:g} s load", flush=True)
    box.faults({"load_delay_s": {SLOW: LOAD_DELAY_S}})
    t0 = time.perf_counter()
    t, out = in_thread(lambda: box.chat(SLOW))
    until(box, lambda h: states(h).get(SLOW) == "loading", f"{SLOW} loading")
    i = 0
    while i < n and states(box.health()).get(SLOW) == "loading":
        res.loading_ms.append(box.patch_limit(5 if i % 2 == 0 else 4) * 1000)
        i += 1
        time.sleep(PATCH_GAP_S)
    box.patch_limit(4)
    t.join(REQUEST_TIMEOUT_S)
    if not out or isinstance(out[0], Exception):
        raise RuntimeError(f"the slow request failed: {out}")
    res.load_s = out[0] - t0
    box.faults({"load_delay_s": {SLOW: 0}})
    if len(res.loading_ms) < n:
        res.notes.append(
            f"- the load ended after {len(res.loading_ms)} of {n} PATCHes during the load"
        )


def phase_converge_idle(box: Box, rounds: int, res: Results) -> None:
    print("convergence: idle residents", flush=True)
    for _ in range(rounds):
        box.patch_limit(4)
        warm(box, NAMES)
        box.patch_limit(1)
        t0 = time.perf_counter()
        t1 = until(box, lambda h: len(resident(h)) <= 1, "the pool within 1")
        res.converge_idle_s.append(t1 - t0)


def phase_converge_busy(box: Box, rounds: int, res: Results) -> None:
    print("convergence: all residents busy", flush=True)
    held = NAMES[:3]
    for _ in range(rounds):
        box.patch_limit(3)
        warm(box, held)
        until(box, lambda h: len(resident(h)) <= 3, "the pool within 3")
        box.faults({"hold": dict.fromkeys(held, True)})
        calls = [in_thread(lambda n=n: box.chat(n)) for n in held]
        until(
            box,
            lambda h: all(m["busy"] for m in h["models"] if m["name"] in held),
            "all three busy",
        )
        box.patch_limit(1)
        until(box, lambda h: bool(h.get("enforcement", {}).get("blocked")), "shrink deferred")
        res.deferred_seen += 1
        time.sleep(0.5)  # the deferral holds: nothing busy is evicted meanwhile
        if len(resident(box.health())) < 3:
            res.killed_while_busy += 1
        box.faults({"hold": dict.fromkeys(held, False)})
        t1 = until(box, lambda h: len(resident(h)) <= 1, "the pool within 1")
        ends = []
        for t, out in calls:
            t.join(REQUEST_TIMEOUT_S)
            if not out or isinstance(out[0], Exception):
                raise RuntimeError(f"a held request failed: {out}")
            ends.append(out[0])
        res.converge_busy_s.append(t1 - max(ends))


def phase_burst(box: Box, res: Results) -> None:
    print(f"coalescing: {BURST} PATCHes back to back", flush=True)
    box.patch_limit(4)
    warm(box, NAMES)
    time.sleep(1.0)  # let the passes those loads caused finish before counting
    before = {t: box.passes(t) for t in ("config", "timer", "")}
    values = [4 - (i % 3) for i in range(BURST - 1)] + [2]
    for v in values:
        box.patch_limit(v)
    until(box, lambda h: len(resident(h)) <= 2, "the pool within 2")
    # Counted once the triggered passes stop (the unloads the shrink causes trigger their own);
    # the periodic pass (every 0.5 s with nothing to do) goes on and is counted apart.
    last = -1.0
    while (now := box.passes() - box.passes("timer")) != last:
        last = now
        time.sleep(1.0)
    after = {t: box.passes(t) for t in before}
    res.burst_passes = {t or "all": after[t] - before[t] for t in before}
    h = box.health()
    eff = h["max_models"]["llm"]["effective"]
    res.burst_end = (
        f"last change 2; /health effective LLM limit {eff}, {len(resident(h))} LLM resident(s)"
    )


# --- the report --------------------------------------------------------------------------------


def ms(v: float) -> str:
    return f"{v:.1f}"


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


@dataclass
class Report:
    rows: list[list[str]]
    verdicts: list[str]
    notes: list[str]

    def text(self) -> str:
        widths = [max(len(r[i]) for r in self.rows) for i in range(len(self.rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in self.rows]
        return "\n".join([*lines, "", "targets:", *self.verdicts, "", *self.notes])

    def markdown(self) -> str:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        head, *body = self.rows
        table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        table += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(
            [
                f"Measured {now} on {machine_facts()}.",
                "",
                f"Command: `{command_line()}`",
                "",
                *table,
                "",
                "Targets:",
                "",
                *self.verdicts,
                "",
                "Notes:",
                "",
                *self.notes,
            ]
        )


def report(res: Results) -> Report:
    idle_p50, idle_p99 = percentile(res.idle_ms, 0.50), percentile(res.idle_ms, 0.99)
    load_p50, load_p99 = percentile(res.loading_ms, 0.50), percentile(res.loading_ms, 0.99)
    ci, cb = res.converge_idle_s, res.converge_busy_s
    config_passes = res.burst_passes.get("config", 0.0)
    all_passes = res.burst_passes.get("all", 0.0) - res.burst_passes.get("timer", 0.0)
    rows = [
        ["measurement", "n", "p50", "p99 / max", "ratio"],
        ["PATCH, box idle (ms)", str(len(res.idle_ms)), ms(idle_p50), ms(idle_p99), "1.00"],
        [
            f"PATCH during a {LOAD_DELAY_S:g} s load (ms)",
            str(len(res.loading_ms)),
            ms(load_p50),
            ms(load_p99),
            f"{load_p99 / idle_p99:.2f}x idle p99; {load_p99 / 1000 / res.load_s:.4f}x the load",
        ],
        [
            "PATCH 4 -> 1 to pool within limit, idle (ms)",
            str(len(ci)),
            ms(percentile(ci, 0.50) * 1000),
            ms(max(ci) * 1000),
            f"{max(ci) / TARGET_CONVERGE_S:.2f}x target",
        ],
        [
            "last busy response to pool within limit (ms)",
            str(len(cb)),
            ms(percentile(cb, 0.50) * 1000),
            ms(max(cb) * 1000),
            f"{max(cb) / TARGET_CONVERGE_S:.2f}x target",
        ],
        [
            f"enforcement passes for {BURST} PATCHes",
            str(BURST),
            f"{config_passes:.0f} config",
            f"{all_passes:.0f} triggered",
            f"{config_passes / BURST:.2f} per change",
        ],
    ]
    verdicts = [
        f"- PATCH p99 while a {LOAD_DELAY_S:g} s load is in flight = {load_p99:.1f} ms "
        f"(target ≤ {TARGET_PATCH_P99_MS:g} ms: {verdict(load_p99 <= TARGET_PATCH_P99_MS)}); "
        f"the load itself took {res.load_s:.1f} s",
        f"- from the PATCH returning to the pool within its limit, idle residents: worst "
        f"{max(ci) * 1000:.0f} ms (target ≤ {TARGET_CONVERGE_S * 1000:.0f} ms: "
        f"{verdict(max(ci) <= TARGET_CONVERGE_S)})",
        f"- from the last busy request ending to the pool within its limit: worst "
        f"{max(cb) * 1000:.0f} ms (target ≤ {TARGET_CONVERGE_S * 1000:.0f} ms: "
        f"{verdict(max(cb) <= TARGET_CONVERGE_S)}); shrink seen deferred in "
        f"{res.deferred_seen}/{len(cb)} rounds, a busy resident evicted in "
        f"{res.killed_while_busy}",
        f"- a burst of {BURST} changes: {config_passes:.0f} pass(es) triggered by config, "
        f"{all_passes:.0f} triggered by anything (a reconcile per change would be {BURST}); "
        f"{res.burst_end}",
    ]
    notes = [
        "- a server that enforces inside the admin call answers it after the load: its PATCH "
        f"latency is the rest of the load, up to {res.load_s:.1f} s here (1.00x the load)",
        "- 'triggered' passes also count those run on the unload events the shrink causes; the "
        "periodic pass (every 0.5 s when nothing happens) is left out",
        *res.notes,
    ]
    return Report(rows, verdicts, notes)


def box_toml(path: Path, port: int, models: dict[str, Path]) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import write_config  # the test suite's TOML writer

    return write_config(
        path,
        {
            "server": {"port": port, "web_workers": 1},
            "pool": {"max_loaded_models": 4},
            "debug": {"fault_injection": True},
            "models": {n: {"path": str(p), "n_ctx": 512} for n, p in models.items()},
        },
    )


def run(tmp: Path, quick: bool) -> Report:
    models = {n: write_tiny_model(tmp / f"{n}.gguf", seed=i) for i, n in enumerate(NAMES)}
    port = free_port()
    cfg = box_toml(tmp / "box.toml", port, models)
    data = tmp / "data"
    res = Results()
    with contextlib.ExitStack() as stack:
        up_box(cfg, data, tmp / "residency.log", stack)
        box = Box(f"http://127.0.0.1:{port}", (data / "admin.key").read_text().strip())
        phase_patch_latency(box, 50 if quick else 200, res)
        phase_converge_idle(box, 2 if quick else 10, res)
        phase_converge_busy(box, 2 if quick else 10, res)
        phase_burst(box, res)
    return report(res)


def write_section(path: Path, body: str) -> None:
    replace_section(path, body, begin=BEGIN, end=END, title="Live limits")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer PATCHes and rounds")
    ap.add_argument("--out", type=Path, help="rewrite this file's control section")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="residency-control-") as tmp, cleanup():
            rep = run(Path(tmp), args.quick)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    print(rep.text())
    if args.out:
        write_section(args.out, rep.markdown())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
