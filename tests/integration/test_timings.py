"""Every generated answer says where its time went (``timings``: queue, prompt, decode, and the
token counts), through every API, whole and streamed, against real model processes: the
counts are the answer's own usage, so a client can tell the box's share of its wall time."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tests.conftest import Pool
from tests.integration.test_pool import chat, client_for

SPANS = ("queue_ms", "prompt_ms", "predicted_ms")


def spans_ok(t: dict[str, Any]) -> None:
    assert all(isinstance(t[k], float) and t[k] >= 0 for k in SPANS), t


def data_lines(resp: Any) -> list[dict[str, Any]]:
    out = []
    for line in resp.get_data(as_text=True).splitlines():
        if line.startswith("data: {"):
            out.append(json.loads(line[6:]))
    return out


def test_timings_carry_the_answers_own_counts(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool()
    c = client_for(pool)
    whole = chat(c, "a", max_tokens=5).get_json()
    t = whole["timings"]
    spans_ok(t)
    u = whole["usage"]
    assert (t["prompt_n"], t["predicted_n"]) == (u["prompt_tokens"], u["completion_tokens"])
    assert t["predicted_n"] == 5

    streamed = data_lines(chat(c, "a", stream=True, stream_options={"include_usage": True}))
    last = streamed[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] == 4
    assert last["timings"]["prompt_n"] == last["usage"]["prompt_tokens"]
    assert not any("timings" in ch for ch in streamed[:-1])

    body = {"model": "a", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    msg = c.post("/v1/messages", json=body).get_json()
    assert msg["timings"]["predicted_n"] == msg["usage"]["output_tokens"] == 3
    events = data_lines(c.post("/v1/messages", json={**body, "stream": True}))
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["timings"]["predicted_n"] == 3
    spans_ok(delta["timings"])

    resp = c.post("/v1/responses", json={"model": "a", "input": "hi", "max_output_tokens": 3})
    r = resp.get_json()
    assert r["timings"]["predicted_n"] == r["usage"]["output_tokens"] == 3
    events = data_lines(
        c.post(
            "/v1/responses",
            json={"model": "a", "input": "hi", "max_output_tokens": 3, "stream": True},
        )
    )
    done = events[-1]["response"]
    assert done["timings"]["prompt_n"] == done["usage"]["input_tokens"]
