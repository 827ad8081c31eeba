"""What Ollama's dialect adds to a request: ``/api/chat`` against ``/v1/chat/completions`` on
the same box (``residency up``), the same tiny model, the same prompt, ``max_tokens`` /
``num_predict``, seed and temperature 0, whole and streamed.

Requests are sequential and interleaved (chat, ollama, chat, ollama, ...) so that background
load on a shared machine hits both alike; the figure is the difference of the medians of each
request's whole time (a stream read to its end). Nothing here asserts a time: the figures are
printed (and written to a markdown section with ``--out``) next to the target.

    .venv/bin/python bench/ollama.py [--requests 200] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import requests
from overhead import (
    ROOT,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    replace_section,
    up_box,
)

BEGIN = "<!-- ollama:begin -->"
END = "<!-- ollama:end -->"
TARGET_MS = 0.5  # added median latency of /api/chat against /v1/chat/completions
MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Why is the sky blue? Answer briefly."}]


def openai_call(s: requests.Session, url: str, stream: bool) -> Callable[[], int]:
    body = {
        "model": "a",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 1,
        "stream": stream,
    }

    def call() -> int:
        with s.post(url + "/v1/chat/completions", json=body, stream=stream, timeout=120) as r:
            r.raise_for_status()
            return sum(len(c) for c in r.iter_content(None)) if stream else len(r.content)

    return call


def ollama_call(s: requests.Session, url: str, stream: bool) -> Callable[[], int]:
    body = {
        "model": "a",
        "messages": MESSAGES,
        "options": {"num_predict": MAX_TOKENS, "temperature": 0, "seed": 1},
        "stream": stream,
    }

    def call() -> int:
        with s.post(url + "/api/chat", json=body, stream=stream, timeout=120) as r:
            r.raise_for_status()
            return sum(len(c) for c in r.iter_content(None)) if stream else len(r.content)

    return call


def interleaved(calls: dict[str, Callable[[], int]], n: int) -> dict[str, list[float]]:
    """Milliseconds of each call, ``n`` rounds of one call of each, in turn; the order flips
    each round, so neither always follows the other (the model process may still be tidying
    up after the request before)."""
    out: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for i in range(n):
        for name in names if i % 2 == 0 else names[::-1]:
            call = calls[name]
            t0 = time.perf_counter()
            call()
            out[name].append((time.perf_counter() - t0) * 1000)
    return out


def run(n: int, tmp: Path) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from residency.tinymodel import write_tiny_model
    from tests.conftest import write_config

    model = tmp / "tiny.gguf"
    write_tiny_model(model, seed=0, dtype="f32")
    port = free_port()
    cfg = write_config(
        tmp / "box.toml",
        {
            "server": {"port": port, "web_workers": 1},
            "auth": {"required": False},
            "models": {"a": {"path": str(model), "n_ctx": 512, "parallel": 1}},
        },
    )
    rows = [
        "| request | /v1/chat/completions median ms | /api/chat median ms | added ms | target |",
        "|---|---|---|---|---|",
    ]
    with contextlib.ExitStack() as stack:
        up_box(cfg, tmp / "data", tmp / "residency.log", stack)
        url = f"http://127.0.0.1:{port}"
        s = requests.Session()
        stack.callback(s.close)
        for stream in (False, True):
            calls = {"chat": openai_call(s, url, stream), "ollama": ollama_call(s, url, stream)}
            interleaved(calls, max(5, n // 10))  # warm: the load, caches, connections
            ms = interleaved(calls, n)
            chat, oll = statistics.median(ms["chat"]), statistics.median(ms["ollama"])
            added = oll - chat
            verdict = "met" if added <= TARGET_MS else "MISSED"
            rows.append(
                f"| {'streamed' if stream else 'whole'} | {chat:.2f} | {oll:.2f} | "
                f"{added:+.2f} | ≤ {TARGET_MS} ms: {verdict} |"
            )
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per API and mode")
    ap.add_argument("--out", type=Path, help="markdown file whose ollama section is rewritten")
    args = ap.parse_args(argv)
    with cleanup(), tempfile.TemporaryDirectory(prefix="residency-bench-") as d:
        rows = run(args.requests, Path(d))
    print("\n".join(rows))
    if args.out:
        body = "\n".join(
            [
                machine_facts(),
                "",
                f"`{command_line()}`",
                "",
                f"Sequential, interleaved requests on a tiny model, {MAX_TOKENS} tokens each; "
                "the figure is the difference of the medians.",
                "",
                *rows,
            ]
        )
        replace_section(args.out, body, begin=BEGIN, end=END, title="Ollama API overhead")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
