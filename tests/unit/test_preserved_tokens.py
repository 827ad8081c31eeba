"""Markers that are control tokens of a model's vocabulary render as their text in what it
generates, for the formats its answers are read with (llama-server's "preserved tokens"), and
no other control token does: against the real backend, on tiny GGUFs whose vocabularies have
such tokens (llama.cpp renders a control token as nothing, so a reader would never see it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from residency.settings import ModelSpec
from residency.tinymodel import IM_START_ID, write_tiny_model
from tests.integration.reasoning_templates import THINK_TEMPLATE, THINK_TOKENS
from workers.runtime import LlamaRuntime

MISTRAL_TOKENS = ("[TOOL_CALLS]", "[ARGS]")
MISTRAL_TEMPLATE = (
    "{%- for m in messages %}[INST]{{ m.content }}[/INST]{%- endfor %}"
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{#- calls: [TOOL_CALLS]name[ARGS]{...} #}"
)


@pytest.fixture
def load(tmp_path: Path) -> Iterator[Any]:
    loaded: list[LlamaRuntime] = []

    def _load(template: str, tokens: tuple[str, ...], **spec: Any) -> LlamaRuntime:
        path = write_tiny_model(
            tmp_path / f"m{len(loaded)}.gguf", seed=3, chat_template=template, control_tokens=tokens
        )
        rt = LlamaRuntime()
        rt.load(ModelSpec(path=str(path), n_ctx=256, parallel=1, **spec), "cpu")
        loaded.append(rt)
        return rt

    yield _load
    for rt in loaded:
        rt.close()


def token(rt: LlamaRuntime, text: str) -> int:
    (t,) = rt.llm.tokenize(text.encode(), add_bos=False, special=True)
    return int(t)


def test_the_reasoning_markers_render_as_their_text(load: Any) -> None:
    rt = load(THINK_TEMPLATE, THINK_TOKENS)
    for marker in THINK_TOKENS:
        assert rt.llm.pieces(token(rt, marker)) == marker.encode()
    # Other control tokens still render as nothing (the template's own turn markers).
    assert rt.llm.pieces(IM_START_ID) == b""


def test_with_reasoning_none_the_markers_stay_text_in_the_content(load: Any) -> None:
    rt = load(THINK_TEMPLATE, THINK_TOKENS, reasoning="none")
    assert rt.llm.pieces(token(rt, "<think>")) == b"<think>"


def test_markers_no_format_of_the_model_uses_render_as_nothing(load: Any) -> None:
    rt = load("{{ messages }}", THINK_TOKENS)
    assert rt.llm.pieces(token(rt, "<think>")) == b""


def test_a_tool_formats_markers_render_as_their_text(load: Any) -> None:
    rt = load(MISTRAL_TEMPLATE, MISTRAL_TOKENS)
    for marker in MISTRAL_TOKENS:
        assert rt.llm.pieces(token(rt, marker)) == marker.encode()
    # The same vocabulary, a model whose template takes no tools: nothing to read them for.
    plain = load("{%- for m in messages %}{{ m.content }}{%- endfor %}", MISTRAL_TOKENS)
    assert plain.llm.pieces(token(plain, "[TOOL_CALLS]")) == b""
