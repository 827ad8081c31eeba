"""What a model process does when its engine is slow, dies, or its client leaves, against real
parts: a real Redis, the coordinator and agent running, real model processes (llama.cpp, tiny
GGUF), requests through the Flask app (and a real socket where a client must go away).

``step_delay_s`` slows every engine step (a prefill of many slow chunks), ``engine_crash``
makes the engine thread raise at a step of the next request; every assertion is on an outcome
(status, counts, pids, keys), never on how long something took.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

from residency import keys
from residency.tinymodel import write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import (
    configure,
    faults,
    http_server,
    in_flight,
    raw_post,
)
from tests.integration.test_crash_recovery import gone
from tests.integration.test_pool import chat, client_for

# ~300 prompt tokens (the tiny vocabulary spells most words by pieces).
LONG = " ".join(f"line{j}" for j in range(40))


def test_a_prefill_longer_than_stall_s_is_progress_not_a_stall(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    n_batch = 16
    pool = start_pool(
        models=tiny_models(models_dir, a={"n_batch": n_batch}), debug={"fault_injection": True}
    )
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pid = pool.pid("a")
    stall_s, delay = 1.0, 0.2
    configure(c, "worker", stall_s=stall_s)
    faults(c, step_delay_s={"a": delay})
    resp = c.post(
        "/v1/chat/completions",
        json={"model": "a", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2},
    )
    assert resp.status_code == 200, resp.get_json()
    prompt = resp.get_json()["usage"]["prompt_tokens"]
    # Its prefill alone took more slowed steps than stall_s allows without progress.
    assert (prompt // n_batch) * delay > 3 * stall_s
    assert pool.pid("a") == pid
    faults(c, step_delay_s={"a": 0})


def test_a_dead_engine_thread_ends_its_process_and_the_model_is_reloaded(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    first = pool.pid("a")
    assert first
    faults(c, engine_crash={"a": True})
    # The request whose step raised is handed back with the dead process's work and served
    # by the reloaded model, not answered 500.
    resp = chat(c, "a")
    assert resp.status_code == 200, resp.get_json()
    pool.wait_for(lambda: gone(first), what="the process with the dead engine gone")
    second = pool.pid("a")
    assert second not in (None, first)
    assert not pool.r.hexists(keys.faults(), "engine_crash:a")  # consumed once
    assert chat(c, "a").status_code == 200 and pool.pid("a") == second


def _read_until_content(conn: socket.socket) -> None:
    seen = b""
    while b'"content":"' not in seen:
        got = conn.recv(4096)
        assert got, "the stream ended before any content"
        seen += got


def test_cancelled_streams_leave_no_reply_stream_without_a_ttl(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    # Still a fast model (a flush every few tokens), but one whose streams outlast the moment
    # their clients leave.
    faults(c, token_delay_s={"a": 0.005})
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with http_server(pool) as port:
        for _ in range(5):
            conn = raw_post(port, "/v1/chat/completions", {**body, "max_tokens": 400})
            _read_until_content(conn)
            conn.close()
            pool.wait_for(lambda: in_flight(pool, "a") == [], what="the stream stopped")
    faults(c, token_delay_s={"a": 0})
    replies = list(pool.r.scan_iter(match=keys.reply("*")))
    assert [k for k in replies if pool.r.ttl(k) == -1] == []


MISTRAL_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_a_chat_templates_refusal_is_a_400_naming_it(
    start_pool: Callable[..., Pool], models_dir: Path, tmp_path: Path
) -> None:
    path = write_tiny_model(tmp_path / "alternating.gguf", seed=4, chat_template=MISTRAL_LIKE)
    models = {"m": {"path": str(path), "n_ctx": 512, "parallel": 1}}
    pool = start_pool(models=models, server={"model_dirs": [str(models_dir), str(tmp_path)]})
    c = client_for(pool)
    assert chat(c, "m").status_code == 200
    pid = pool.pid("m")
    two_users = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    for stream in (False, True):
        resp = c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": two_users, "max_tokens": 4, "stream": stream},
        )
        assert resp.status_code == 400, resp.get_data(as_text=True)
        err = json.loads(resp.get_data(as_text=True))["error"]
        assert err["code"] == "invalid_messages" and err["param"] == "messages"
        assert "roles must alternate" in err["message"]
    # The model process lives on and serves the next request.
    assert chat(c, "m").status_code == 200 and pool.pid("m") == pid
