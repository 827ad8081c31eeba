"""Admin changes racing each other through the real app on a real Redis: a pin is read and
written under WATCH, so a DELETE that lands meanwhile is never undone (the model never comes
back) and a PUT that lands meanwhile is never reverted. Many rounds, two threads each, started
together; the assertions are on the registry's final state."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from residency import registry
from residency.box import Box
from web import create_app

ADMIN = {"Authorization": "Bearer test-admin-key"}
ROUNDS = 150


@pytest.fixture
def app(tmp_path: Path, redis_url: str, r: redis.Redis) -> Flask:
    box = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url=redis_url,
        environ={"RESIDENCY_ADMIN_KEY": "test-admin-key"},
    )
    box.models_dir.mkdir(parents=True)
    (box.models_dir / "m.gguf").write_bytes(b"GGUF")
    return create_app(box)


def together(app: Flask, *calls: Callable[[FlaskClient], Any]) -> list[Any]:
    """Each call on its own client and thread, all released at once; their answers."""
    clients = [app.test_client() for _ in calls]
    start = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        start.wait(10)
        out[i] = calls[i](clients[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def put(c: FlaskClient, n_ctx: int) -> Any:
    resp = c.put("/admin/models/m", json={"path": "m.gguf", "n_ctx": n_ctx}, headers=ADMIN)
    assert resp.status_code in (200, 201), resp.get_json()
    return resp


def pin(c: FlaskClient) -> Any:
    return c.post("/admin/models/m/pin", json={"pinned": True}, headers=ADMIN)


def test_a_pin_racing_a_delete_never_resurrects_the_model(app: Flask, r: redis.Redis) -> None:
    c = app.test_client()
    for _ in range(ROUNDS):
        put(c, 512)
        pinned, deleted = together(app, pin, lambda cl: cl.delete("/admin/models/m", headers=ADMIN))
        assert deleted.status_code == 200, deleted.get_json()
        # Pinned first (then deleted), or too late: 404, never a 200 that writes it back.
        assert pinned.status_code in (200, 404), pinned.get_json()
        assert registry.get(r, "m") is None
    # A late pin is refused like any pin of an unknown model.
    resp = pin(c)
    assert resp.status_code == 404 and resp.get_json()["error"]["code"] == "model_not_found"


def test_a_pin_racing_a_put_never_reverts_it(app: Flask, r: redis.Redis) -> None:
    c = app.test_client()
    for i in range(ROUNDS):
        put(c, 512)
        new_ctx = 1024 + i
        pinned, _ = together(app, pin, lambda cl, n=new_ctx: put(cl, n))
        assert pinned.status_code == 200, pinned.get_json()
        entry = registry.get(r, "m")
        assert entry is not None
        # The PUT's parameters stay, whichever landed first (a pin made first is replaced by
        # the PUT's whole entry; a pin made after pins what the PUT stored).
        assert entry.spec.n_ctx == new_ctx
