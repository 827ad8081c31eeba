"""The memory ledger against real parts: a coordinator and an agent running, real model processes
on tiny GGUF models, a real Redis. A device's budget ([worker] device_budget_mb) bounds what its
residents hold; a load that does not fit evicts idle residents by bytes first and is never
started to crash; a model larger than every budget is refused; the fit dry run answers without
doing anything. Assertions are on states, counters and byte sums only."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from residency import keys, ledger, metrics
from residency.settings import ModelSpec
from tests.conftest import Pool, tiny_models
from tests.integration.test_live_limits import counter
from tests.integration.test_pool import chat, client_for, loads

ADMIN = {"Authorization": "Bearer test-admin-key"}
MIB = 1 << 20
# Three copies of one spec; its KV cache (n_ctx x parallel cells) makes most of its bytes, so
# the estimate and the measurement agree closely (within the estimate's 15% tolerance).
SPEC = {"n_ctx": 16384, "parallel": 4}


def _expected(models_dir: Path) -> int:
    entry = tiny_models(models_dir, a=SPEC)["a"]
    n = ledger.expected(ModelSpec.model_validate(entry), "cpu", None)
    assert n is not None
    return n


def _two_fit(models_dir: Path) -> dict[str, Any]:
    """A budget that holds two of them and not three, whether counted by estimate or by
    measurement (each within 15% of the other): 2 x 1.15 < 2.42 < 3 x 0.85."""
    return {"device_budget_mb": int(2.42 * _expected(models_dir) / MIB)}


def _health(pool: Pool) -> dict[str, Any]:
    return json.loads(str(pool.r.hget(keys.health(), "record") or "{}"))


@contextmanager
def _watch_ledger(pool: Pool) -> Iterator[list[tuple[int, int, int]]]:
    """Samples (resident count, used bytes, budget bytes) of the one device while the block
    runs, from the residents' own hashes (not from the coordinator's record)."""
    seen: list[tuple[int, int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            doc = _health(pool)
            budget = (doc.get("devices") or [{}])[0].get("budget_bytes") or 0
            held = [
                int(pool.r.hget(keys.model(m), "footprint_bytes") or 0) for m in pool.resident()
            ]
            seen.append((len(held), sum(held), budget))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join()


def test_a_load_that_does_not_fit_evicts_by_bytes_first_and_the_device_stays_in_budget(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start_pool(
        pool={"max_loaded_models": -1},
        models=tiny_models(models_dir, a=SPEC, b=SPEC, c=SPEC),
        worker=_two_fit(models_dir),
    )
    c = client_for(pool)
    with _watch_ledger(pool) as seen:
        for model in ("a", "b", "c"):
            assert chat(c, model).status_code == 200
        # c made room by evicting a or b (whichever was worth less then); that one comes back.
        (gone,) = {"a", "b"} - pool.resident()
        assert chat(c, gone).status_code == 200
    # The count limit is off: bytes alone made room, one resident for each later load.
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="room") == 2
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="lru") == 0
    assert len(pool.resident()) == 2
    assert sum(loads(pool, m) for m in "abc") == 4 and loads(pool, gone) == 2
    # Never three processes at once, never a measured sum above the budget.
    assert seen and max(n for n, _, _ in seen) <= 2
    assert all(used <= budget for _, used, budget in seen if budget)
    # The ledger shows it: the budget, and each resident's measured bytes.
    doc = _health(pool)
    (device,) = doc["devices"]
    assert device["budget_bytes"] == _two_fit(models_dir)["device_budget_mb"] * MIB
    held = {m: int(pool.r.hget(keys.model(m), "footprint_bytes") or 0) for m in pool.resident()}
    pool.wait_for(
        lambda: _health(pool)["devices"][0]["models"] == held, what="the ledger's residents"
    )
    assert _health(pool)["devices"][0]["used_bytes"] == sum(held.values())


def test_a_model_larger_than_every_budget_is_refused_and_never_started(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    need = _expected(models_dir)
    pool = start_pool(
        pool={"max_loaded_models": -1},
        models=tiny_models(models_dir, a=SPEC),
        worker={"device_budget_mb": max(1, int(0.5 * need / MIB))},
    )
    resp = chat(client_for(pool), "a")
    assert resp.status_code == 409
    err = resp.get_json()["error"]
    assert err["code"] == "model_too_large" and "device_budget_mb" in err["message"]
    assert loads(pool, "a") == 0 and pool.state("a") == "unloaded"


def test_fit_answers_where_and_what_would_go_without_doing_it(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    from web.app import create_app

    pool = start_pool(
        pool={"max_loaded_models": -1},
        models=tiny_models(models_dir, a=SPEC, b={**SPEC, "pinned": True}, c=SPEC),
        worker=_two_fit(models_dir),
    )
    admin = create_app(pool.box).test_client()
    empty = admin.post("/admin/models/c/fit", headers=ADMIN).get_json()
    assert (empty["fits"], empty["now"], empty["evict"]) == (True, True, [])
    assert (empty["host"], empty["device"]) == ("testhost", "cpu")
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    assert chat(c, "b").status_code == 200
    answer = admin.post("/admin/models/c/fit", headers=ADMIN).get_json()
    assert answer["fits"] is True and answer["now"] is False
    assert [e["model"] for e in answer["evict"]] == ["a"]  # b is pinned
    assert answer["evict"][0]["reason"] == "room"
    assert answer["device"] == "cpu"
    # Nothing was done: both still resident, c never loaded, no eviction counted.
    assert pool.resident() == {"a", "b"} and loads(pool, "c") == 0
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="room") == 0
    resident = admin.post("/admin/models/a/fit", headers=ADMIN).get_json()
    assert resident["resident"] is True and resident["device"] == "cpu"
    missing = admin.post("/admin/models/nope/fit", headers=ADMIN)
    assert missing.status_code == 404
