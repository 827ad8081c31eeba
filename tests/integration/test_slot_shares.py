"""Slot shares per user through real processes: one tiny model with 4 slots and a slowed token
rate, a heavy user keeping its queue full and a victim sending one request after another.

With slot shares on (``[worker] slot_share_grace_s``) the model process holds back half its
slots from heavy while the victim is active, and takes the victim's request (fair queueing
puts it at or near the head) at once instead of waiting for one of heavy's to finish. The
take script is driven directly too. Assertions count requests, never durations."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from residency import keys
from residency.lua import Scripts
from residency.messages import Kind, Request
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import faults
from tests.integration.test_fair_queues import M, Model, final, item
from tests.integration.test_pool import chat, client_for
from tests.integration.test_slots import model_health
from web import bus

HEAVY, VICTIM = "user:heavy", "user:victim"
HEAVY_QUEUED = 8  # heavy keeps at least this many queued
MEASURED = 10  # victim requests counted


def test_the_take_skips_capped_users_requests_in_fair_order(r: redis.Redis) -> None:
    m = Model(r)
    heavy = [m.submit(HEAVY)[0] for _ in range(3)]
    victim = m.submit(VICTIM)[0]  # its first: fair queueing puts it second
    order = m.order()
    assert order.index(victim) == 1
    scripts = Scripts(r)
    assert scripts.take_share(M, {HEAVY}, 16) == victim
    assert r.lrange(keys.processing(M), 0, -1) == [victim]
    assert m.order() == heavy
    # Every queued request is a capped user's: nothing is taken.
    assert scripts.take_share(M, {HEAVY, VICTIM}, 16) is None
    # It looks no deeper than asked: a request of an uncapped user further back stays.
    late = m.submit("user:late")[0]
    depth = m.order().index(late)
    assert scripts.take_share(M, {HEAVY}, depth) is None
    assert scripts.take_share(M, {HEAVY}, depth + 1) == late
    # A request with no owner record (queued before they were kept): its own user field.
    old = item("user:old")
    r.rpush(keys.queue(M), old)
    assert scripts.take_share(M, {HEAVY}, 16) == old
    assert m.order() == heavy


def processing(pool: Pool) -> list[Request]:
    return [Request.loads(str(x)) for x in pool.r.lrange(keys.processing("a"), 0, -1)]


def entry_id(entries: Any) -> tuple[int, int]:
    ms, seq = str(entries[0][0]).split("-")
    return int(ms), int(seq)


def last_before(r: redis.Redis, request_id: str, first: tuple[int, int]) -> bool:
    """Whether ``request_id``'s reply stream ended (done or error) before entry ``first``."""
    last: Any = r.xrevrange(keys.reply(request_id), count=1)
    return bool(last) and last[0][1]["t"] in ("done", "error") and entry_id(last) < first


def heavy_ids(reqs: list[Request]) -> set[str]:
    return {q.id for q in reqs if q.user == HEAVY}


@pytest.mark.parametrize("grace_s", [5.0, 0.0])
def test_a_victim_gets_its_share_of_the_slots_beside_a_heavy_user(
    start_pool: Callable[..., Pool], models_dir: Path, grace_s: float
) -> None:
    """Shares on: while the victim is active heavy holds at most 2 of the 4 slots, and a
    victim request is taken with none of heavy's finishing first. Shares off (0): heavy holds
    3 beside it, and each victim request waits for one of heavy's to finish, as before."""
    # A grace far above the gap between the victim's requests (the test's own thread, slowed
    # by a loaded machine) keeps the victim active between them.
    pool = start_pool(
        models=tiny_models(models_dir, a={"parallel": 4}),
        debug={"fault_injection": True},
        worker={"slot_share_grace_s": grace_s},
    )
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    pool.wait_for(lambda: (model_health(pool, "a")["slots"] or {}).get("parallel") == 4)
    faults(c, token_delay_s={"a": 0.05})
    scripts = Scripts(pool.r)

    def send(user: str, max_tokens: int, stream: bool = False) -> bus.Call:
        return bus.submit(
            pool.r,
            scripts,
            kind=Kind.CHAT,
            model="a",
            params={"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens},
            stream=stream,
            bound=-1,
            timeout_s=300,
            user=user,
        )

    heavy: list[bus.Call] = []
    done = threading.Event()

    def feed() -> None:
        while not done.is_set():
            raws = pool.r.lrange(keys.queue("a"), 0, -1)
            queued = sum(1 for x in raws if Request.loads(str(x)).user == HEAVY)
            for _ in range(HEAVY_QUEUED + 2 - queued):
                heavy.append(send(HEAVY, 24))
            done.wait(0.02)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        pool.wait_for(lambda: len(heavy_ids(processing(pool))) == 4, what="heavy in 4 slots")
        # The victim's first request finds heavy in every slot (it waits for one either way).
        send(VICTIM, 4).result()
        if grace_s:
            pool.wait_for(
                lambda: len(heavy_ids(processing(pool))) == 2, what="heavy down to its share"
            )
        waited: list[int] = []  # per victim request: heavy's that finished before its take
        beside: list[int] = []  # per sample with a victim request in flight: heavy's in flight
        for _ in range(MEASURED):
            call = send(VICTIM, 4, stream=True)
            before = heavy_ids(processing(pool))
            while not final(pool.r, call):
                now = processing(pool)
                if any(q.id == call.req.id for q in now):
                    beside.append(len(heavy_ids(now)))
            # Heavy's that were in flight at the submit and wrote their last reply before the
            # victim's first chunk, in the order Redis gave their entries (stream ids).
            first = entry_id(pool.r.xrange(keys.reply(call.req.id), count=1))
            waited.append(sum(1 for h in before if last_before(pool.r, h, first)))
            for _batch in call.batches():
                pass
            assert sum(1 for x in pool.r.lrange(keys.queue("a"), 0, -1)) >= HEAVY_QUEUED / 2
    finally:
        done.set()
        feeder.join(10)
        faults(c, token_delay_s={"a": 0.0})
    for h in heavy:  # each Call's reply is read once
        assert h.result()["object"] == "chat.completion"
    took_at_once = sum(1 for n in waited if n == 0)
    assert beside, "no look saw a victim request in flight"
    if grace_s:
        assert max(beside) <= 2, beside
        assert took_at_once >= MEASURED * 0.8, waited
    else:
        assert max(beside) == 3, beside
        assert took_at_once <= MEASURED * 0.2, waited
