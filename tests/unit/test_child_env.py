"""What a model process inherits from its agent: an allow-list, never a secret; and the pure
path check it runs before loading."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from residency import registry
from residency.settings import ModelSpec, Settings
from workers import devices

AGENT_ENV = {
    "PATH": "/usr/bin",
    "HOME": "/home/r",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/tmp/x",
    "PYTHONPATH": "/app",
    "VIRTUAL_ENV": "/venv",
    "RESIDENCY_LOG_LEVEL": "DEBUG",
    "RESIDENCY_REDIS_URL": "redis://:pw@redis:6379/0",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "CUDA_CACHE_PATH": "/cache",
    "HIP_VISIBLE_DEVICES": "0",
    "ROCR_VISIBLE_DEVICES": "0",
    "OMP_NUM_THREADS": "4",
    "OPENBLAS_NUM_THREADS": "1",
    "GGML_CUDA_NO_PINNED": "1",
    # Never inherited:
    "RESIDENCY_ADMIN_KEY": "admin-secret",
    "RESIDENCY_REMOTE_OPENAI_KEY": "remote-secret",
    "RESIDENCY_CONFIG": "/config/residency.toml",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "HF_TOKEN": "hf",
    "GGML_API_KEY": "looks-like-a-secret",
    "CUDA_AUTH_TOKEN": "looks-like-a-secret",
}
SECRETS = {
    "RESIDENCY_ADMIN_KEY",
    "RESIDENCY_REMOTE_OPENAI_KEY",
    "RESIDENCY_CONFIG",
    "AWS_SECRET_ACCESS_KEY",
    "HF_TOKEN",
    "GGML_API_KEY",
    "CUDA_AUTH_TOKEN",
}


def test_child_env_is_the_allow_list_only() -> None:
    env = devices.child_env("cpu", AGENT_ENV)
    assert set(env) == set(AGENT_ENV) - SECRETS | {"GOMP_SPINCOUNT"}
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU model sees no GPU
    assert env["RESIDENCY_REDIS_URL"] == AGENT_ENV["RESIDENCY_REDIS_URL"]
    assert devices.child_env("cuda:1", AGENT_ENV)["CUDA_VISIBLE_DEVICES"] == "1"


def test_openmp_spins_briefly_unless_the_operator_says_how_it_waits() -> None:
    assert devices.child_env("cpu", AGENT_ENV)["GOMP_SPINCOUNT"] == devices.OMP_SPIN_COUNT
    env = devices.child_env("cpu", AGENT_ENV | {"GOMP_SPINCOUNT": "300000"})
    assert env["GOMP_SPINCOUNT"] == "300000"
    env = devices.child_env("cuda:0", AGENT_ENV | {"OMP_WAIT_POLICY": "active"})
    assert "GOMP_SPINCOUNT" not in env and env["OMP_WAIT_POLICY"] == "active"


def test_child_env_of_the_real_environment_has_no_admin_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RESIDENCY_ADMIN_KEY", "admin-secret")
    env = devices.child_env("cpu", dict(os.environ))
    assert "RESIDENCY_ADMIN_KEY" not in env
    assert env.get("PATH") == os.environ.get("PATH")


def _admin_entry(path: Path) -> registry.Entry:
    return registry.Entry("m", ModelSpec(path=str(path)), "admin")


def test_load_dirs_confine_admin_models_only(tmp_path: Path) -> None:
    s = Settings.model_validate({"server": {"model_dirs": ["/models"]}})
    entry = _admin_entry(tmp_path / "m.gguf")
    assert registry.load_dirs(entry, tmp_path, s) == [str(tmp_path), "/models"]
    # Without the data dir, only the configured folders: stricter, never wider.
    assert registry.load_dirs(entry, None, s) == ["/models"]
    file_entry = registry.Entry("m", entry.spec, "file")
    assert registry.load_dirs(file_entry, tmp_path, s) is None
    remote = registry.Entry("r", ModelSpec(base_url="http://10.0.0.1/v1"), "admin")
    assert registry.load_dirs(remote, tmp_path, s) is None


def test_check_path_follows_symlinks_out_of_the_dirs(tmp_path: Path) -> None:
    inside, outside = tmp_path / "models", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    (inside / "real.gguf").write_bytes(b"GGUF")
    (outside / "secret.gguf").write_bytes(b"GGUF")
    (inside / "escape.gguf").symlink_to(outside / "secret.gguf")
    (inside / "sub").symlink_to(outside)
    assert registry.check_path(str(inside / "real.gguf"), [str(inside)]) == str(
        (inside / "real.gguf").resolve()
    )
    for p in (inside / "escape.gguf", inside / "sub" / "secret.gguf", inside / ".." / "x"):
        with pytest.raises(registry.PathNotAllowed, match="outside the model directories"):
            registry.check_path(str(p), [str(inside)])
    with pytest.raises(registry.PathNotAllowed, match="no model directories"):
        registry.check_path(str(inside / "real.gguf"), [])
