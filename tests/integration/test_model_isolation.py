"""A model process, started for real by the agent: it inherits no secret of the agent's
environment, and it re-checks that an admin-registered model file still lies inside the model
directories when it loads (a file swapped for a symlink since registration fails the load)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Pool
from tests.integration.test_pool import ADMIN, chat, client_for


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_model_process_gets_no_secret_and_refuses_a_symlink_escape(
    start_pool: Callable[..., Pool],
    models_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The agent runs in this process: these are in its environment when it spawns children.
    monkeypatch.setenv("RESIDENCY_ADMIN_KEY", "the-admin-secret")
    monkeypatch.setenv("RESIDENCY_REMOTE_OPENAI_KEY", "remote-secret")
    extra, outside = tmp_path / "extra-models", tmp_path / "outside"
    extra.mkdir()
    outside.mkdir()
    shutil.copy(models_dir / "tiny1.gguf", extra / "m.gguf")
    shutil.copy(models_dir / "tiny2.gguf", outside / "m.gguf")
    pool = start_pool(server={"model_dirs": [str(models_dir), str(extra)]})
    c = client_for(pool)

    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    assert pid is not None
    env = environ_of(pid)
    assert "RESIDENCY_ADMIN_KEY" not in env and "RESIDENCY_REMOTE_OPENAI_KEY" not in env
    assert env["RESIDENCY_REDIS_URL"] == pool.box.redis_url

    resp = c.put("/admin/models/swapped", json={"path": str(extra / "m.gguf")}, headers=ADMIN)
    assert resp.status_code == 201, resp.get_json()
    # After registration the file is replaced by a symlink that leads out of the model dirs.
    (extra / "m.gguf").unlink()
    (extra / "m.gguf").symlink_to(outside / "m.gguf")
    resp = chat(c, "swapped")
    assert resp.status_code == 500, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert err["code"] == "model_load_failed"
    assert "outside the model directories" in err["message"]
    assert pool.state("swapped") == "failed"

    # Pointed back inside, the same entry loads.
    (extra / "m.gguf").unlink()
    shutil.copy(models_dir / "tiny1.gguf", extra / "m.gguf")
    assert chat(c, "swapped").status_code == 200
