"""Shares of a web worker's places under gunicorn's gevent worker, end to end: `residency up`
with one gevent web worker and `server.max_in_flight = 3`, a model held busy (the ``hold``
fault), one user holding all three places — and another user's first request let in by pushing
out the first user's newest queued request, whose greenlet answers it 429 ``server_busy`` at
once and leaves nothing queued.

Assertions are on statuses and counts; a timeout only bounds a broken test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e import test_web_tier as web_tier
from tests.e2e.test_web_tier import wait_for

pytestmark = pytest.mark.e2e

M = "a"


class Box(web_tier.Box):
    def __init__(self, tmp: Path, models_dir: Path) -> None:
        super().__init__(tmp, models_dir, server={"web_workers": 1, "max_in_flight": 3})

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        return requests.post(self.url + path, json=body, headers=headers, timeout=120)

    def key_of(self, user: str) -> dict[str, str]:
        assert self.post("/admin/users", {"name": user}, self.admin).status_code == 201
        resp = self.post(f"/admin/users/{user}/keys", {}, self.admin)
        assert resp.status_code == 201, resp.text
        return {"Authorization": f"Bearer {resp.json()['key']}"}


@pytest.fixture
def box(tmp_path: Path, models_dir: Path) -> Iterator[Box]:
    b = Box(tmp_path, models_dir)
    yield b
    b.stop()


CHAT = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_a_full_gevent_worker_makes_room_for_another_users_first_request(box: Box) -> None:
    alice, bob = box.key_of("alice"), box.key_of("bob")
    assert box.post("/v1/chat/completions", CHAT, alice).status_code == 200  # loaded
    box.faults(hold={M: True})
    answers: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def send(who: str, headers: dict[str, str], stream: bool) -> threading.Thread:
        def one() -> None:
            resp = box.post("/v1/chat/completions", {**CHAT, "stream": stream}, headers)
            with lock:
                answers.append((who, resp))

        t = threading.Thread(target=one, daemon=True)
        t.start()
        return t

    # Alice's three: one in the slot, a stream and a plain request queued behind it.
    threads = [send("alice", alice, False)]
    wait_for(lambda: box.model(M)["in_flight"] == 1, "alice's first in the slot")
    threads.append(send("alice", alice, True))
    wait_for(lambda: box.model(M)["queued"] == 1, "alice's stream queued")
    threads.append(send("alice", alice, False))
    wait_for(lambda: box.model(M)["queued"] == 2, "alice's second queued")
    # Bob's first: the worker is full, bob within his share (1.5 of 3): alice's newest queued
    # request is pushed out, answered 429 by its own greenlet, and bob's is queued instead.
    threads.append(send("bob", bob, False))
    wait_for(lambda: len(answers) == 1, "alice's newest pushed out")
    [(who, gone)] = answers
    assert who == "alice" and gone.status_code == 429
    assert gone.json()["error"]["code"] == "server_busy"
    assert int(gone.headers["Retry-After"]) >= 1
    wait_for(lambda: box.model(M)["queued_by_user"] == {"alice": 1, "bob": 1}, "bob queued")
    box.faults(hold={M: False})
    for t in threads:
        t.join(120)
    assert sorted((w, r.status_code) for w, r in answers) == [
        ("alice", 200),
        ("alice", 200),
        ("alice", 429),
        ("bob", 200),
    ]
    wait_for(lambda: (m := box.model(M))["queued"] + m["in_flight"] == 0, "all done")
