"""bench/alternation.py's box configuration: a box its client, which sends no API key, can
use (the box requires a key by default, on /health and /metrics too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from residency import settings

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import alternation as alt  # noqa: E402


@pytest.mark.parametrize("autosize", [True, False])
def test_the_box_answers_the_bench_without_a_key(tmp_path: Path, autosize: bool) -> None:
    paths = {name: tmp_path / f"{name}.gguf" for name in alt.NAMES}
    for p in paths.values():
        p.write_bytes(b"GGUF")
    cfg = alt.box_toml(tmp_path / "box.toml", 8080, paths, autosize)
    s = settings.build(settings.read_file(cfg))
    assert s.auth.required is False
    # The bench reads the LLM limit from /health and the loads from /metrics.
    assert s.auth.public_health is True
    assert s.pool.llm_pool_autosize is autosize
    assert sorted(s.models) == sorted(alt.NAMES)
    assert s.policies[alt.POLICY]["candidates"] == list(alt.NAMES)
