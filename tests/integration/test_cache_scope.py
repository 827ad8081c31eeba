"""``[cache] scope`` through the whole box: real Redis, coordinator, agent, a model process
(llama.cpp, tiny GGUF), requests with two users' keys through the Flask app.

A slot's cached prompt prefix belongs to the user whose request filled it. What another user
may reuse — and so read back in ``cached_tokens`` — is nothing (``user``), the part of the
prompt its system message covers (``shared_system``), or all of it (``global``); the answers
at temperature 0 are the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flask.testing import FlaskClient

from tests.conftest import Pool, tiny_models
from tests.integration.test_auth import add_user, bearer, issue
from tests.integration.test_bounded_work import configure
from tests.integration.test_pool import client_for

# ~150 tokens of system prompt and ~150 of user text (the tiny vocabulary spells by pieces).
SYSTEM = "You are the helpdesk of " + " ".join(f"dept{j}" for j in range(30))


def ask(c: FlaskClient, key: str, system: str | None, user: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    resp = c.post(
        "/v1/chat/completions",
        json={"model": "a", "messages": messages, "max_tokens": 8, "temperature": 0},
        headers=bearer(key),
    )
    assert resp.status_code == 200, resp.get_json()
    return dict(resp.get_json())


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def text(out: dict[str, Any]) -> str:
    return str(out["choices"][0]["message"]["content"])


def question(n: int) -> str:
    return f"question {n}: " + " ".join(f"item{n}x{j}" for j in range(30))


def test_another_users_prompt_is_reused_only_as_far_as_the_scope_allows(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    # One slot: each request finds the cache of the one before it.
    pool = start_pool(models=tiny_models(models_dir, a={"n_ctx": 1024, "parallel": 1}))
    c = client_for(pool)
    add_user(c, "ann")
    add_user(c, "bob")
    ann, bob = issue(c, "ann"), issue(c, "bob")

    # user (the default): bob reuses nothing of ann's identical prompt; ann reuses her own.
    first = ask(c, ann, SYSTEM, question(1))
    pid = pool.pid("a")
    assert cached(ask(c, ann, SYSTEM, question(1))) > 0
    again = ask(c, bob, SYSTEM, question(1))
    assert cached(again) == 0
    assert text(again) == text(first)
    # Nor does a guess of her prompt's start without a system message of his own.
    ask(c, ann, SYSTEM, question(2))
    assert cached(ask(c, bob, None, SYSTEM)) == 0

    # shared_system: bob reuses the system part of ann's prompt, and nothing of her question,
    # even when his question is hers.
    configure(c, "cache", scope="shared_system")
    mine = ask(c, ann, SYSTEM, question(3))
    same = ask(c, bob, SYSTEM, question(3))
    system_part = cached(same)
    assert 0 < system_part < same["usage"]["prompt_tokens"] - 100
    assert text(same) == text(mine)
    ask(c, ann, SYSTEM, question(4))
    assert cached(ask(c, bob, SYSTEM, question(5))) == system_part
    # A prompt without a system message shares nothing, whatever it holds.
    ask(c, ann, SYSTEM, question(6))
    assert cached(ask(c, bob, None, SYSTEM + question(6))) == 0
    # The same user still reuses all of her own.
    own = ask(c, bob, SYSTEM, question(7))
    assert cached(ask(c, bob, SYSTEM, question(7))) == own["usage"]["prompt_tokens"] - 1

    # global (an oracle): bob reuses all of ann's prompt.
    configure(c, "cache", scope="global")
    hers = ask(c, ann, SYSTEM, question(8))
    his = ask(c, bob, SYSTEM, question(8))
    assert cached(his) == his["usage"]["prompt_tokens"] - 1
    assert text(his) == text(hers)
    # Each change applied to the next request, without a reload.
    assert pool.pid("a") == pid
