"""What a real model process measures for the router: a routed request's predicted and actual
wait (``keys.route_samples``, with its error on the ``ROUTE_WAIT_ERROR`` histogram), the model's
pace (``keys.service``) and its spec's load time (``keys.footprint``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from residency import keys, ledger, metrics
from residency.lua import Scripts
from residency.messages import Kind
from residency.prompt_size import prompt_bytes
from residency.route_wait import Service
from residency.settings import ModelSpec
from residency.tinymodel import write_tiny_model
from tests.conftest import Pool
from web import bus
from workers.timings import SERVICE_EWMA

PREDICTED = {"wait": 0.5, "queue": 0.0, "load": 0.25, "room": 0.0, "prefill": 0.25}
ROUTE = {"policy": "auto", "rule": "code", "predicted": PREDICTED}


@pytest.fixture
def route_model(models_dir: Path) -> dict[str, dict[str, Any]]:
    # A file of its own: the session's models directory is shared with other tests.
    path = models_dir / "tiny-route-samples.gguf"
    if not path.exists():
        write_tiny_model(path, seed=31)
    return {"rs": {"path": str(path), "n_ctx": 512, "parallel": 1}}


PARAMS: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chat(pool: Pool, **kw: Any) -> dict[str, Any]:
    r = pool.r
    call = bus.submit(
        r,
        Scripts(r),
        kind=Kind.CHAT,
        model="rs",
        params=PARAMS,
        stream=False,
        bound=-1,
        timeout_s=120,
        **kw,
    )
    out: dict[str, Any] = call.result()
    return out


def samples(pool: Pool, policy: str) -> list[dict[str, Any]]:
    return [json.loads(s) for s in pool.r.lrange(keys.route_samples(policy), 0, -1)]


def error_count(pool: Pool, policy: str) -> int:
    hist = pool.r.hgetall(keys.metric_histogram(metrics.ROUTE_WAIT_ERROR))
    prefix = json.dumps({"policy": policy}, separators=(",", ":")) + "|"
    return sum(
        int(float(v)) for k, v in hist.items() if k.startswith(prefix) and not k.endswith("|sum")
    )


def test_a_routed_request_leaves_its_sample_and_an_unrouted_one_none(
    start_pool: Callable[..., Pool], route_model: dict[str, dict[str, Any]]
) -> None:
    pool = start_pool(models=route_model)
    assert chat(pool)["object"] == "chat.completion"  # loads it; not routed
    assert not pool.r.keys(keys.route_samples("*"))
    assert error_count(pool, "auto") == 0

    chat(pool, route=ROUTE)
    [sample] = samples(pool, "auto")
    assert sample["candidate"] == "rs" and sample["rule"] == "code"
    assert sample["predicted"] == PREDICTED
    actual = sample["actual"]
    assert actual["queue"] >= 0 and actual["first"] >= 0
    assert actual["wait"] == pytest.approx(actual["queue"] + actual["first"], abs=1e-4)
    ttl = pool.r.ttl(keys.route_samples("auto"))
    assert 0 < ttl <= keys.ROUTE_SAMPLES_TTL_S
    assert error_count(pool, "auto") == 1

    # Nothing predicted (a remote's route): no sample, no error.
    chat(pool, route={"policy": "auto", "rule": "remote"})
    assert len(samples(pool, "auto")) == 1 and error_count(pool, "auto") == 1


def test_the_model_s_pace_and_its_spec_s_load_time_are_recorded(
    start_pool: Callable[..., Pool], route_model: dict[str, dict[str, Any]]
) -> None:
    pool = start_pool(models=route_model)
    chat(pool)
    pace = Service.parse(pool.r.get(keys.service("rs")))
    assert pace.service_s is not None and pace.service_s > 0
    assert pace.first_s is not None and pace.first_s >= 0
    # In the router's measure: the prompt's bytes, all of them (nothing was cached yet).
    size = prompt_bytes(PARAMS)
    assert pace.new_bytes == pytest.approx(size, rel=1e-9)
    assert pace.bytes_sq == pytest.approx(size * size, rel=1e-9)
    assert pace.bytes_first == pytest.approx(size * pace.first_s, rel=1e-6)
    assert len(str(pool.r.get(keys.service("rs"))).split()) == 5

    # The same prompt again: the share of its tokens the slot still held is not counted.
    usage = chat(pool)["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0  # the slot kept the conversation
    uncached = size * (usage["prompt_tokens"] - cached) / usage["prompt_tokens"]
    again = Service.parse(pool.r.get(keys.service("rs")))
    assert again.new_bytes == pytest.approx(size + SERVICE_EWMA * (uncached - size), rel=1e-9)

    rec = {str(k): str(v) for k, v in pool.r.hgetall(keys.footprint("rs")).items()}
    spec = ModelSpec.model_validate(route_model["rs"])
    assert rec["load_spec"] == ledger.digest(spec, "cpu", 1)
    # From the coordinator's start of the load: at least what the process itself took.
    load_seconds = float(str(pool.r.hget(keys.model("rs"), "load_seconds")))
    assert float(rec["load_s"]) >= load_seconds
