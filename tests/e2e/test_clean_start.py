"""End to end: what `residency up` prints from its start to its stop is free of warnings (the
first screen a user sees is the log of a healthy box, not a library's complaint)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.e2e.test_up import Up

pytestmark = pytest.mark.e2e


def test_up_prints_no_warning_through_start_a_request_and_stop(
    tmp_path: Path, models_dir: Path
) -> None:
    up = Up(tmp_path, models_dir)
    try:
        stream = up.client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        up.proc.send_signal(signal.SIGTERM)
        out, _ = up.proc.communicate(timeout=60)
    lines = up.lines + out.splitlines(keepends=True)
    assert any("residency is up" in line for line in lines)
    warned = [line for line in lines if "Warning" in line]
    assert warned == [], "".join(warned)
    assert up.proc.returncode == 0
