"""Idle TTL and preload against real parts: the coordinator and agent running, real model
processes on tiny GGUF models, a real Redis. Assertions are on states and counters only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from residency import metrics
from tests.conftest import Pool, tiny_models
from tests.integration.test_live_limits import counter
from tests.integration.test_pool import chat, client_for, loads


def test_an_idle_model_unloads_by_itself_after_its_ttl(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start_pool(
        pool={"max_loaded_models": 2}, models=tiny_models(models_dir, a={"ttl_s": 0.5})
    )
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    assert chat(c, "b").status_code == 200
    pool.wait_for(lambda: pool.state("a") == "unloaded", what="a expired")
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="ttl") == 1
    # b has no ttl_s: it stays, in the process it was loaded in.
    assert pool.state("b") == "ready" and loads(pool, "b") == 1
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="lru") == 0
    # The next request loads it again.
    assert chat(c, "a").status_code == 200
    assert loads(pool, "a") == 2


def test_a_preload_model_is_warm_without_a_request_gives_way_and_comes_back(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start_pool(
        pool={"max_loaded_models": 1},
        models=tiny_models(models_dir, b={"preload": True}, a={"ttl_s": 0.5}),
    )
    # The load's counter is written just after the state turns ready: wait for both.
    pool.wait_for(lambda: loads(pool, "b") == 1, what="b preloaded")
    pool.wait_for(lambda: pool.state("b") == "ready", what="b ready")
    assert pool.resident() == {"b"}
    # A request for a needs the only slot: the idle preload model is its LRU victim.
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="lru") == 1
    # a expires; its freed slot goes back to b.
    pool.wait_for(lambda: loads(pool, "b") == 2, what="b preloaded again")
    pool.wait_for(lambda: pool.state("b") == "ready", what="b ready again")
    assert counter(pool, metrics.EVICTIONS_TOTAL, reason="ttl") == 1
    assert pool.state("a") == "unloaded"
    assert pool.resident() == {"b"}
    # Neither c nor q8 (not preload) was ever loaded.
    assert loads(pool, "c") == 0 and loads(pool, "q8") == 0


def test_preload_candidates_warms_the_policies_candidates_only(
    start_pool: Callable[..., Pool],
) -> None:
    # Autosize lifts the LLM pool to the two candidates; both are warmed without a request.
    pool = start_pool(
        pool={"max_loaded_models": 1, "preload_candidates": True},
        policies={"auto": {"candidates": ["a", "b"], "default": "a"}},
    )
    pool.wait_for(lambda: pool.resident() == {"a", "b"}, what="candidates preloaded")
    pool.wait_for(lambda: pool.state("a") == pool.state("b") == "ready", what="candidates ready")
    assert loads(pool, "a") == 1 and loads(pool, "b") == 1
    assert loads(pool, "c") == 0 and pool.state("c") == "unloaded"
