"""Where the box's CPU per token goes: every process of ``residency up`` sampled with py-spy
while bench/load.py's clients stream from it.

The box alone is started (bench/load.py's ``start_box``: ``--slots`` slots per model, the
same config), warmed, then for each model and client count, for each mode:

- ``cpu``: ``py-spy record --nonblocking --threads`` (idle threads not sampled): the share of
  the role's CPU each function holds; with the role's CPU per token from its ``/proc``
  counters over the same run (bench/cputime.py), a function's self share becomes its CPU
  milliseconds per token.
- ``wall``: the same with ``--idle``: where the threads sit, waiting included.

py-spy attaches to each Python process of the box at ``--rate`` samples a second (Redis is not
Python: only its CPU per token is shown; ``--roles`` samples only some, each py-spy costs
core time); ``--nonblocking`` reads the target without pausing
it, so the figures are the box's as it runs (py-spy's own CPU is not in the box's counters; it
does take core time from a busy machine). ``--native`` samples the model processes in blocking
mode with native frames (it pauses them at each sample: measured, it halves the tiny model's
tokens/s; llama.cpp's stripped libraries show as addresses; and threads waiting in a libc call
are sampled as busy, so its cpu-mode shares are not CPU shares).

Written to ``--out DIR``: ``summary.txt`` (per run: each role's CPU per token, its top
functions by self share, and for processes with several threads the share and top functions of
each thread group, numbered threads such as ``request_3`` taken together as ``request_*``),
and per run and role a flame graph ``DIR/<model>-<clients>c-<mode>/<role>.speedscope.json``
(open in https://www.speedscope.app; one profile per thread group) beside py-spy's raw
folded stacks under ``raw/``.

    .venv/bin/python bench/cpuprofile.py [--clients 8,32] [--models tiny] [--tokens 64]
        [--requests 8] [--slots 8] [--modes cpu,wall] [--rate 100] [--top 15] [--native]
        [--roles model,web] --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cputime
import load
import psutil
from overhead import cleanup

DEFAULT_PY_SPY = Path(sys.executable).with_name("py-spy")
ATTACH_S = 1.5  # py-spy's start and first samples, before the clients go
STOP_S = 30.0  # py-spy writes its file on SIGINT; the longest wait for it
FRAME_LINE = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
THREAD = re.compile(r"^thread \((?P<tid>[^)]*)\)(?::\s*(?P<name>.*))?$")
NUMBERED = re.compile(r"^(?P<base>.*?)([_-])\d+$")


# --- reading py-spy's folded stacks (pure) ----------------------------------------------------


@dataclass
class Profile:
    """Folded stacks of one role: each sample's frames, root first, by thread group."""

    stacks: Counter[tuple[str, tuple[str, ...]]] = field(default_factory=Counter)

    @property
    def samples(self) -> int:
        return sum(self.stacks.values())

    def add_raw(self, text: str, pid: int = 0) -> None:
        """py-spy's raw lines of process ``pid``: a thread without a name (gevent's patched
        main thread, for one) is named by its id, ``main <pid>`` where it is the main one."""
        for line in text.splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            group = "(all)"
            head = THREAD.match(frames[0])
            if head:
                name, tid = head.group("name"), head.group("tid")
                if name:
                    group = thread_group(name)
                else:
                    group = f"main {tid}" if tid == str(pid) else f"(unnamed) {tid}"
                frames = frames[1:]
            key = (group, tuple(function_of(f) for f in frames))
            self.stacks[key] += int(count)

    def groups(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (group, _), n in self.stacks.items():
            out[group] += n
        return out

    def functions(self, group: str | None = None) -> list[tuple[str, int, int]]:
        """(function, self samples, total samples) of the samples of ``group`` (all if None):
        self = the function is the sample's innermost frame; total = it is anywhere in the
        sample's stack (once per sample, however deep it recurs). Most self first."""
        own: Counter[str] = Counter()
        total: Counter[str] = Counter()
        for (g, frames), n in self.stacks.items():
            if group is not None and g != group:
                continue
            if frames:
                own[frames[-1]] += n
            for f in set(frames):
                total[f] += n
        return sorted(((f, own[f], total[f]) for f in total), key=lambda r: (-r[1], -r[2], r[0]))


def function_of(frame: str) -> str:
    """``func (file.py:123)`` -> ``func (file.py)``: a function's samples on any of its lines
    are its own."""
    m = FRAME_LINE.match(frame)
    return f"{m.group('func')} ({m.group('file')})" if m else frame


def thread_group(name: str) -> str:
    """``request_3`` -> ``request_*``: a pool's numbered threads are one group."""
    m = NUMBERED.match(name.strip())
    return f"{m.group('base')}{name.strip()[len(m.group('base'))]}*" if m else name.strip()


def speedscope(name: str, profile: Profile) -> dict[str, object]:
    """A speedscope file (its "sampled" profile type), one profile per thread group."""
    index: dict[str, int] = {}
    profiles = []
    for group, _ in profile.groups().most_common():
        samples, weights = [], []
        for (g, frames), n in sorted(profile.stacks.items()):
            if g != group:
                continue
            samples.append([index.setdefault(f, len(index)) for f in frames])
            weights.append(n)
        profiles.append(
            {
                "type": "sampled",
                "name": f"{name}: {group}",
                "unit": "none",
                "startValue": 0,
                "endValue": sum(weights),
                "samples": samples,
                "weights": weights,
            }
        )
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "name": name,
        "exporter": "residency bench/cpuprofile.py",
        "activeProfileIndex": 0,
        "shared": {"frames": [{"name": f} for f in index]},
        "profiles": profiles,
    }


def pct(n: int, of: int) -> str:
    return f"{100 * n / of:5.1f}%" if of else "    -"


def role_summary(
    role: str, profile: Profile, ms_per_token: float | None, top: int, cpu_mode: bool
) -> list[str]:
    """A role's lines: its samples and CPU per token, its top functions, and per thread group
    where it has several."""
    n = profile.samples
    head = f"{role}: {n} samples"
    if ms_per_token is not None:
        head += f", CPU {ms_per_token:.3f} ms/tok"
    lines = [head]
    if not n:
        return lines
    per_token = ms_per_token if cpu_mode else None
    lines += function_table(profile.functions(), n, top, per_token, "  ")
    groups = profile.groups()
    if len(groups) > 1:
        for group, gn in groups.most_common():
            share = f"  thread {group}: {pct(gn, n).strip()} of the samples"
            if per_token is not None:
                share += f", {per_token * gn / n:.3f} ms/tok"
            lines.append(share)
            lines += function_table(
                profile.functions(group), gn, min(top, 8), None, "    ", of_all=n
            )
    return lines


def function_table(
    rows: list[tuple[str, int, int]],
    n: int,
    top: int,
    ms_per_token: float | None,
    indent: str,
    of_all: int | None = None,
) -> list[str]:
    """Top ``top`` rows: self% and total% of the role's samples (``of_all``, else ``n``), and
    where the role's CPU per token is known the function's self ms/tok."""
    base = of_all or n
    head = f"{indent}{'self':>6} {'total':>6}" + (" self ms/tok" if ms_per_token else "")
    out = [head + "  function"]
    for func, own, total in rows[:top]:
        line = f"{indent}{pct(own, base)} {pct(total, base)}"
        if ms_per_token is not None:
            line += f" {ms_per_token * own / n:11.4f}"
        out.append(f"{line}  {func}")
    return out


# --- recording --------------------------------------------------------------------------------


def slug(role: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", role).strip("-").lower()


def is_python(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        exe = Path(psutil.Process(pid).exe()).name
        return exe.startswith("python")
    return False


@dataclass
class Recording:
    role: str
    pid: int
    out: Path
    proc: subprocess.Popen[bytes]
    log: Path


def start_recordings(
    py_spy: Path,
    roles: dict[int, str],
    raw: Path,
    rate: int,
    wall: bool,
    native: bool,
    only: list[str],
) -> list[Recording]:
    raw.mkdir(parents=True, exist_ok=True)
    recs = []
    for pid, role in sorted(roles.items()):
        if not is_python(pid) or (only and not any(o in role for o in only)):
            continue
        out = raw / f"{slug(role)}-{pid}.txt"
        args = [str(py_spy), "record", "--pid", str(pid), "--rate", str(rate)]
        args += ["--threads", "--format", "raw", "--output", str(out)]
        if native and role.startswith("model "):
            args.append("--native")  # blocking: py-spy takes native stacks only so
        else:
            args.append("--nonblocking")
        if wall:
            args.append("--idle")
        log = raw / f"{slug(role)}-{pid}.log"
        with log.open("wb") as fh:
            proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT)
        recs.append(Recording(role, pid, out, proc, log))
    return recs


def stop_recordings(recs: list[Recording]) -> list[str]:
    """SIGINT each py-spy (it writes its file then) and wait; the problems, one line each."""
    for r in recs:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGINT)
    problems = []
    deadline = time.monotonic() + STOP_S
    for r in recs:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
        if not r.out.exists():
            last = (r.log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            problems.append(f"  {r.role} (pid {r.pid}): py-spy wrote nothing: {last}")
    return problems


@contextlib.contextmanager
def recording(
    py_spy: Path, roles: dict[int, str], raw: Path, args: argparse.Namespace, wall: bool
) -> Iterator[list[Recording]]:
    recs = start_recordings(py_spy, roles, raw, args.rate, wall, args.native, args.roles)
    try:
        time.sleep(ATTACH_S)
        yield recs
    finally:
        problems = stop_recordings(recs)
        for line in problems:
            print(line, file=sys.stderr)


def profiles_by_role(recs: Iterable[Recording]) -> dict[str, Profile]:
    out: dict[str, Profile] = {}
    for r in recs:
        if r.out.exists():
            out.setdefault(r.role, Profile()).add_raw(r.out.read_text(errors="replace"), r.pid)
    return out


def one_run(
    py_spy: Path,
    target: load.Target,
    model: load.Model,
    clients: int,
    mode: str,
    first: int,
    args: argparse.Namespace,
) -> list[str]:
    """A profiled load run; its summary lines (and files under ``args.out``)."""
    name = f"{model.name}-{clients}c-{mode}"
    d = args.out / name
    if d.exists():
        shutil.rmtree(d)
    roles = load.role_map(target)
    load_before = os.getloadavg()[0]
    with recording(py_spy, roles, d / "raw", args, mode == "wall") as recs:
        run = load.metered_run(target, model, clients, args.requests, args.tokens, first)
        spy = cputime.snapshot({r.proc.pid: r.role for r in recs})
    spy_s = cputime.cpu_by_role({}, spy)
    profiles = profiles_by_role(recs)
    tokens = run.tokens
    errors = len(run.errors)
    lines = [
        f"== {model.name}, {clients} clients, {mode} "
        f"({'--idle: waiting included' if mode == 'wall' else 'CPU: idle threads not sampled'})"
        f": {tokens} tokens, {tokens / run.wall_s:.1f} tok/s, {errors} errors, "
        f"CPU {cputime.total_s(run.cpu_s) * 1000 / max(tokens, 1):.3f} ms/tok in all; "
        f"1-minute load average {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at "
        f"the end; py-spy's own CPU (not in the box's) from attach to the run's end: "
        f"{cputime.total_s(spy_s):.1f} s in all, "
        + ", ".join(f"{s:.1f} s on {role}" for role, s in sorted(spy_s.items())),
    ]
    for role, seconds in sorted(run.cpu_s.items(), key=lambda kv: (-kv[1], kv[0])):
        per = seconds * 1000 / tokens if tokens else None
        prof = profiles.get(role)
        if prof is None:
            lines.append(
                f"{role}: CPU {per or 0:.3f} ms/tok (not sampled: not Python, started during "
                "the run, or no sample)"
            )
            continue
        lines += role_summary(role, prof, per, args.top, mode == "cpu")
        path = d / f"{slug(role)}.speedscope.json"
        path.write_text(json.dumps(speedscope(f"{name} {role}", prof)))
    return lines


def run(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> list[str]:
    py_spy = args.py_spy
    models = [m for m in load.make_models(tmp, args.models == ["tiny"]) if m.name in args.models]
    print(f"starting box parallel={args.slots}", flush=True)
    clients = max(args.clients)
    target = load.start_box(f"box parallel={args.slots}", tmp, models, args.slots, clients, stack)
    load.warm(target, models, args.tokens)
    out = [
        f"bench/cpuprofile.py: box parallel={args.slots}, {args.requests} requests per client, "
        f"{args.tokens} max_tokens, py-spy {args.rate} Hz"
        f"{', --native on model processes (blocking)' if args.native else ', --nonblocking'}.",
        "self = share of the role's samples with the function innermost; total = with it "
        "anywhere on the stack; self ms/tok = the role's CPU per token (its /proc counters "
        "over the run) x self (cpu mode only).",
    ]
    first = 0
    for model in models:
        for c in args.clients:
            for mode in args.modes:
                print(f"  {model.name}: {c} clients, {mode}", flush=True)
                out += ["", *one_run(py_spy, target, model, c, mode, first, args)]
                first += c * args.requests
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the summary and graphs")
    ap.add_argument("--clients", type=load.client_counts, default=[8, 32], help="(8,32)")
    ap.add_argument("--models", type=lambda v: v.split(","), default=["tiny"], help="(tiny)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client (8)")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per request (64)")
    ap.add_argument("--slots", type=int, default=8, help="parallel slots per model (8)")
    ap.add_argument(
        "--modes",
        type=lambda v: v.split(","),
        default=["cpu", "wall"],
        help="cpu (idle threads not sampled), wall (--idle) or both (cpu,wall)",
    )
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second (100)")
    ap.add_argument("--top", type=int, default=15, help="functions per role (15)")
    ap.add_argument("--native", action="store_true", help="native frames on model processes")
    ap.add_argument(
        "--roles",
        type=lambda v: v.split(","),
        default=[],
        help="sample only the roles whose name holds one of these, e.g. model,web (all)",
    )
    ap.add_argument("--py-spy", type=Path, default=DEFAULT_PY_SPY, help=f"({DEFAULT_PY_SPY})")
    args = ap.parse_args(argv)
    if bad := [m for m in args.modes if m not in ("cpu", "wall")]:
        ap.error(f"--modes: unknown mode(s) {', '.join(bad)} (cpu, wall)")
    if not args.py_spy.is_file():
        ap.error(f"--py-spy: no py-spy at {args.py_spy}")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="residency-profile-") as tmp, cleanup() as stack:
            lines = run(args, Path(tmp), stack)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"profile failed: {e}", file=sys.stderr)
        return 1
    text = "\n".join(lines) + "\n"
    (args.out / "summary.txt").write_text(text)
    print(text)
    print(f"wrote {args.out}/summary.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
