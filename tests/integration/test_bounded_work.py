"""Bounded work against real parts: a real Redis, the coordinator and agent running, real model
processes (llama.cpp, tiny GGUF), requests through the Flask app — and, where a client must
really go away, through a real HTTP server and socket.

The ``token_delay_s``, ``hold`` and ``hang`` faults make "slow", "busy" and "hung"
deterministic; every assertion is on an outcome (status, error code, counts, pids, queue
contents), never on how long something took.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flask.testing import FlaskClient
from werkzeug.serving import make_server

from residency import keys, metrics
from residency.messages import Request
from tests.conftest import Pool, tiny_models
from tests.integration.test_crash_recovery import gone
from tests.integration.test_pool import ADMIN, chat, client_for, in_thread
from web.app import create_app

MESSAGES = [{"role": "user", "content": "hi"}]


def post_chat(c: FlaskClient, model: str, **kw: Any) -> Any:
    """A chat request with exactly the given fields (no default max_tokens)."""
    return c.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, **kw})


def configure(c: FlaskClient, section: str, **values: Any) -> None:
    resp = c.patch("/admin/config", json={section: values}, headers=ADMIN)
    assert resp.status_code == 200, resp.get_json()


def faults(c: FlaskClient, **body: Any) -> None:
    resp = c.post("/admin/faults", json=body, headers=ADMIN)
    assert resp.status_code == 200, resp.get_json()


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


def cancelled(pool: Pool, model: str) -> int:
    labels = json.dumps({"model": model}, sort_keys=True, separators=(",", ":"))
    raw = pool.r.hget(keys.metric_counters(), f"{metrics.CANCELLED_TOTAL}|{labels}")
    return int(float(str(raw or 0)))


def queued(pool: Pool, model: str) -> list[Request]:
    return [Request.loads(str(x)) for x in pool.r.lrange(keys.queue(model), 0, -1)]


def in_flight(pool: Pool, model: str) -> list[Request]:
    return [Request.loads(str(x)) for x in pool.r.lrange(keys.processing(model), 0, -1)]


@contextmanager
def http_server(pool: Pool) -> Iterator[int]:
    """The web app on a real socket (werkzeug's threaded server): its port."""
    srv = make_server("127.0.0.1", 0, create_app(pool.box), threaded=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_port
    finally:
        srv.shutdown()
        t.join(10)


def raw_post(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """Send one HTTP request and return the open connection (the caller closes it)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(head + data)
    return s


# --- max_tokens cap ----------------------------------------------------------------------------


def test_the_models_max_tokens_bounds_every_request(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start_pool(models=tiny_models(models_dir, a={"max_tokens": 5}))
    c = client_for(pool)
    # No max_tokens: the cap, not the rest of the context.
    resp = post_chat(c, "a")
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["usage"]["completion_tokens"] == 5
    # A larger one is clamped (no error); a smaller one is kept.
    resp = post_chat(c, "a", max_tokens=1000)
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["usage"]["completion_tokens"] == 5
    resp = post_chat(c, "a", max_completion_tokens=3)
    assert resp.get_json()["usage"]["completion_tokens"] == 3
    # Streamed: as many content chunks as tokens, at most the cap.
    text = post_chat(c, "a", stream=True, max_tokens=1000).get_data(as_text=True)
    contents = [
        e
        for e in sse_events(text)
        if e != "[DONE]" and json.loads(e)["choices"][0]["delta"].get("content")
    ]
    assert 1 <= len(contents) <= 5
    # Another model keeps its own bound (its n_ctx): the cap is per model.
    resp = post_chat(c, "b", max_tokens=7)
    assert resp.get_json()["usage"]["completion_tokens"] == 7


# --- deadline ------------------------------------------------------------------------------------


def test_a_slow_stream_past_its_deadline_ends_with_deadline_exceeded(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200  # loaded: the deadline runs against generation
    pid = pool.pid("a")
    configure(c, "server", request_deadline_s=2)
    faults(c, token_delay_s={"a": 0.25})
    resp = post_chat(c, "a", stream=True, max_tokens=200)
    assert resp.status_code == 200
    events = sse_events(resp.get_data(as_text=True))
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "deadline_exceeded", last
    # It streamed some tokens first, and far fewer than it asked for.
    tokens = [e for e in events[:-2] if json.loads(e)["choices"][0]["delta"].get("content")]
    assert 1 <= len(tokens) < 200
    # Stopped, not killed: the same process is idle and serves the next request.
    assert in_flight(pool, "a") == []
    faults(c, token_delay_s={"a": 0})
    assert chat(c, "a").status_code == 200
    assert pool.pid("a") == pid


def test_a_slow_non_stream_request_past_its_deadline_gets_504(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    configure(c, "server", request_deadline_s=2)
    faults(c, token_delay_s={"a": 0.25})
    resp = post_chat(c, "a", max_tokens=200)
    assert resp.status_code == 504, resp.get_json()
    assert resp.get_json()["error"]["code"] == "deadline_exceeded"
    assert in_flight(pool, "a") == [] and pool.pid("a") == pid
    faults(c, token_delay_s={"a": 0})
    assert chat(c, "a").status_code == 200


def test_a_request_still_queued_at_its_deadline_is_answered_without_generating(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    configure(c, "server", request_deadline_s=2)
    faults(c, hold={"a": True})
    t1, out1 = in_thread(lambda: post_chat(client_for(pool), "a", max_tokens=4))
    pool.wait_for(lambda: len(in_flight(pool, "a")) == 1, what="the first request held")
    t2, out2 = in_thread(lambda: post_chat(client_for(pool), "a", max_tokens=4))
    pool.wait_for(lambda: len(queued(pool, "a")) == 1, what="the second request queued")
    second = queued(pool, "a")[0]
    t1.join(60)
    t2.join(60)
    # The held one is stopped by its deadline too (a hold honours it, as a generation does).
    assert out1[0].status_code == 504 and out2[0].status_code == 504
    assert out2[0].get_json()["error"]["code"] == "deadline_exceeded"
    assert queued(pool, "a") == [] and in_flight(pool, "a") == []
    # It never produced output: no reply stream was left behind for it.
    assert not pool.r.exists(keys.reply(second.id))


# --- a client that goes away -------------------------------------------------------------------


def test_a_stream_whose_client_leaves_while_queued_is_never_generated(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    faults(c, hold={"a": True})
    t1, out1 = in_thread(lambda: chat(client_for(pool), "a"))
    pool.wait_for(lambda: len(in_flight(pool, "a")) == 1, what="the first request held")
    first = in_flight(pool, "a")[0]
    with http_server(pool) as port:
        conn = raw_post(
            port,
            "/v1/chat/completions",
            {"model": "a", "messages": MESSAGES, "max_tokens": 4, "stream": True},
        )
        pool.wait_for(lambda: len(queued(pool, "a")) == 1, what="the stream queued")
        waiting = queued(pool, "a")[0]
        conn.close()
        # Web sees the closed connection and takes the request out of the queue.
        pool.wait_for(lambda: queued(pool, "a") == [], what="the stream withdrawn")
        assert [r.id for r in in_flight(pool, "a")] == [first.id]
    faults(c, hold={"a": False})
    t1.join(60)
    assert out1[0].status_code == 200
    pool.wait_for(lambda: in_flight(pool, "a") == [], what="the model idle")
    # The model never took it: no reply stream, no cancel flag (it needed none), nothing
    # cancelled mid-generation.
    assert not pool.r.exists(keys.reply(waiting.id))
    assert not pool.r.exists(keys.cancel(waiting.id))
    assert cancelled(pool, "a") == 0


def test_a_non_stream_request_whose_client_leaves_stops_generating(
    start_pool: Callable[..., Pool],
) -> None:
    """The cancel flag reaches a non-stream generation at its next token (it used to be read
    only before the generation started)."""
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    faults(c, token_delay_s={"a": 0.25})
    with http_server(pool) as port:
        conn = raw_post(
            port, "/v1/chat/completions", {"model": "a", "messages": MESSAGES, "max_tokens": 400}
        )
        pool.wait_for(lambda: len(in_flight(pool, "a")) == 1, what="the request generating")
        req = in_flight(pool, "a")[0]
        conn.close()
        pool.wait_for(lambda: cancelled(pool, "a") == 1, what="the generation cancelled")
    pool.wait_for(lambda: in_flight(pool, "a") == [], what="the model idle")
    assert not pool.r.exists(keys.reply(req.id))  # a cancelled request writes no result
    faults(c, token_delay_s={"a": 0})
    assert chat(c, "a").status_code == 200
    assert pool.pid("a") == pid


# --- stall watchdog ----------------------------------------------------------------------------


def test_a_slow_generation_that_progresses_is_not_a_stall(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    configure(c, "worker", stall_s=1)
    # Busy far longer than stall_s, but every token is progress.
    faults(c, token_delay_s={"a": 0.2})
    resp = post_chat(c, "a", max_tokens=20)
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["usage"]["completion_tokens"] == 20
    assert pool.pid("a") == pid


def test_a_hung_generation_is_killed_and_answered_model_stalled(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    first = pool.pid("a")
    assert first
    configure(c, "worker", stall_s=1)
    # The reload waits (load_delay_s) until the hang is cleared, so the queued request is
    # served by a process that does not hang.
    faults(c, hang={"a": True}, load_delay_s={"a": 600})
    t1, out1 = in_thread(lambda: chat(client_for(pool), "a"))
    pool.wait_for(lambda: len(in_flight(pool, "a")) == 1, what="the hung request in flight")
    t2, out2 = in_thread(lambda: chat(client_for(pool), "a"))
    pool.wait_for(lambda: len(queued(pool, "a")) == 1, what="a request queued behind it")
    t1.join(60)
    assert out1, "the hung request was never answered"
    assert out1[0].status_code == 500, out1[0].get_json()
    err = out1[0].get_json()["error"]
    assert err["code"] == "model_stalled" and "no progress" in err["message"]
    pool.wait_for(lambda: gone(first), what="the hung process killed")
    # The queued request stays queued (not failed with the hung one), waiting for the reload.
    assert not out2 and len(queued(pool, "a")) == 1
    faults(c, hang={"a": False}, load_delay_s={"a": 0})
    t2.join(60)
    assert out2 and out2[0].status_code == 200, out2 and out2[0].get_json()
    second = pool.pid("a")
    assert second not in (None, first)
    assert chat(c, "a").status_code == 200 and pool.pid("a") == second
