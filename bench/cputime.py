"""CPU time of a set of processes over a window, by role, from their own kernel counters.

A snapshot reads ``/proc/PID/stat`` of each process: utime + stime (all its threads) and
cutime + cstime (its children it has waited for, theirs included). The window's CPU of one
process is the difference of its two readings, own and children's together, so that a child
that starts and ends inside the window (a per-request child) is counted through the parent
that reaps it. A process is known by pid and start time (a reused pid is another process):

- alive at both snapshots: after - before;
- only in the second: all its time (it started inside the window);
- only in the first: its time up to the first snapshot is taken back from the nearest
  ancestor alive at the second (whose children's counters now hold its whole time), under that
  ancestor's role; with no such ancestor its time in the window is not seen at all.

The counters tick at ``SC_CLK_TCK`` (100 Hz): a window should hold many ticks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    start: int  # clock ticks after boot: with the pid, who the process is
    own: int  # utime + stime, clock ticks
    children: int  # cutime + cstime of reaped children, clock ticks

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)

    @property
    def total(self) -> int:
        return self.own + self.children


def parse_stat(text: str) -> ProcStat:
    """One ``/proc/PID/stat`` line. The command name (field 2) sits in parentheses and may
    itself hold spaces and parentheses: the fields after it are split from its last ``)``."""
    pid = int(text[: text.index(" ")])
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state): field n is rest[n - 3].
    utime, stime, cutime, cstime = (int(rest[n - 3]) for n in (14, 15, 16, 17))
    return ProcStat(pid, int(rest[1]), int(rest[22 - 3]), utime + stime, cutime + cstime)


Snapshot = dict[tuple[int, int], tuple[ProcStat, str]]  # (pid, start) -> its reading, role


def snapshot(roles: Mapping[int, str], proc: Path = PROC) -> Snapshot:
    """The readings of the processes in ``roles`` (pid -> role); one gone already is left out."""
    out: Snapshot = {}
    for pid, role in roles.items():
        with contextlib.suppress(OSError, ValueError, IndexError):
            st = parse_stat((proc / str(pid) / "stat").read_text())
            out[st.key] = (st, role)
    return out


def cpu_by_role(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds spent in the window between the two snapshots, by role (see the module's
    docstring for processes present at one snapshot only)."""
    ticks: dict[str, int] = {}
    for key, (st, role) in after.items():
        was = before.get(key)
        ticks[role] = ticks.get(role, 0) + st.total - (was[0].total if was else 0)
    by_pid = {st.pid: st for st, _ in before.values()}
    alive = {st.pid: role for st, role in after.values()}
    for key, (st, _role) in before.items():
        if key in after:
            continue
        heir = _alive_ancestor(st, by_pid, alive)
        if heir is not None:
            ticks[alive[heir]] = ticks.get(alive[heir], 0) - st.total
    return {role: t * TICK_S for role, t in ticks.items()}


def _alive_ancestor(
    st: ProcStat, by_pid: Mapping[int, ProcStat], alive: Mapping[int, str]
) -> int | None:
    seen: set[int] = set()
    pid = st.ppid
    while pid not in alive:
        parent = by_pid.get(pid)
        if parent is None or pid in seen:
            return None
        seen.add(pid)
        pid = parent.ppid
    return pid


def total_s(by_role: Mapping[str, float]) -> float:
    return sum(by_role.values())


def add(into: dict[str, float], more: Iterable[tuple[str, float]]) -> dict[str, float]:
    for role, s in more:
        into[role] = into.get(role, 0.0) + s
    return into
