"""The pure decisions of a pull (residency/pulls.py): sources, file choice, names, space, what
a header makes of a model, and the state table."""

from __future__ import annotations

from pathlib import Path

import pytest

from residency.footprint import read_header
from residency.pulls import (
    FINISHED,
    TRANSITIONS,
    PullState,
    SourceError,
    default_model_name,
    fits,
    local_file_name,
    model_facts,
    parse_source,
    pick_file,
    pick_projector,
)
from residency.tinymodel import write_tiny_model

FILES = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf", "mmproj-m-q8.gguf"]


def test_sources() -> None:
    s = parse_source("hf:org/repo:Q4_K_M")
    assert (s.kind, s.repo, s.selector) == ("hf", "org/repo", "Q4_K_M")
    assert parse_source("hf:org/repo").selector is None
    u = parse_source("http://127.0.0.1:9/a/b.gguf#sha256=" + "AB" * 32)
    assert (u.kind, u.url, u.sha256) == ("url", "http://127.0.0.1:9/a/b.gguf", "ab" * 32)
    for bad in (
        "hf:noslash",
        "hf:../x/y",
        "ftp://h/x.gguf",
        "https://h/x.bin",
        "hf:o/r:../x",
        "https://h/x.gguf#md5=1",
        "",
        "x" * 5000,
    ):
        with pytest.raises(SourceError):
            parse_source(bad)


def test_file_choice() -> None:
    assert pick_file(FILES, "q8_0", "o/r") == "m-Q8_0.gguf"
    assert pick_file(FILES, "m-Q4_K_M.gguf", "o/r") == "m-Q4_K_M.gguf"
    assert pick_file(["x.gguf", "mmproj-x.gguf"], None, "o/r") == "x.gguf"
    with pytest.raises(SourceError) as e:
        pick_file(FILES, None, "o/r")
    assert e.value.choices == ["m-Q4_K_M.gguf", "m-Q8_0.gguf"]  # projectors are no models
    with pytest.raises(SourceError):
        pick_file(FILES, "Q5_K", "o/r")
    with pytest.raises(SourceError):
        pick_file(FILES, "m-", "o/r")  # two match
    assert pick_projector(FILES, "o/r") == "mmproj-m-f16.gguf"


def test_names_never_leave_the_folder() -> None:
    assert local_file_name("sub/dir/m-Q8_0.gguf") == "m-Q8_0.gguf"
    assert local_file_name("https://h/a/..%2F..%2Fetc%2Fx.gguf") == "etc-x.gguf"
    assert local_file_name("https://h/.hidden.gguf") == "hidden.gguf"
    assert default_model_name("Llama 3 (8B).Q4.gguf") == "Llama-3-8B-.Q4"


def test_space() -> None:
    assert fits(free_bytes=100, needed_bytes=60, reserve_bytes=40)
    assert not fits(free_bytes=100, needed_bytes=61, reserve_bytes=40)


def test_header_facts(tmp_path: Path) -> None:
    llm = write_tiny_model(tmp_path / "l.gguf")
    emb = write_tiny_model(tmp_path / "e.gguf", embedding=True)
    rr = write_tiny_model(tmp_path / "r.gguf", rerank=True)
    assert model_facts(read_header(llm)) == {"type": "llm", "n_ctx": 2048}
    assert model_facts(read_header(emb))["type"] == "embedding"
    assert model_facts(read_header(rr))["type"] == "rerank"


def test_state_table() -> None:
    assert set(TRANSITIONS) == set(PullState)
    for s in FINISHED:
        assert not TRANSITIONS[s]
    assert PullState.CANCELLED in TRANSITIONS[PullState.QUEUED]
    assert PullState.DONE not in TRANSITIONS[PullState.DOWNLOADING]  # checked first
