"""Fair shares of every bound, against real parts: a real Redis, the coordinator and agent
running, a real model process (llama.cpp, tiny GGUF, one slot) held busy by the ``hold`` fault,
requests through the Flask app with real API keys of two users.

One user filling a model's queue (``pool.max_queue_per_model``) or a web worker's places
(``server.max_in_flight``) cannot shut another user out: the other's first request makes room
by pushing out the first user's newest queued request, which gets the 429 a full queue (or a
full worker) gives, with Retry-After; nothing of it is left in Redis. Assertions are on
statuses, counts and keys, never on durations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from residency import keys
from tests.conftest import Pool, tiny_models
from tests.integration.test_auth import add_user, bearer, issue
from tests.integration.test_bounded_work import configure, faults, in_flight, queued
from tests.integration.test_pool import chat, client_for
from web import admission

M = "a"  # one slot


class Sender:
    """Requests of one user, each in a thread of its own; answers kept as they come."""

    def __init__(self, pool: Pool, key: str) -> None:
        self.pool = pool
        self.headers = bearer(key)
        self.lock = threading.Lock()
        self.answers: list[Any] = []
        self.threads: list[threading.Thread] = []

    def send(self, n: int = 1, **kw: Any) -> None:
        for _ in range(n):
            t = threading.Thread(target=self._one, kwargs=kw, daemon=True)
            t.start()
            self.threads.append(t)

    def _one(self, **kw: Any) -> None:
        body = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        resp = client_for(self.pool).post(
            "/v1/chat/completions", json={**body, **kw}, headers=self.headers
        )
        with self.lock:
            self.answers.append(resp)

    def statuses(self) -> list[int]:
        with self.lock:
            return sorted(a.status_code for a in self.answers)

    def answered(self) -> int:
        with self.lock:
            return len(self.answers)

    def join(self) -> None:
        for t in self.threads:
            t.join(120)
            assert not t.is_alive(), "a request never answered"

    def pushed_out(self) -> list[Any]:
        """The answers of requests that made room for another user's."""
        with self.lock:
            return [a for a in self.answers if "made room" in a.get_json()["error"]["message"]]


def keys_for(pool: Pool, c: FlaskClient, *names: str) -> list[str]:
    out = []
    for n in names:
        add_user(c, n)
        out.append(issue(c, n))
    return out


def left_in_redis(pool: Pool) -> dict[str, Any]:
    """What the requests of model M could leave behind once every one of them is answered."""
    replies = list(pool.r.scan_iter(match=keys.reply("*")))
    return {
        "queue": pool.r.llen(keys.queue(M)),
        "processing": pool.r.llen(keys.processing(M)),
        "tags": pool.r.exists(keys.queue_tags(M), keys.queue_finish(M)),
        "replies": replies,
    }


NOTHING = {"queue": 0, "processing": 0, "tags": 0, "replies": []}


@pytest.fixture
def busy(start_pool: Callable[..., Pool]) -> Iterator[Callable[..., Pool]]:
    """A pool whose model M is loaded, then held: what is sent next waits in its queue."""

    def start(**kw: Any) -> Pool:
        pool = start_pool(debug={"fault_injection": True}, **kw)
        c = client_for(pool)
        assert chat(c, M).status_code == 200
        faults(c, hold={M: True})
        return pool

    yield start


def test_a_user_with_three_times_the_queue_bound_cannot_shut_another_out(
    busy: Callable[..., Pool],
) -> None:
    pool = busy(pool={"max_queue_per_model": 4})
    c = client_for(pool)
    alice_key, bob_key = keys_for(pool, c, "alice", "bob")
    alice, bob = Sender(pool, alice_key), Sender(pool, bob_key)
    alice.send()
    pool.wait_for(lambda: len(in_flight(pool, M)) == 1, what="alice's first in the slot")
    # 12 more: 4 fill the queue, the 8 past the bound are refused (she holds her whole share).
    alice.send(12)
    pool.wait_for(lambda: alice.answered() == 8, what="alice's 8 refused")
    assert alice.statuses() == [429] * 8
    assert len(queued(pool, M)) == 4 and alice.pushed_out() == []
    mine = [r.id for r in queued(pool, M)]  # newest first: the left end is served last
    # Bob's first request finds the queue full, and is within his share (2 of 4): alice's
    # newest queued request makes room.
    bob.send()
    pool.wait_for(lambda: alice.answered() == 9, what="alice's newest pushed out")
    [gone] = alice.pushed_out()
    assert gone.status_code == 429
    assert gone.get_json()["error"]["code"] == "queue_full"
    assert int(gone.headers["Retry-After"]) >= admission.MIN_RETRY_S
    now = queued(pool, M)
    assert [r.user for r in now].count("user:bob") == 1 and len(now) == 4
    assert {r.id for r in now if r.user == "user:alice"} == set(mine[1:])
    # The refusals said when to retry too.
    assert all(int(a.headers["Retry-After"]) >= 1 for a in alice.answers)
    faults(c, hold={M: False})
    bob.join()
    alice.join()
    assert bob.statuses() == [200]
    assert alice.statuses() == [200] * 4 + [429] * 9
    pool.wait_for(lambda: left_in_redis(pool) == NOTHING, what="nothing left in Redis")


def test_a_full_worker_makes_room_for_a_user_within_its_share(
    busy: Callable[..., Pool],
) -> None:
    pool = busy()
    c = client_for(pool)
    configure(c, "server", max_in_flight=3)
    alice_key, bob_key = keys_for(pool, c, "alice", "bob")
    alice, bob = Sender(pool, alice_key), Sender(pool, bob_key)
    alice.send()
    pool.wait_for(lambda: len(in_flight(pool, M)) == 1, what="alice's first in the slot")
    for n in (1, 2):  # one after the other: the newest admitted is the newest queued
        alice.send()
        pool.wait_for(lambda n=n: len(queued(pool, M)) == n, what="alice's queued")
    # The worker is full (3): another request of alice is refused as ever...
    alice.send()
    pool.wait_for(lambda: alice.answered() == 1, what="alice refused")
    refused = alice.answers[0]
    assert refused.status_code == 429 and refused.get_json()["error"]["code"] == "server_busy"
    assert alice.pushed_out() == []
    # ...but bob's first is within his share (1.5 of 3): alice's newest queued one makes room.
    newest = queued(pool, M)[0].id  # the left end: the last queued
    bob.send()
    pool.wait_for(lambda: alice.answered() == 2, what="alice's newest pushed out")
    [gone] = alice.pushed_out()
    assert gone.status_code == 429 and gone.get_json()["error"]["code"] == "server_busy"
    assert int(gone.headers["Retry-After"]) >= admission.MIN_RETRY_S
    pool.wait_for(lambda: len(queued(pool, M)) == 2, what="bob queued")
    now = queued(pool, M)
    assert sorted(r.user for r in now) == ["user:alice", "user:bob"] and newest not in {
        r.id for r in now
    }
    faults(c, hold={M: False})
    bob.join()
    alice.join()
    assert bob.statuses() == [200]
    assert alice.statuses() == [200, 200, 429, 429]
    assert admission.IN_FLIGHT.count == 0 and admission.IN_FLIGHT.leaving == 0
    pool.wait_for(lambda: left_in_redis(pool) == NOTHING, what="nothing left in Redis")


def test_requests_being_served_are_never_pushed_out(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    """alice holds both places of a full worker, each in a slot of M (taken by its model
    process): bob's first request gets 429 as before, and alice's are served."""
    pool = start_pool(
        debug={"fault_injection": True}, models=tiny_models(models_dir, a={"parallel": 2})
    )
    c = client_for(pool)
    assert chat(c, M).status_code == 200
    faults(c, hold={M: True})
    configure(c, "server", max_in_flight=2)
    alice_key, bob_key = keys_for(pool, c, "alice", "bob")
    alice, bob = Sender(pool, alice_key), Sender(pool, bob_key)
    alice.send(2)
    pool.wait_for(lambda: len(in_flight(pool, M)) == 2, what="alice's two in the slots")
    bob.send()
    bob.join()
    [refused] = bob.answers
    assert refused.status_code == 429 and refused.get_json()["error"]["code"] == "server_busy"
    assert alice.answered() == 0
    faults(c, hold={M: False})
    alice.join()
    assert alice.statuses() == [200, 200]
    assert admission.IN_FLIGHT.count == 0 and admission.IN_FLIGHT.leaving == 0
    pool.wait_for(lambda: left_in_redis(pool) == NOTHING, what="nothing left in Redis")
