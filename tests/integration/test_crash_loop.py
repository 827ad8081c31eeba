"""A model that keeps failing to load fails fast, and never blocks the others: real coordinator,
agent, Redis and model processes (llama.cpp); the failing model's file is a corrupt GGUF."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flask.testing import FlaskClient

from residency import keys
from tests.conftest import Pool, tiny_models
from web.app import create_app

ADMIN = {"Authorization": "Bearer test-admin-key"}


def chat(c: FlaskClient, model: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return c.post("/v1/chat/completions", json=body)


def health_model(c: FlaskClient, name: str) -> dict[str, Any]:
    [m] = [m for m in c.get("/health").get_json()["models"] if m["name"] == name]
    return dict(m)


def test_a_model_that_keeps_failing_fails_fast_and_never_blocks_the_others(
    start_pool: Callable[..., Pool], tmp_path: Path, models_dir: Path
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.gguf").write_bytes(b"GGUF" + b"\x00\xff" * 512)  # a header, then garbage
    models = tiny_models(models_dir, x={"path": str(bad / "broken.gguf"), "n_ctx": 512})
    pool = start_pool(
        pool={"max_loaded_models": 1},
        models=models,
        server={"model_dirs": [str(models_dir), str(bad)]},
    )
    c = create_app(pool.box).test_client()

    for _ in range(3):
        resp = chat(c, "x")
        assert resp.status_code == 500
        assert resp.get_json()["error"]["code"] == "model_load_failed"
        # The other model still loads and serves between the failures.
        assert chat(c, "a").status_code == 200
    pid_a = pool.pid("a")
    assert pid_a

    # The fourth request is answered at once with the cause; nothing is loaded or evicted.
    resp = chat(c, "x")
    assert resp.status_code == 503
    err = resp.get_json()["error"]
    assert err["code"] == "model_load_backoff"
    assert 0 < int(resp.headers["Retry-After"]) <= keys.LOAD_FAILURE_WINDOW_S
    pool.wait_for(lambda: health_model(c, "x")["backoff"] is not None, what="backoff in /health")
    backoff = health_model(c, "x")["backoff"]
    assert backoff["failures"] == 3
    assert backoff["last_error"] and backoff["last_error"] in err["message"]
    assert pool.state("a") == "ready" and pool.pid("a") == pid_a
    assert chat(c, "a").status_code == 200 and pool.pid("a") == pid_a

    # An explicit admin load clears the window: the model is tried again (and fails again).
    failed_tokens = {json.loads(m)["token"] for m in pool.r.zrange(keys.load_failures("x"), 0, -1)}
    assert len(failed_tokens) == 3
    assert c.post("/admin/models/x/load", headers=ADMIN).status_code == 202
    pool.wait_for(
        lambda: (
            pool.r.zcard(keys.load_failures("x")) == 1
            and {
                json.loads(m)["token"] for m in pool.r.zrange(keys.load_failures("x"), 0, -1)
            }.isdisjoint(failed_tokens)
        ),
        what="a fresh failure after the admin load",
    )
    assert chat(c, "a").status_code == 200
