"""bench/load.py's CPU column and bench/cputime.py: a /proc stat line read, CPU over a window
from two snapshots (processes present at one only included), CPU per token by role, and the
target lines; and the bench's box and its --model: the config it writes is one the box accepts
and serves without keys (its clients send none), and an external GGUF is served under its
file's name."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest
from pytest import approx

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import cputime  # noqa: E402
import load  # noqa: E402

from residency import settings  # noqa: E402

TICK = cputime.TICK_S


def stat_line(pid: int, ppid: int, start: int, ut: int, st: int, cut: int, cst: int) -> str:
    """A /proc/PID/stat line as the kernel writes it (52 fields), with a command name that has
    spaces and parentheses in it."""
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(ut), str(st), str(cut), str(cst)]
    fields += ["20", "0", "4", "0", str(start)] + ["0"] * 30
    return f"{pid} (gunicorn: worker (web)) " + " ".join(fields) + "\n"


def snap(*procs: tuple[int, int, int, int, int, str]) -> cputime.Snapshot:
    """(pid, ppid, start, own ticks, children's ticks, role) -> a snapshot."""
    out: cputime.Snapshot = {}
    for pid, ppid, start, own, children, role in procs:
        st = cputime.ProcStat(pid, ppid, start, own, children)
        out[st.key] = (st, role)
    return out


def test_a_stat_line_is_split_after_the_last_parenthesis_of_the_command_name() -> None:
    st = cputime.parse_stat(stat_line(4321, 17, 99_000, 50, 7, 30, 3))
    assert st == cputime.ProcStat(4321, 17, 99_000, 57, 33)
    assert st.total == 90


def test_a_snapshot_of_this_process_reads_the_kernel_fields_psutil_reads() -> None:
    me = psutil.Process()
    low = sum(me.cpu_times()[:2])
    shot = cputime.snapshot({os.getpid(): "me", 2**22 + 12345: "gone"})
    high = sum(me.cpu_times()[:2])
    [(st, role)] = shot.values()  # the pid that is not there is left out
    assert role == "me" and st.pid == os.getpid() and st.ppid == os.getppid()
    assert low - TICK <= st.own * TICK <= high + TICK
    boot = psutil.boot_time()
    assert st.start * TICK + boot == approx(me.create_time(), abs=2 * TICK + 1)


def test_cpu_over_a_window_counts_new_processes_whole_and_gone_ones_through_their_parent() -> None:
    before = snap(
        (10, 1, 5, 100, 0, "web"),
        (11, 10, 6, 40, 0, "web"),  # a worker that the master reaps inside the window
        (20, 1, 7, 500, 0, "model tiny"),
        (30, 1, 8, 9, 0, "redis"),  # its pid is reused by a newer process below
    )
    after = snap(
        (10, 1, 5, 103, 70, "web"),  # the reaped worker's whole time: 40 + 30 in the window
        (12, 10, 50, 25, 0, "web"),  # the new worker, started in the window
        (20, 1, 7, 800, 0, "model tiny"),
        (30, 1, 60, 4, 0, "redis"),  # another process with pid 30: all of it counts
    )
    got = cputime.cpu_by_role(before, after)
    assert got == {
        "web": approx((3 + 70 + 25 - 40) * TICK),
        "model tiny": approx(300 * TICK),
        "redis": approx(4 * TICK),
    }
    assert cputime.total_s(got) == approx((58 + 300 + 4) * TICK)


def test_a_gone_process_whose_ancestors_are_all_gone_is_not_seen() -> None:
    before = snap((11, 10, 6, 40, 0, "web"), (10, 1, 5, 1, 0, "web"), (20, 1, 7, 5, 0, "agent"))
    after = snap((20, 1, 7, 6, 0, "agent"))
    assert cputime.cpu_by_role(before, after) == {"agent": approx(TICK)}


def summary(tok_s: float, ttft_p99: float, tokens: int, cpu: dict[str, float]) -> load.Summary:
    return load.Summary(
        rounds=2,
        requests=16,
        tokens_per_s=tok_s,
        ttft_p50_ms=ttft_p99 / 2,
        ttft_p99_ms=ttft_p99,
        tbt_p99_ms=1.0,
        tokens_per_request=64.0,
        errors=[],
        resent=0,
        tokens=tokens,
        cpu_s=cpu,
    )


def test_runs_sum_cpu_by_role_and_tokens_over_rounds() -> None:
    a = load.Run(1.0, [load.Stream(0.0, times=[0.1] * 100)], {"web": 0.5, "model tiny": 1.0})
    b = load.Run(1.0, [load.Stream(0.0, times=[0.1] * 300)], {"web": 0.3, "redis": 0.2})
    s = load.summarize([a, b])
    assert s.tokens == 400
    assert s.cpu_s == {"web": approx(0.8), "model tiny": 1.0, "redis": 0.2}
    assert s.cpu_ms_per_token == approx(2000 / 400)


def test_cpu_columns_and_per_role_rows() -> None:
    box = summary(900.0, 50.0, 1000, {"web": 1.0, "model tiny": 2.0, "redis": 0.0})
    peer = summary(1000.0, 40.0, 1000, {"llama-server tiny": 2.0})
    results: load.Results = {("tiny", 8): {"box": box, "llama-server": peer}}
    rows = load.load_rows(results, "llama-server")
    cols = load.LOAD_COLUMNS
    box_row = dict(zip(cols, rows[0], strict=True))
    peer_row = dict(zip(cols, rows[1], strict=True))
    assert box_row["CPU ms/tok"] == "3.000" and box_row["CPU x server"] == "1.500"
    assert peer_row["CPU ms/tok"] == "2.000" and peer_row["CPU x server"] == "-"
    assert load.cpu_rows(results) == [
        ["tiny", "8", "box", "model tiny", "2.000"],
        ["tiny", "8", "box", "web", "1.000"],
        ["tiny", "8", "box", "redis", "0.000"],
        ["tiny", "8", "llama-server", "llama-server tiny", "2.000"],
    ]


def test_the_targets_print_each_miss_with_its_figure() -> None:
    tiny = load.Model("tiny", Path("t.gguf"), None, "{}", (("a",),), ("a",))
    gemma = load.Model("gemma", Path("g.gguf"), "gemma", "{}", (("a",),), ("a",))
    results: load.Results = {}
    for c in (1, 8, 32, 64):  # tiny: 0.95x tokens/s (met, goal not reached), 1.6x the CPU
        results[("tiny", c)] = {
            "box": summary(950.0, 10.0, 1000, {"web": 1.6}),
            "llama-server": summary(1000.0, 10.0, 1000, {"llama-server tiny": 1.0}),
        }
    results[("gemma", 1)] = {
        "box": summary(96.0, 10.0, 100, {"web": 1.0}),
        "llama-server": summary(100.0, 10.0, 100, {"llama-server gemma": 1.0}),
    }
    results[("gemma", 8)] = {
        "box": summary(100.0, 130.0, 100, {"web": 1.0}),
        "llama-server": summary(100.0, 100.0, 100, {"llama-server gemma": 1.0}),
    }
    lines = load.load_verdicts(results, [gemma, tiny], "box", "llama-server")
    assert lines[:4] == [
        "- gemma, 1 client, tokens/s, box / llama-server: 0.960x (target ≥ 0.95x: met)",
        "- gemma, 8 clients, tokens/s, box / llama-server: 1.000x (target ≥ 0.95x: met)",
        "- gemma, 8 clients, p99 TTFT, box / llama-server: 1.300x (target ≤ 1.2x: MISSED)",
        "- gemma, 64 clients, errors: not measured (not run)",
    ]
    for c, at in zip((1, 8, 32, 64), range(4, 12, 2), strict=True):
        clients = "1 client" if c == 1 else f"{c} clients"
        assert lines[at : at + 2] == [
            f"- tiny, {clients}, tokens/s, box / llama-server: 0.950x "
            "(target ≥ 0.9x: met; goal ≥ 1x: not reached)",
            f"- tiny, {clients}, CPU per token, box / llama-server: 1.600x (target ≤ 1.5x: MISSED)",
        ]
    assert lines[12] == "- tiny, 64 clients, box errors: 0 of 16 (target 0: met)"
    assert len(lines) == 13


def test_the_bench_box_needs_no_key_and_serves_the_given_model(tmp_path: Path) -> None:
    model = load.external_model(tmp_path / "bench-1b.gguf")
    assert model.name == "bench-1b" and model.chat_format is None
    cfg = load.box_toml(tmp_path / "box.toml", 8123, [model], slots=32, clients=64)
    s = settings.build(settings.read_file(cfg))
    assert s.auth.required is False
    assert s.server.port == 8123
    spec = s.models["bench-1b"]
    assert spec.path == str(tmp_path / "bench-1b.gguf")
    assert spec.parallel == 32 and spec.n_ctx == load.N_CTX
    assert s.server.web_threads >= 64  # every client's stream held at once


def test_a_model_file_named_like_a_builtin_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        load.main(["--model", str(tmp_path / "tiny.gguf")])
