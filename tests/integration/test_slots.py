"""Parallel slots through the whole box: real Redis, coordinator, agent, model processes
(llama.cpp, tiny GGUF), requests through the Flask app.

The ``hold`` fault keeps every generation of a model before its first token until it is
cleared, so "N requests in flight at once" is a state to wait for, not a race to win.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import faults, in_flight, post_chat, queued, sse_events
from tests.integration.test_pool import chat, client_for, in_thread


def model_health(pool: Pool, name: str) -> dict[str, Any]:
    [m] = [m for m in client_for(pool).get("/health").get_json()["models"] if m["name"] == name]
    return m


def test_eight_streams_run_at_once_in_eight_slots(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start_pool(
        models=tiny_models(models_dir, a={"parallel": 8}), debug={"fault_injection": True}
    )
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pool.wait_for(lambda: (model_health(pool, "a")["slots"] or {}).get("parallel") == 8)
    faults(c, hold={"a": True})
    streams = [
        in_thread(lambda i=i: post_chat(client_for(pool), "a", stream=True, max_tokens=6, seed=i))
        for i in range(9)
    ]
    # Eight are served together; the ninth waits in the queue for a free slot.
    pool.wait_for(lambda: len(in_flight(pool, "a")) == 8, what="eight requests in flight")
    pool.wait_for(lambda: len(queued(pool, "a")) == 1, what="the ninth queued")
    pool.wait_for(
        lambda: model_health(pool, "a")["slots"] == {"parallel": 8, "busy": 8},
        what="/health showing eight busy slots",
    )
    faults(c, hold={"a": False})
    for t, out in streams:
        t.join(60)
        events = sse_events(out[0].get_data(as_text=True))
        assert events[-1] == "[DONE]"
        texts = [
            json.loads(e)["choices"][0]["delta"].get("content")
            for e in events[:-1]
            if json.loads(e).get("choices")
        ]
        assert any(texts), events
    pool.wait_for(lambda: model_health(pool, "a")["slots"] == {"parallel": 8, "busy": 0})


def test_a_model_without_parallel_gets_the_cpu_default(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    models = tiny_models(models_dir)
    del models["a"]["parallel"]
    pool = start_pool(models=models)
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pool.wait_for(lambda: model_health(pool, "a")["slots"] == {"parallel": 4, "busy": 0})
    assert model_health(pool, "b")["slots"] is None  # not loaded


def test_tools_response_format_logprobs_stop_and_seed_through_a_batched_model(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    # Room for the tool's description (the template takes no tools: the generic format).
    pool = start_pool(models=tiny_models(models_dir, a={"parallel": 4, "n_ctx": 2048}))
    c = client_for(pool)
    tool = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
            },
        },
    }
    resp = post_chat(
        c,
        "a",
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=120,
        temperature=0,
    )
    assert resp.status_code == 200, resp.get_json()
    [call] = resp.get_json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    resp = post_chat(
        c,
        "a",
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        max_tokens=60,
        temperature=0,
    )
    assert resp.status_code == 200, resp.get_json()
    assert isinstance(json.loads(resp.get_json()["choices"][0]["message"]["content"])["n"], int)

    resp = post_chat(c, "a", logprobs=True, top_logprobs=2, max_tokens=3)
    assert resp.status_code == 200, resp.get_json()
    assert len(resp.get_json()["choices"][0]["logprobs"]["content"]) == 3

    base = post_chat(c, "a", max_tokens=12, temperature=0).get_json()
    text = base["choices"][0]["message"]["content"]
    stop = text[3:6]
    cut = post_chat(c, "a", max_tokens=12, temperature=0, stop=[stop]).get_json()
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]

    sampled = [
        post_chat(c, "a", max_tokens=10, temperature=1.0, seed=s).get_json() for s in (5, 5, 6)
    ]
    texts = [s["choices"][0]["message"]["content"] for s in sampled]
    assert texts[0] == texts[1] != texts[2]

    emb = c.post("/v1/embeddings", json={"model": "emb", "input": ["one", "two"]})
    assert emb.status_code == 200, emb.get_json()
    assert len(emb.get_json()["data"]) == 2
