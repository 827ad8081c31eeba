"""What web lets in while the box is busy: the per-worker in-flight cap (429 with a computed
Retry-After), a full queue's Retry-After from the model's observed service time, and SSE
keep-alive comments while a stream waits — against a real Redis and real model processes, the
``hold`` fault keeping a model busy."""

from __future__ import annotations

import math
from collections.abc import Callable

from residency import keys
from tests.conftest import Pool
from tests.integration.test_bounded_work import (
    MESSAGES,
    configure,
    faults,
    http_server,
    in_flight,
    post_chat,
    queued,
    raw_post,
)
from tests.integration.test_pool import ADMIN, chat, client_for, in_thread
from web import admission


def test_past_the_in_flight_cap_a_request_gets_429_with_retry_after(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    configure(c, "server", max_in_flight=2)
    faults(c, hold={"a": True})
    held = [in_thread(lambda: post_chat(client_for(pool), "a", max_tokens=2)) for _ in range(2)]
    pool.wait_for(lambda: len(in_flight(pool, "a")) + len(queued(pool, "a")) == 2, what="two held")
    resp = post_chat(c, "a", max_tokens=2)
    assert resp.status_code == 429, resp.get_json()
    assert resp.get_json()["error"]["code"] == "server_busy"
    assert int(resp.headers["Retry-After"]) >= admission.MIN_RETRY_S
    # The admin API and the probes are not API requests: they answer as ever.
    assert c.get("/readyz").status_code == 200
    assert c.get("/admin/config", headers=ADMIN).status_code == 200
    faults(c, hold={"a": False})
    for t, out in held:
        t.join(60)
        assert out[0].status_code == 200
    # Released as they ended: a new one is admitted again.
    assert chat(c, "a").status_code == 200


def test_a_full_queue_says_when_to_retry_from_the_models_service_time(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True}, pool={"max_queue_per_model": 2})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    # The model process keeps a moving average of a request's time in its slot.
    pool.wait_for(lambda: pool.r.get(keys.service("a")) is not None, what="a service time")
    faults(c, hold={"a": True})
    first = in_thread(lambda: chat(client_for(pool), "a"))
    pool.wait_for(lambda: len(in_flight(pool, "a")) == 1, what="one held")
    waiting = [in_thread(lambda: chat(client_for(pool), "a")) for _ in range(2)]
    pool.wait_for(lambda: len(queued(pool, "a")) == 2, what="the queue full")
    pool.r.set(keys.service("a"), "3.0")  # as if each request took 3 s
    resp = chat(c, "a")
    assert resp.status_code == 429
    assert resp.get_json()["error"]["code"] == "queue_full"
    # Two ahead, 3 s each, one slot.
    assert int(resp.headers["Retry-After"]) == math.ceil(2 * 3.0 / 1)
    faults(c, hold={"a": False})
    for t, out in [first, *waiting]:
        t.join(60)
        assert out[0].status_code == 200


def test_a_waiting_stream_gets_keep_alive_comments_then_its_answer(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    configure(c, "server", sse_keepalive_s=0.2)
    faults(c, hold={"a": True})
    with http_server(pool) as port:
        conn = raw_post(
            port,
            "/v1/chat/completions",
            {"model": "a", "messages": MESSAGES, "max_tokens": 3, "stream": True},
        )
        got = b""
        while got.count(b": keep-alive\n\n") < 2:
            data = conn.recv(4096)
            assert data, got
            got += data
        assert got.startswith(b"HTTP/1.1 200")
        assert b"data: {" not in got  # nothing but comments while it waits
        faults(c, hold={"a": False})
        while b"data: [DONE]" not in got:
            data = conn.recv(4096)
            assert data, got
            got += data
        conn.close()
    assert b'"content"' in got
