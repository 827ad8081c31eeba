"""A streaming client that waits for its model's load sees the load's progress: real Redis, a
real pool, the web app on a real socket, a load slowed by the fault injection (which reports
its delay as progress in steps, then the real load's own)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from residency import keys
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import faults, http_server
from tests.integration.test_pool import ADMIN, client_for
from web import load_progress

MESSAGES = [{"role": "user", "content": "hi"}]
#: Long enough for several progress steps at the web's pace, short enough for a test.
DELAY_S = 2
LOADING = re.compile(r"^: loading (\S+) (\d+)%$")


def slow_pool(start_pool: Callable[..., Pool], models_dir: Path, **models: Any) -> Pool:
    pool = start_pool(models=tiny_models(models_dir, **models), debug={"fault_injection": True})
    faults(client_for(pool), load_delay_s={name: DELAY_S for name in ("a", "b", "c")})
    return pool


def stream_lines(port: int, path: str, body: dict[str, Any]) -> list[str]:
    """The lines of a streamed answer, as they came."""
    url = f"http://127.0.0.1:{port}{path}"
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=120) as resp:
        assert resp.status_code == 200, resp.text
        return [line for line in resp.iter_lines(decode_unicode=True) if line]


def percents(lines: list[str], model: str) -> list[int]:
    out = []
    for line in lines:
        m = LOADING.match(line)
        if m:
            assert m.group(1) == model
            out.append(int(m.group(2)))
    return out


def data(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def first_index(lines: list[str], pred: Callable[[str], bool]) -> int:
    return next(i for i, line in enumerate(lines) if pred(line))


def last_index(lines: list[str], pred: Callable[[str], bool]) -> int:
    return max(i for i, line in enumerate(lines) if pred(line))


def test_a_stream_sees_its_models_load_in_order_before_its_first_token(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = slow_pool(start_pool, models_dir)
    with http_server(pool) as port:
        body = {"model": "a", "messages": MESSAGES, "max_tokens": 4}
        lines = stream_lines(port, "/v1/chat/completions", body)
        seen = percents(lines, "a")
        assert len(seen) >= 3, lines
        assert seen == sorted(set(seen)), seen  # strictly increasing
        is_loading = LOADING.match
        assert last_index(lines, lambda x: bool(is_loading(x))) < first_index(
            lines, lambda x: x.startswith("data: ")
        )
        chunks = data(lines)
        # Without show_loading nothing of the load is in the answer.
        assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert lines[-1] == "data: [DONE]"
        # The load is over: its progress is gone, and the next stream sees none.
        assert pool.r.get(keys.load_progress("a")) is None
        assert percents(stream_lines(port, "/v1/chat/completions", body), "a") == []
        # A completion waiting for a load sees it too.
        completion = {"model": "b", "prompt": "the world", "max_tokens": 3}
        seen = percents(stream_lines(port, "/v1/completions", completion), "b")
        assert len(seen) >= 3 and seen == sorted(set(seen)), seen


def test_show_loading_puts_the_load_in_reasoning_never_in_content(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = slow_pool(start_pool, models_dir, a={"show_loading": True})
    with http_server(pool) as port:
        body = {"model": "a", "messages": MESSAGES, "max_tokens": 4}
        lines = stream_lines(port, "/v1/chat/completions", body)
        chunks = data(lines)
        thoughts = [c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks]
        shown = [t for t in thoughts if t.startswith("loading a ")]
        assert len(shown) >= 3, lines
        assert [t.strip() for t in shown] == [f"loading a {p}%" for p in percents(lines, "a")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert content and "loading" not in content
        # The reasoning came before any answer.
        first_content = next(
            i for i, c in enumerate(chunks) if c["choices"][0]["delta"].get("content")
        )
        assert all(thoughts[i] == "" for i in range(first_content, len(chunks)))
        # Live: turned off, the next load of the model shows only comments.
        c = client_for(pool)
        spec = {**tiny_models(models_dir)["a"], "show_loading": False}
        resp = c.put("/admin/models/a", json=spec, headers=ADMIN)
        assert resp.status_code in (200, 201), resp.get_json()
        resp = c.post("/admin/models/a/unload", headers=ADMIN)
        assert resp.status_code in (200, 202), resp.get_json()
        pool.wait_for(lambda: pool.state("a") == "unloaded", what="a unloaded")
        lines = stream_lines(port, "/v1/chat/completions", body)
        assert len(percents(lines, "a")) >= 3
        assert not any("reasoning_content" in c["choices"][0]["delta"] for c in data(lines))


def test_messages_stream_pings_and_thinks_while_its_model_loads(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = slow_pool(start_pool, models_dir, b={"show_loading": True})
    with http_server(pool) as port:
        body = {"model": "a", "max_tokens": 4, "messages": MESSAGES}
        lines = stream_lines(port, "/v1/messages", body)
        seen = percents(lines, "a")
        assert len(seen) >= 3 and seen == sorted(set(seen)), seen
        events = [x.removeprefix("event: ") for x in lines if x.startswith("event: ")]
        assert events.count("ping") >= len(seen)
        assert events.index("message_start") > events.index("ping")
        assert "thinking_delta" not in "".join(lines)
        # With show_loading: a thinking block holds the load, the text block the answer.
        lines = stream_lines(port, "/v1/messages", {**body, "model": "b"})
        deltas = [d["delta"] for d in data(lines) if d["type"] == "content_block_delta"]
        thinking = [d["thinking"] for d in deltas if d["type"] == "thinking_delta"]
        text = "".join(d["text"] for d in deltas if d["type"] == "text_delta")
        assert len([t for t in thinking if t.startswith("loading b ")]) >= 3
        assert text and "loading" not in text
        assert data(lines)[0]["type"] == "message_start"


def test_a_whole_answer_is_unchanged_by_a_slow_load(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = slow_pool(start_pool, models_dir, a={"show_loading": True})
    with http_server(pool) as port:
        body = {"model": "a", "messages": MESSAGES, "max_tokens": 4}
        resp = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200
        assert resp.text.startswith("{")
        msg = resp.json()["choices"][0]["message"]
        assert msg["content"] and "loading" not in msg["content"]
        assert "loading" not in str(msg.get("reasoning_content"))


@pytest.mark.parametrize(
    ("state", "token", "raw", "want"),
    [
        ("loading", "T2", '{"token": "T2", "fraction": 0.4}', 0.4),
        # One left by an earlier load (another token), or shown after its load ended: never.
        ("loading", "T2", '{"token": "T1", "fraction": 0.9}', None),
        ("ready", "T2", '{"token": "T2", "fraction": 0.9}', None),
        ("loading", "T2", "not json", None),
        ("loading", "T2", None, None),
    ],
)
def test_progress_shows_only_for_the_load_under_way(
    state: str, token: str, raw: str | None, want: float | None
) -> None:
    assert load_progress.parse(state, token, raw) == want


def test_a_watch_shows_each_step_once_and_only_forward(r: redis.Redis) -> None:
    r.hset(keys.model("w"), mapping={"state": "loading", "token": "T"})
    watch = load_progress.Watch(r, "w")
    steps = []
    for fraction in (0.1, 0.1, 0.3, 0.2, 0.5):
        r.set(keys.load_progress("w"), json.dumps({"token": "T", "fraction": fraction}))
        watch._next = 0.0  # due now: this test is about what it shows, not when
        steps.append(watch.poll())
    assert [s.percent if s else None for s in steps] == [10, None, 30, None, 50]


def test_an_ollama_stream_sees_the_load_as_status_lines(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = slow_pool(start_pool, models_dir)
    with http_server(pool) as port:
        body = {"model": "a", "messages": MESSAGES, "options": {"num_predict": 4}}
        objs = [json.loads(x) for x in stream_lines(port, "/api/chat", body)]
        status = [o for o in objs if "status" in o]
        shown = [int(o["status"].removeprefix("loading a ").rstrip("%")) for o in status]
        assert len(shown) >= 3 and shown == sorted(set(shown)), status
        assert all(o["message"]["content"] == "" and o["done"] is False for o in status)
        first_text = next(i for i, o in enumerate(objs) if o["message"]["content"])
        assert objs.index(status[-1]) < first_text
        assert objs[-1]["done"] is True


def test_only_a_request_admitted_for_the_loading_model_sees_its_load(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    """Mallory's key may use b only: asking for a while it loads gets a 403 and nothing of the
    load; her stream for b, waiting behind a's load, sees b's load and never a's."""
    pool = start_pool(
        models=tiny_models(models_dir),
        debug={"fault_injection": True},
        auth={"required": True, "public_health": True},
    )
    c = client_for(pool)
    faults(c, load_delay_s={"a": DELAY_S, "b": DELAY_S})
    keys_of = {}
    for user, model in (("alice", "a"), ("mallory", "b")):
        assert c.post("/admin/users", json={"name": user}, headers=ADMIN).status_code == 201
        resp = c.post(f"/admin/users/{user}/keys", json={"models": [model]}, headers=ADMIN)
        assert resp.status_code == 201, resp.get_json()
        keys_of[user] = {"Authorization": f"Bearer {resp.get_json()['key']}"}
    with http_server(pool) as port:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "a", "messages": MESSAGES, "max_tokens": 4, "stream": True}
        alice = requests.post(url, json=body, headers=keys_of["alice"], stream=True, timeout=120)
        pool.wait_for(lambda: pool.state("a") == "loading", what="a loading")
        refused = requests.post(url, json=body, headers=keys_of["mallory"], timeout=60)
        assert refused.status_code == 403
        assert "loading" not in refused.text
        theirs = requests.post(
            url, json={**body, "model": "b"}, headers=keys_of["mallory"], timeout=120
        )
        assert theirs.status_code == 200
        lines = [x for x in theirs.text.splitlines() if x]
        assert percents(lines, "b")
        assert not any(x.startswith(": loading a ") for x in lines)
        with alice:
            assert len(percents([x for x in alice.iter_lines(decode_unicode=True) if x], "a")) >= 3
