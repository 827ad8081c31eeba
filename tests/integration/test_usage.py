"""Usage counted by the model processes, and requests that may not cause a load, against real
parts: a real Redis, the coordinator and agent running, real model processes (llama.cpp, tiny
GGUF), requests through the Flask app and through ``web.bus`` directly."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from residency import keys
from residency.errors import ApiError
from residency.lua import Scripts
from residency.messages import Kind
from tests.conftest import Pool
from tests.integration.test_pool import chat, client_for, loads
from web import bus


def usage_of(r: redis.Redis, user: str, model: str) -> dict[str, int]:
    """Today's (UTC) token and request counters of ``user`` on ``model`` (its load seconds:
    ``load_seconds_of``)."""
    day = time.strftime("%Y-%m-%d", time.gmtime())
    raw = r.hgetall(keys.usage(day))
    prefix = keys.usage_field(user, model, "")
    counters = {str(k).removeprefix(prefix): v for k, v in raw.items() if k.startswith(prefix)}
    return {k: int(v) for k, v in counters.items() if k != "load_seconds"}


def load_seconds_of(r: redis.Redis, user: str, model: str) -> float:
    day = time.strftime("%Y-%m-%d", time.gmtime())
    return float(r.hget(keys.usage(day), keys.usage_field(user, model, "load_seconds")) or 0)


def test_usage_totals_equal_the_sum_of_the_responses_usage(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool()
    c = client_for(pool)
    answers: list[dict[str, Any]] = []
    for n in (3, 5, 8):
        resp = chat(c, "a", max_tokens=n)
        assert resp.status_code == 200, resp.get_json()
        answers.append(resp.get_json()["usage"])
    resp = c.post("/v1/completions", json={"model": "a", "prompt": "the world", "max_tokens": 6})
    assert resp.status_code == 200, resp.get_json()
    answers.append(resp.get_json()["usage"])
    # A stream's tokens count too: the same request unstreamed (temperature 0) says how many.
    same = {"max_tokens": 7, "temperature": 0}
    streamed = chat(c, "a", stream=True, **same)
    # Read to its end: a stream dropped unread is a client gone away (its generation stops).
    assert streamed.status_code == 200 and streamed.get_data(as_text=True).endswith("[DONE]\n\n")
    resp = chat(c, "a", **same)
    answers += [resp.get_json()["usage"]] * 2

    got = usage_of(pool.r, "", "a")
    assert got == {
        "requests": 6,
        "prompt_tokens": sum(u["prompt_tokens"] for u in answers),
        "completion_tokens": sum(u["completion_tokens"] for u in answers),
    }
    resp = c.post("/v1/embeddings", json={"model": "emb", "input": ["a", "bc d"]})
    assert resp.status_code == 200
    emb = usage_of(pool.r, "", "emb")
    assert emb == {
        "requests": 1,
        "prompt_tokens": resp.get_json()["usage"]["prompt_tokens"],
        "completion_tokens": 0,
    }


def submit(pool: Pool, model: str, **kw: Any) -> bus.Call:
    r = pool.r
    return bus.submit(
        r,
        Scripts(r),
        kind=Kind.CHAT,
        model=model,
        params={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        stream=False,
        bound=-1,
        timeout_s=60,
        **kw,
    )


def test_a_request_that_may_not_load_is_refused_for_a_cold_model_and_loads_nothing(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    with pytest.raises(ApiError) as e:
        submit(pool, "a", may_load=False, user="ann")
    assert e.value.status == 409 and e.value.code == "model_not_resident"
    assert pool.r.llen(keys.queue("a")) == 0
    assert pool.state("a") == "unloaded" and loads(pool, "a") == 0

    # Resident (loaded by someone who may), it is served, and counted for its user.
    assert submit(pool, "a", user="bob").result()["object"] == "chat.completion"
    out = submit(pool, "a", may_load=False, user="ann").result()
    assert out["usage"]["completion_tokens"] > 0
    assert usage_of(pool.r, "ann", "a")["requests"] == 1
    # ...but it never evicts it for another model: b stays cold, a stays loaded.
    with pytest.raises(ApiError) as e:
        submit(pool, "b", may_load=False, user="ann")
    assert e.value.status == 409 and "may not load" in json.dumps(e.value.envelope())
    assert pool.resident() == {"a"} and loads(pool, "b") == 0
