"""A remote model's requests obey every quota and count their usage like a local model's,
through real keys over HTTP against a local fake OpenAI upstream (``Remote``): the upstream's
``usage`` when it reports one (a stream is asked for it, and a client that did not ask never
sees it), else an estimate that never counts less than the request could have used."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient

from residency import keys
from tests.integration.test_quotas import Caller, at_once, caller, refused
from tests.integration.test_remote_hardening import (
    PATH,
    USAGE,
    Remote,
    make_client,
    register,
)
from web import quota

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def upstream() -> Iterator[Remote]:
    srv = Remote()
    yield srv
    srv.close()


def today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


def ask(c: FlaskClient, who: Caller, model: str, **kw: Any) -> Any:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, **kw}
    return c.post(PATH, json=body, headers=who.headers)


def usage_of(r: redis.Redis, user: str, model: str) -> dict[str, int]:
    day = keys.usage(today())
    return {
        k: int(r.hget(day, keys.usage_field(user, model, k)) or 0)
        for k in ("requests", "prompt_tokens", "completion_tokens")
    }


def tokens_of(r: redis.Redis, subject: str, name: str) -> int:
    return int(r.hget(keys.quota_day(today()), keys.quota_field("tokens", subject, name)) or 0)


def test_remote_usage_is_counted_and_its_tokens_per_day_obeyed(
    tmp_path: Path, redis_url: str, r: redis.Redis, upstream: Remote
) -> None:
    register(r, "up", upstream.url("usage"))
    c = make_client(tmp_path, redis_url, allow_local=True)
    ann = caller(c, "ann", key_quotas={"tokens_per_day": 1000}, tokens_per_day=30)
    total = USAGE["total_tokens"]
    assert ask(c, ann, "up").status_code == 200
    assert usage_of(r, "user:ann", "up") == {
        "requests": 1,
        "prompt_tokens": USAGE["prompt_tokens"],
        "completion_tokens": USAGE["completion_tokens"],
    }
    assert tokens_of(r, "user", "user:ann") == total and tokens_of(r, "key", ann.key_id) == total
    assert ask(c, ann, "up").status_code == 200  # 18 < 30
    msg = refused(ask(c, ann, "up"), "tokens per day")
    assert msg.startswith(f"user 'ann' reached its quota of 30 tokens per day ({2 * total} used")
    assert upstream.hits == ["usage", "usage"]  # the refused one was never sent
    assert usage_of(r, "user:ann", "up")["requests"] == 2


def test_a_remote_stream_reports_its_usage_to_the_box_not_to_a_client_that_did_not_ask(
    tmp_path: Path, redis_url: str, r: redis.Redis, upstream: Remote
) -> None:
    register(r, "up", upstream.url("usage"))
    c = make_client(tmp_path, redis_url, allow_local=True)
    ann = caller(c, "ann")
    resp = ask(c, ann, "up", stream=True)
    assert resp.status_code == 200
    events = [e.removeprefix("data: ") for e in resp.get_data(as_text=True).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [ch["choices"][0]["delta"]["content"] for ch in chunks] == ["hel", "lo"]
    assert not any("usage" in ch for ch in chunks)
    assert upstream.bodies[-1]["stream_options"] == {"include_usage": True}
    assert usage_of(r, "user:ann", "up")["prompt_tokens"] == USAGE["prompt_tokens"]
    assert tokens_of(r, "user", "user:ann") == USAGE["total_tokens"]
    # A client that asked for it gets it.
    resp = ask(c, ann, "up", stream=True, stream_options={"include_usage": True})
    chunks = [
        json.loads(e.removeprefix("data: "))
        for e in resp.get_data(as_text=True).split("\n\n")
        if e and e != "data: [DONE]"
    ]
    assert chunks[-1]["usage"] == USAGE
    assert tokens_of(r, "user", "user:ann") == 2 * USAGE["total_tokens"]


def test_a_remote_without_usage_is_charged_an_upper_bound(
    tmp_path: Path, redis_url: str, r: redis.Redis, upstream: Remote
) -> None:
    register(r, "plain", upstream.url("ok"))  # answers "hi", reports no usage
    c = make_client(tmp_path, redis_url, allow_local=True)
    ann = caller(c, "ann")
    assert ask(c, ann, "plain").status_code == 200
    prompt = quota.prompt_bytes({"messages": MESSAGES})
    assert usage_of(r, "user:ann", "plain") == {
        "requests": 1,
        "prompt_tokens": prompt,
        "completion_tokens": len(b"hi"),
    }


def test_remote_requests_obey_the_per_minute_quota_at_once(
    tmp_path: Path, redis_url: str, r: redis.Redis, upstream: Remote
) -> None:
    register(r, "up", upstream.url("usage"))
    c = make_client(tmp_path, redis_url, allow_local=True)
    ann = caller(c, "ann", requests_per_minute=3)
    codes = sorted(x.status_code for x in at_once(10, lambda i: ask(c, ann, "up")))
    assert codes == [200] * 3 + [429] * 7
    assert upstream.hits == ["usage"] * 3
    assert usage_of(r, "user:ann", "up")["requests"] == 3
