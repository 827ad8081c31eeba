"""bench/cpuprofile.py's pure parts: py-spy's folded stacks read by thread group and function,
self and total shares, the summary lines and the speedscope file."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import cpuprofile as cp  # noqa: E402

# As `py-spy record --threads --format raw` writes it: the thread first, root frame next.
RAW = """\
thread (101): engine;Thread.run (threading.py:982);Engine._step (workers/engine.py:40);LlamaBackend.decode (workers/runtime.py:88) 60
thread (101): engine;Thread.run (threading.py:982);Engine._step (workers/engine.py:41);LlamaBackend.decode (workers/runtime.py:90) 10
thread (102): request_0;Thread.run (threading.py:982);Job.next (workers/engine.py:12) 12
thread (103): request_7;Thread.run (threading.py:982);walk (a.py:1);walk (a.py:2);walk (a.py:3) 8
thread (104);<module> (x.py:1);SocketMixin.send (gevent/_socketcommon.py:700) 10
not a sample line
"""  # noqa: E501


def profile() -> cp.Profile:
    p = cp.Profile()
    p.add_raw(RAW, pid=104)  # thread 104, without a name, is that process's main thread
    return p


def test_numbered_threads_are_one_group_and_lines_of_a_function_are_one_function() -> None:
    p = profile()
    assert p.samples == 100
    assert p.groups() == {"engine": 70, "request_*": 20, "main 104": 10}
    other = cp.Profile()
    other.add_raw(RAW, pid=7)
    assert other.groups()["(unnamed) 104"] == 10
    assert cp.thread_group("ThreadPoolExecutor-0_3") == "ThreadPoolExecutor-0_*"
    assert cp.thread_group("MainThread") == "MainThread"
    assert (
        cp.function_of("Engine._step (workers/engine.py:40)") == "Engine._step (workers/engine.py)"
    )
    assert cp.function_of("<module> (<frozen runpy>)") == "<module> (<frozen runpy>)"


def test_self_is_the_innermost_frame_and_total_counts_a_recursing_function_once() -> None:
    funcs = {f: (own, total) for f, own, total in profile().functions()}
    assert funcs["LlamaBackend.decode (workers/runtime.py)"] == (70, 70)
    assert funcs["Thread.run (threading.py)"] == (0, 90)
    assert funcs["walk (a.py)"] == (8, 8)  # three deep in 8 samples: 8, not 24
    assert sum(own for own, _ in funcs.values()) == 100
    first, *_ = profile().functions()
    assert first[0] == "LlamaBackend.decode (workers/runtime.py)"
    by_group = {f: (own, total) for f, own, total in profile().functions("request_*")}
    assert by_group == {
        "Job.next (workers/engine.py)": (12, 12),
        "walk (a.py)": (8, 8),
        "Thread.run (threading.py)": (0, 20),
    }


def test_a_role_summary_turns_self_shares_into_cpu_per_token() -> None:
    lines = cp.role_summary("model tiny", profile(), 2.0, 2, cpu_mode=True)
    assert lines[0] == "model tiny: 100 samples, CPU 2.000 ms/tok"
    assert lines[1].split() == ["self", "total", "self", "ms/tok", "function"]
    assert lines[2].split() == [
        "70.0%",
        "70.0%",
        "1.4000",
        "LlamaBackend.decode",
        "(workers/runtime.py)",
    ]
    assert lines[3].split()[:3] == ["12.0%", "12.0%", "0.2400"]
    assert (
        len([ln for ln in lines if ln.startswith("    ") and "%" in ln and "ms/tok" not in ln]) > 0
    )
    groups = [ln.strip() for ln in lines if ln.strip().startswith("thread ")]
    assert groups == [
        "thread engine: 70.0% of the samples, 1.400 ms/tok",
        "thread request_*: 20.0% of the samples, 0.400 ms/tok",
        "thread main 104: 10.0% of the samples, 0.200 ms/tok",
    ]
    wall = cp.role_summary("model tiny", profile(), 2.0, 2, cpu_mode=False)
    assert "ms/tok" not in wall[1] and not any(g.endswith("ms/tok") for g in wall[1:])


def test_the_speedscope_file_has_one_sampled_profile_per_thread_group() -> None:
    doc = cp.speedscope("tiny-8c-cpu model tiny", profile())
    frames = [f["name"] for f in doc["shared"]["frames"]]  # type: ignore[index]
    profiles = doc["profiles"]
    assert [p["name"] for p in profiles] == [  # type: ignore[attr-defined]
        "tiny-8c-cpu model tiny: engine",
        "tiny-8c-cpu model tiny: request_*",
        "tiny-8c-cpu model tiny: main 104",
    ]
    engine = profiles[0]  # type: ignore[index]
    assert engine["weights"] == [70] and engine["endValue"] == 70
    [stack] = engine["samples"]
    assert [frames[i] for i in stack] == [
        "Thread.run (threading.py)",
        "Engine._step (workers/engine.py)",
        "LlamaBackend.decode (workers/runtime.py)",
    ]
    assert len(frames) == len(set(frames))
