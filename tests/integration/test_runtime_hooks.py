"""A request's hooks through the runtime on real llama.cpp (the tiny GGUF): the per-token hook
and usage reach a chat handler's completions however late the handler makes them, and every
engine step of a request's slot — its prompt's chunks included — is progress."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from residency.settings import ModelSpec
from workers.runtime import LlamaRuntime


def test_a_chat_handler_that_completes_inside_its_stream_keeps_the_hooks(
    models_dir: Path,
) -> None:
    """functionary-v2's handler streams from a generator that calls ``create_completion`` only
    when its first chunk is asked for — after ``chat`` returned."""
    rt = LlamaRuntime()
    rt.load(ModelSpec(path=str(models_dir / "tiny0.gguf"), n_ctx=512, parallel=1), "cpu")
    try:
        llm = rt.llm
        prompt = llm.tokenize(b"hello there", add_bos=True, special=True)

        def lazy_handler(**_: Any) -> Iterator[dict[str, Any]]:
            out = llm.create_completion(prompt=prompt, max_tokens=6, temperature=0, stream=True)
            for chunk in out:
                delta = {"content": chunk["choices"][0]["text"]}
                yield {"id": "x", "choices": [{"index": 0, "delta": delta}]}

        llm.create_chat_completion = lazy_handler
        steps: list[int] = []
        usage: list[tuple[int, int, int]] = []
        chunks = rt.chat(
            {"messages": [{"role": "user", "content": "hi"}]},
            True,
            lambda: steps.append(1),
            lambda p, c, k: usage.append((p, c, k)),
        )
        assert steps == [] and usage == []  # nothing ran yet: the handler is lazy
        assert len(list(chunks)) >= 1
    finally:
        rt.close()
    assert len(steps) == 6
    assert usage == [(len(prompt), 6, 0)]


def test_every_engine_step_of_a_prefill_is_progress(models_dir: Path) -> None:
    n_batch = 8
    rt = LlamaRuntime()
    spec = ModelSpec(path=str(models_dir / "tiny0.gguf"), n_ctx=512, parallel=1, n_batch=n_batch)
    rt.load(spec, "cpu")
    try:
        progress: list[int] = []
        tokens: list[int] = []
        out = rt.completion(
            {"prompt": " ".join(f"w{j}" for j in range(30)), "max_tokens": 3, "temperature": 0},
            False,
            lambda: tokens.append(1),
            on_progress=lambda: progress.append(1),
        )
    finally:
        rt.close()
    assert isinstance(out, dict)
    n_prompt = out["usage"]["prompt_tokens"]
    chunks = -(-n_prompt // n_batch)
    assert chunks >= 4 and len(tokens) == 3
    # A step per prompt chunk (its last samples the first token), then one per further token.
    assert len(progress) == chunks + len(tokens) - 1
