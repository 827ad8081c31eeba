"""bench/load.py's box and its --model: the config it writes is one the box accepts and serves
without keys (its clients send none), and an external GGUF is served under its file's name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import load  # noqa: E402

from residency import settings  # noqa: E402


def test_the_bench_box_needs_no_key_and_serves_the_given_model(tmp_path: Path) -> None:
    model = load.external_model(tmp_path / "bench-1b.gguf")
    assert model.name == "bench-1b" and model.chat_format is None
    cfg = load.box_toml(tmp_path / "box.toml", 8123, [model], slots=32, clients=64)
    s = settings.build(settings.read_file(cfg))
    assert s.auth.required is False
    assert s.server.port == 8123
    spec = s.models["bench-1b"]
    assert spec.path == str(tmp_path / "bench-1b.gguf")
    assert spec.parallel == 32 and spec.n_ctx == load.N_CTX
    assert s.server.web_threads >= 64  # every client's stream held at once


def test_a_model_file_named_like_a_builtin_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        load.main(["--model", str(tmp_path / "tiny.gguf")])
