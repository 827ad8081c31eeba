"""Saved slot caches through the whole box: real Redis, coordinator, agent, model processes
(llama.cpp, tiny GGUF) that are evicted, reloaded, stopped and started again, requests through
the Flask app.

A conversation's next turn after its model was evicted and loaded again reuses what its slot
held (``timings``: ``prompt_n`` - ``cache_n`` is what the model prefilled) and answers as a
cold slot would; what cannot be trusted (a damaged file, another user's entry, another spec, a
cleared cache) is never restored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flask.testing import FlaskClient

from residency import keys, metrics
from tests.conftest import Pool, tiny_models
from tests.integration.test_auth import add_user, bearer, issue
from tests.integration.test_bounded_work import faults
from tests.integration.test_live_limits import counter
from tests.integration.test_pool import ADMIN, client_for

SYSTEM = "You are the helpdesk of " + " ".join(f"dept{j}" for j in range(30))
KV = {"n_ctx": 1024, "parallel": 2}


def start(start_pool: Callable[..., Pool], models_dir: Path, **kw: Any) -> Pool:
    return start_pool(
        pool={"max_loaded_models": 1},
        models=tiny_models(models_dir, a=KV, b=KV),
        **kw,
    )


def ask(
    c: FlaskClient, messages: list[dict[str, str]], model: str = "a", key: str | None = None
) -> dict[str, Any]:
    resp = c.post(
        "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0},
        headers=bearer(key) if key else {},
    )
    assert resp.status_code == 200, resp.get_json()
    return dict(resp.get_json())


def turn(n: int) -> dict[str, str]:
    return {"role": "user", "content": f"question {n}: " + " ".join(f"w{n}x{j}" for j in range(20))}


def first_turn() -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, turn(1)]


def follow_up(first: dict[str, Any]) -> list[dict[str, str]]:
    answer = {"role": "assistant", "content": text(first)}
    return [*first_turn(), answer, turn(2)]


def text(out: dict[str, Any]) -> str:
    return str(out["choices"][0]["message"]["content"])


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def prefilled(out: dict[str, Any]) -> int:
    t = out["timings"]
    return int(t["prompt_n"]) - int(t["cache_n"])


def evict_a(pool: Pool, c: FlaskClient) -> None:
    """Load b in a's place (one model at a time): a drains, saves its slots, unloads."""
    ask(c, [turn(9)], model="b")
    pool.wait_for(lambda: pool.state("a") == "unloaded", what="a evicted")


def saved_first_turn(
    start_pool: Callable[..., Pool], models_dir: Path
) -> tuple[Pool, FlaskClient, dict[str, Any]]:
    """A box whose model a answered the first turn and was then evicted (its slot saved)."""
    pool = start(start_pool, models_dir)
    c = client_for(pool)
    first = ask(c, first_turn())
    evict_a(pool, c)
    return pool, c, first


def entries(pool: Pool, model: str = "a") -> list[Path]:
    return sorted((pool.box.data_dir / "slot-cache" / model).glob("*.kvc"))


def health_model(c: FlaskClient, pool: Pool, name: str) -> dict[str, Any]:
    gen = int(pool.r.get(keys.generation()) or 0)
    pool.wait_for(
        lambda: json.loads(str(pool.r.hget(keys.health(), "record")))["generation"] > gen,
        what="a newer health record",
    )
    h = c.get("/health", headers=ADMIN).get_json()
    return next(m for m in h["models"] if m["name"] == name)


def test_a_conversation_survives_its_models_eviction_and_answers_as_a_cold_one(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool, c, first = saved_first_turn(start_pool, models_dir)
    assert len(entries(pool)) == 1
    assert counter(pool, metrics.KV_SAVES_TOTAL, model="a", outcome="saved") == 1

    restored = ask(c, follow_up(first))
    # The whole first turn came back from disk: only the new turn was prefilled.
    assert cached(restored) >= first["usage"]["prompt_tokens"]
    assert (
        prefilled(restored) <= restored["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
    )
    assert counter(pool, metrics.KV_RESTORES_TOTAL, model="a") == 1
    assert counter(pool, metrics.KV_RESTORED_TOKENS_TOTAL, model="a") == cached(restored)
    cache = health_model(c, pool, "a")["cache"]
    assert cache["hits"] == 1 and cache["entries"] >= 1 and cache["bytes"] > 0

    # Emptied by the admin: the next load finds nothing, and the same turn from a cold slot
    # answers the same.
    resp = c.delete("/admin/cache?model=a", headers=ADMIN)
    assert resp.status_code == 200 and resp.get_json()["cleared"] == "a"
    evict_a(pool, c)
    pool.wait_for(lambda: entries(pool) == [], what="the agent deleting the cleared entries")
    cold = ask(c, follow_up(first))
    assert cached(cold) == 0
    assert text(cold) == text(restored)


def test_a_damaged_entry_is_ignored_deleted_and_counted(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start(start_pool, models_dir)
    c = client_for(pool)
    first = ask(c, first_turn())
    answers = []
    for damage in ("flip", "truncate"):
        evict_a(pool, c)
        (path,) = entries(pool)
        raw = bytearray(path.read_bytes())
        if damage == "flip":
            raw[-20] ^= 0xFF
        else:
            del raw[len(raw) // 2 :]
        path.write_bytes(bytes(raw))
        out = ask(c, follow_up(first))
        assert cached(out) == 0  # prefilled, never loaded from the damaged file
        answers.append(text(out))
        assert not path.exists()
    assert answers[0] == answers[1]
    assert counter(pool, metrics.KV_DROPPED_TOTAL, model="a", reason="corrupt") == 2
    assert counter(pool, metrics.KV_RESTORES_TOTAL, model="a") == 0


def test_scope_user_never_restores_another_users_entry(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start(start_pool, models_dir, auth={"required": True, "public_health": True})
    c = client_for(pool)
    add_user(c, "ann")
    add_user(c, "bob")
    ann, bob = issue(c, "ann"), issue(c, "bob")
    ask(c, first_turn(), key=ann)
    ask(c, [turn(9)], model="b", key=ann)
    pool.wait_for(lambda: pool.state("a") == "unloaded", what="a evicted")
    theirs = ask(c, [*first_turn(), turn(3)], key=bob)
    assert cached(theirs) == 0
    mine = ask(c, [*first_turn(), turn(3)], key=ann)
    assert cached(mine) > 0  # ann's own entry: restored for her (bob's slot did not hold it)
    assert counter(pool, metrics.KV_RESTORES_TOTAL, model="a") == 1


def test_a_spec_change_never_restores_an_old_entry(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool, c, first = saved_first_turn(start_pool, models_dir)
    assert len(entries(pool)) == 1
    spec = {"path": str(models_dir / "tiny0.gguf"), "n_ctx": 1024, "parallel": 1}
    resp = c.put("/admin/models/a", json=spec, headers=ADMIN)
    assert resp.status_code == 200, resp.get_json()
    out = ask(c, follow_up(first))
    assert cached(out) == 0
    assert counter(pool, metrics.KV_RESTORES_TOTAL, model="a") == 0
    pool.wait_for(lambda: entries(pool) == [], what="the stale entry deleted")


def test_saved_slots_survive_a_restart_of_the_whole_box(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start(start_pool, models_dir)
    first = ask(client_for(pool), first_turn())
    # Stopping the box stops the model process: it saves its slots on the way out.
    pool.stop.set()
    for t in pool.threads:
        t.join(timeout=60)
    assert len(entries(pool)) == 1
    again = start(start_pool, models_dir)
    out = ask(client_for(again), follow_up(first))
    assert cached(out) >= first["usage"]["prompt_tokens"]


def test_a_follow_up_sent_right_after_its_client_closed_the_stream_finds_its_own_slot(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start(start_pool, models_dir, debug={"fault_injection": True})
    c = client_for(pool)
    # Slow steps: the first answer is still being written when the follow-up arrives, and a
    # cancel takes a few steps to reach the engine.
    faults(c, step_delay_s={"a": 0.05})
    body = {"model": "a", "messages": first_turn(), "max_tokens": 400, "temperature": 0}
    resp = c.post("/v1/chat/completions", json={**body, "stream": True}, buffered=False)
    seen = ""
    chunks = iter(resp.response)
    while len(seen) < 12:
        line = next(chunks).decode()
        for part in line.split("\n"):
            if part.startswith("data: {"):
                delta = json.loads(part[6:])["choices"][0]["delta"]
                seen += delta.get("content") or ""
    resp.close()  # the user pressed stop
    messages = [*first_turn(), {"role": "assistant", "content": seen}, turn(2)]
    out = ask(c, messages)
    faults(c, step_delay_s={"a": 0})
    first_prompt = ask(c, first_turn())["usage"]["prompt_tokens"]
    # Its own slot (waited for, or copied while it finished): at least the whole first turn
    # was cached, where a cold slot would have had nothing.
    assert cached(out) >= first_prompt


def test_deleting_a_model_or_emptying_every_cache_removes_the_saved_slots(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    pool = start(start_pool, models_dir)
    c = client_for(pool)
    spec = {"path": str(models_dir / "tiny2.gguf"), **KV}
    assert c.put("/admin/models/d", json=spec, headers=ADMIN).status_code == 201
    ask(c, first_turn(), model="d")
    ask(c, first_turn(), model="a")  # d evicted: saved
    pool.wait_for(lambda: pool.state("d") == "unloaded", what="d evicted")
    assert len(entries(pool, "d")) == 1
    assert c.delete("/admin/models/d", headers=ADMIN).status_code == 200
    pool.wait_for(lambda: entries(pool, "d") == [], what="the deleted model's slots removed")

    evict_a(pool, c)  # a saved; b loaded
    assert len(entries(pool, "a")) == 1
    assert c.delete("/admin/cache").status_code == 401  # the admin's only
    resp = c.delete("/admin/cache", headers=ADMIN)
    assert resp.status_code == 200 and resp.get_json()["cleared"] == "*"
    pool.wait_for(lambda: entries(pool, "a") == [], what="every saved slot removed")
    assert health_model(c, pool, "a")["cache"] == {"entries": 0, "bytes": 0, "hits": 0}


def test_saved_slots_survive_a_model_process_crash(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    import os
    import signal

    pool, c, first = saved_first_turn(start_pool, models_dir)
    restored = ask(c, follow_up(first))
    assert cached(restored) >= first["usage"]["prompt_tokens"]
    pid = pool.pid("a")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # its slots die with it; what was saved before does not
    pool.wait_for(lambda: pool.state("a") != "ready" or pool.pid("a") != pid, what="the crash seen")
    again = ask(c, follow_up(first))
    assert cached(again) >= first["usage"]["prompt_tokens"]
    assert counter(pool, metrics.KV_RESTORES_TOTAL, model="a") == 2
