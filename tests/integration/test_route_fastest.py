"""``choose = "fastest"`` against real parts (Redis, coordinator, agent, llama.cpp model processes
on tiny models): the router takes the listed candidate with the least predicted wait, read from
the pool as it is. Busy models are made busy by the ``hold`` fault (their requests wait before
their first token), and a model's measured pace is planted where a test needs a known one; every
assertion is on choices, states and counts, never on durations."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient

from residency import keys
from tests.conftest import Pool
from tests.integration.test_auth import add_user, bearer, issue
from tests.integration.test_bounded_work import faults
from tests.integration.test_pool import ADMIN, client_for, loads
from tests.integration.test_routing import create_remote_app, put_policy

HELD_QUEUE = 4


def ask(c: FlaskClient, model: str, text: str, headers: dict[str, str] | None = None) -> Any:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "route_trace": True,
    }
    return c.post("/v1/chat/completions", json=body, headers=headers or {})


def chosen(resp: Any) -> str:
    assert resp.status_code == 200, resp.get_json()
    return str(resp.headers["x-residency-route"].split(";")[0].split(":")[2])


def predictions(resp: Any) -> dict[str, dict[str, Any]]:
    trace = resp.get_json()["route_trace"]
    return {p["candidate"]: p for p in trace["choose"]["predictions"]}


def policy(listed: list[str], **kw: Any) -> dict[str, Any]:
    cands = sorted(set(listed))
    return {"candidates": cands, "default": listed, "choose": "fastest", **kw}


@pytest.fixture
def two(start_pool: Callable[..., Pool]) -> Iterator[tuple[Pool, FlaskClient]]:
    """Room for both tiny models (``a`` and ``b``) without evicting anyone; ``a`` resident."""
    pool = start_pool(
        pool={"max_loaded_models": 2, "llm_pool_autosize": False},
        debug={"fault_injection": True},
    )
    c = client_for(pool)
    assert ask(c, "a", "warm up").status_code == 200
    assert pool.resident() == {"a"}
    yield pool, c
    faults(c, hold={"a": False})


def hold_busy(pool: Pool, c: FlaskClient, model: str, n: int, service_s: float) -> list[Any]:
    """``model``'s slots full and ``n`` requests queued behind them (the hold fault keeps them
    before their first token), its measured pace planted at ``service_s`` a request."""
    faults(c, hold={model: True})
    threads = []
    slots = int(str(pool.r.hget(keys.model(model), "parallel")))
    for i in range(slots + n):
        t = threading.Thread(target=ask, args=(client_for(pool), model, f"busy {i}"), daemon=True)
        t.start()
        threads.append(t)
    pool.wait_for(
        lambda: (
            pool.r.llen(keys.queue(model)) == n and pool.r.llen(keys.processing(model)) == slots
        ),
        what=f"{model} full with {n} queued",
    )
    pool.r.set(keys.service(model), f"{service_s}")
    return threads


def release(c: FlaskClient, model: str, threads: list[Any]) -> None:
    faults(c, hold={model: False})
    for t in threads:
        t.join(60)


def test_fastest_takes_the_idle_resident_and_loads_nothing(
    two: tuple[Pool, FlaskClient],
) -> None:
    pool, c = two
    # b is listed first: "first" loads it, "fastest" serves the request on a, resident and idle.
    put_policy(c, "auto", policy(["b", "a"]))
    for i in range(3):
        resp = ask(c, "auto", f"hello {i}")
        assert chosen(resp) == "a"
        assert resp.headers["x-residency-route"].startswith("auto:default:a; fastest; ")
    preds = predictions(resp)
    assert preds["a"]["load"] == 0 and preds["a"]["queue"] == 0
    assert preds["b"]["load"] > 0
    assert loads(pool, "b") == 0 and pool.resident() == {"a"}

    put_policy(c, "auto", {**policy(["b", "a"]), "choose": "first"})
    resp = ask(c, "auto", "hello again")
    assert chosen(resp) == "b"
    assert resp.headers["x-residency-route"] == "auto:default:b"
    assert loads(pool, "b") == 1


def test_a_saturated_resident_sends_the_request_to_the_cold_candidate(
    two: tuple[Pool, FlaskClient],
) -> None:
    pool, c = two
    put_policy(c, "auto", policy(["a", "b"]))
    threads = hold_busy(pool, c, "a", HELD_QUEUE, service_s=30.0)
    resp = ask(c, "auto", "route me")
    assert chosen(resp) == "b"
    preds = predictions(resp)
    assert preds["a"]["queue"] > preds["b"]["wait"]
    assert loads(pool, "b") == 1
    release(c, "a", threads)


def test_past_max_wait_the_remote_fallback_takes_it(start_pool: Callable[..., Pool]) -> None:
    from werkzeug.serving import make_server

    # The "remote" is this box's own web app serving c: room for a and c.
    pool = start_pool(
        pool={"max_loaded_models": 2, "llm_pool_autosize": False},
        server={"allow_local_remotes": True},
        debug={"fault_injection": True},
    )
    server = make_server("127.0.0.1", 0, create_remote_app(pool), threaded=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        c = client_for(pool)
        url = f"http://127.0.0.1:{server.server_port}/v1"
        far = {"base_url": url, "remote_model": "c"}
        resp = c.put("/admin/models/far", json=far, headers=ADMIN)
        assert resp.status_code == 201, resp.get_json()
        assert ask(c, "a", "warm up").status_code == 200
        put_policy(c, "auto", policy(["a", "far"], max_wait_s=1.0))
        # Idle: a is well under max_wait_s.
        assert chosen(ask(c, "auto", "quick")) == "a"
        threads = hold_busy(pool, c, "a", HELD_QUEUE, service_s=30.0)
        resp = ask(c, "auto", "route me away")
        assert chosen(resp) == "far"
        assert "; over_max_wait; " in resp.headers["x-residency-route"]
        assert predictions(resp)["far"] == {"candidate": "far", "remote": True}
        release(c, "a", threads)
    finally:
        server.shutdown()
        t.join(10)


def test_another_users_flood_does_not_lengthen_my_prediction(
    two: tuple[Pool, FlaskClient],
) -> None:
    """Fair queues serve a user below its share before a flooder's queue: the prediction counts
    only the requests that go before this caller's turn."""
    pool, c = two
    put_policy(c, "auto", policy(["a", "b"]))
    threads = hold_busy(pool, c, "a", HELD_QUEUE, service_s=30.0)  # anonymous floods a
    add_user(c, "carol")
    carol = bearer(issue(c, "carol", route_trace=True))
    view = c.post(
        "/v1/chat/completions",
        json={
            "model": "auto",
            "messages": [{"role": "user", "content": "mine"}],
            "max_tokens": 2,
            "route_trace": True,
            "stream": False,
        },
        headers=carol,
    )
    mine = predictions(view)["a"]["queue"]
    theirs = predictions(ask(c, "auto", "flood more"))["a"]["queue"]
    assert mine < theirs
    release(c, "a", threads)


def test_a_key_that_may_not_load_is_never_routed_to_a_cold_candidate(
    two: tuple[Pool, FlaskClient],
) -> None:
    pool, c = two
    put_policy(c, "auto", policy(["b", "a"]))
    add_user(c, "dave")
    h = bearer(issue(c, "dave", may_load=False, route_trace=True))
    resp = ask(c, "auto", "no loads for me", headers=h)
    assert chosen(resp) == "a"
    assert predictions(resp)["b"] == {"candidate": "b", "excluded": "may_load"}
    assert loads(pool, "b") == 0


def test_choices_and_prediction_errors_reach_health(two: tuple[Pool, FlaskClient]) -> None:
    pool, c = two
    put_policy(c, "auto", policy(["b", "a"]))
    for i in range(3):
        assert chosen(ask(c, "auto", f"count me {i}")) == "a"
    samples = [json.loads(x) for x in pool.r.lrange(keys.route_samples("auto"), 0, -1)]
    assert len(samples) == 3
    assert {s["candidate"] for s in samples} == {"a"}
    for s in samples:
        assert s["actual"]["wait"] >= 0 and s["predicted"]["load"] == 0
    pool.wait_for(
        lambda: (
            (c.get("/health").get_json().get("routing") or {}).get("auto", {}).get("samples") == 3
        ),
        what="the policy's samples in /health",
        timeout=30,
    )
    stats = c.get("/health").get_json()["routing"]["auto"]
    assert stats["choices"] == {"a": 3}
    assert stats["error"]["median_abs_s"] >= 0
