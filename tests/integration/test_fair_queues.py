"""Fair queues between the users of one model: the submit, finish, withdraw, reject and
hand-back scripts driven directly against a real Redis (the model process's take is its own
``LMOVE RIGHT LEFT``), then one real model process serving a heavy user and a light one.

Assertions are on queue orders, tags and counts, never on durations."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from residency import errors, keys, work
from residency.errors import ApiError
from residency.lua import Scripts
from residency.messages import Kind, Request, new_request_id
from residency.pool import snapshot
from residency.settings import Settings
from tests.conftest import Pool
from tests.integration.test_bounded_work import faults
from tests.integration.test_pool import chat, client_for
from web import bus

M = "m"


def item(user: str, rid: str | None = None) -> str:
    return Request(
        id=rid or new_request_id(),
        kind=Kind.CHAT,
        model=M,
        params={"messages": []},
        stream=False,
        submitted=time.time(),
        user=user,
    ).dumps()


def user_of(raw: str) -> str:
    return Request.loads(raw).user


class Model:
    """One model's queue, driven through the scripts the way web and a model process do."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.scripts = Scripts(r)
        r.hset(keys.model(M), "state", "ready")  # no demand events

    def submit(
        self,
        user: str,
        *,
        weight: float = 1.0,
        bound: int = -1,
        fair: bool = True,
        rid: str = "",
        raw: str = "",
        push_out: tuple[str, dict[str, Any]] | None = None,
    ) -> tuple[str, tuple[int, int | str]]:
        it = raw or item(user, rid or None)
        res = self.scripts.submit(
            M,
            it,
            bound=bound,
            demand_event={"type": "demand", "model": M},
            user=user,
            weight=weight,
            fair=fair,
            push_out=push_out,
        )
        return it, res

    def take(self) -> str:
        """What the model process's BLMOVE takes: the right end, into processing."""
        raw = self.r.lmove(keys.queue(M), keys.processing(M), "RIGHT", "LEFT")
        assert raw is not None, "nothing queued"
        return str(raw)

    def finish(self, raw: str) -> None:
        self.scripts.finish(
            M, raw, now=time.time(), idle_event={}, request_id=Request.loads(raw).id
        )

    def serve_all(self) -> list[str]:
        served = []
        while self.r.llen(keys.queue(M)):
            raw = self.take()
            self.finish(raw)
            served.append(raw)
        return served

    def order(self) -> list[str]:
        """The queue in service order (next first)."""
        return [str(x) for x in reversed(self.r.lrange(keys.queue(M), 0, -1))]

    def tags(self) -> dict[str, float]:
        return {
            str(k): float(v) for k, v in self.r.zrange(keys.queue_tags(M), 0, -1, withscores=True)
        }

    def tag_keys(self) -> int:
        return int(self.r.exists(keys.queue_tags(M), keys.queue_finish(M)))


@pytest.fixture
def m(r: redis.Redis) -> Model:
    return Model(r)


@pytest.mark.parametrize("in_service", [0, 1, 3])
def test_a_light_user_is_not_queued_behind_a_heavy_users_fifty(m: Model, in_service: int) -> None:
    """Heavy queues 50 (some already served, ``in_service`` of them running); light's one
    request is next — or, with nothing running, second: behind heavy's request whose tag it
    ties (V, the smallest tag, is that request's; a tie keeps arrival order) — within
    in_service + 1 places of the right end either way but for that tie, and the rest keeps
    heavy's order."""
    heavy = [m.submit("heavy")[0] for _ in range(50)]
    for _ in range(10):  # served: heavy's tags moved on
        m.finish(m.take())
    running = [m.take() for _ in range(in_service)]
    light, res = m.submit("light")
    assert res == (1, 50 - 10 - in_service + 1)
    order = m.order()
    assert order.index(light) + 1 == (1 if in_service else 2)
    assert [x for x in order if x != light] == heavy[10 + in_service :]
    for raw in running:
        m.finish(raw)
    served = m.serve_all()
    assert served.index(light) == order.index(light)


def test_weights_two_to_one_interleave_two_to_one(m: Model) -> None:
    a = [m.submit("a", weight=2.0)[0] for _ in range(10)]
    b = [m.submit("b", weight=1.0)[0] for _ in range(10)]
    # Tags: a 0, .5, 1, 1.5, ...; b 0, 1, 2, ...; a tie goes to the one queued first (a).
    expected = [
        a[0], b[0], a[1], a[2], b[1], a[3], a[4], b[2], a[5], a[6], b[3], a[7], a[8], b[4], a[9],
        *b[5:],
    ]  # fmt: skip
    assert m.order() == expected
    assert m.serve_all() == expected


def test_equal_tags_are_served_in_arrival_order(m: Model) -> None:
    # Three users, two requests each, queued in turns: every first request has tag 0, every
    # second one tag 1. Their ids sort against arrival (the tag set orders a tie by member):
    # the order must still be arrival order within each tag.
    firsts, seconds = [], []
    for n, u in enumerate(("u1", "u2", "u3")):
        firsts.append(m.submit(u, rid=f"z{9 - n}")[0])
    for n, u in enumerate(("u1", "u2", "u3")):
        seconds.append(m.submit(u, rid=f"y{9 - n}")[0])
    assert m.order() == firsts + seconds
    # A fourth user's first request (tag 0) goes after every tag-0 request, before the tag 1s.
    late = m.submit("u4", rid="a0")[0]
    assert m.order() == [*firsts, late, *seconds]
    # Anonymous callers are one user: first come, first served among themselves.
    m.serve_all()
    anon = [m.submit("")[0] for _ in range(5)]
    assert m.order() == anon


def test_one_users_requests_keep_their_order(m: Model) -> None:
    mine = []
    for n in range(12):
        mine.append(m.submit("me")[0])
        m.submit(f"other{n % 3}")
    served = m.serve_all()
    assert [x for x in served if user_of(x) == "me"] == mine


def test_finish_and_withdraw_remove_tags_and_an_empty_model_resets(m: Model) -> None:
    x, _ = m.submit("u")
    y, _ = m.submit("u")
    z, _ = m.submit("v")
    assert set(m.tags()) == {x, y, z}
    # Withdrawn while queued: its tag goes.
    assert m.scripts.withdraw(M, Request.loads(y).id, y, cancel=True)
    assert set(m.tags()) == {x, z}
    # Taken, then finished: its tag stays while it runs (V must not jump), then goes.
    taken = m.take()
    assert taken == x and set(m.tags()) == {x, z}
    m.finish(x)
    assert set(m.tags()) == {z}
    assert m.r.hgetall(keys.queue_finish(M)) != {}
    # A withdraw that finds it taken leaves the tag to the finish.
    taken = m.take()
    assert not m.scripts.withdraw(M, Request.loads(z).id, z, cancel=True)
    assert set(m.tags()) == {z}
    m.finish(z)
    # Nothing queued, nothing in flight: tags and finish tags are gone, the next starts at 0.
    assert m.tag_keys() == 0
    fresh, _ = m.submit("u")
    assert m.tags() == {fresh: 0.0}
    # The last one withdrawn resets too.
    assert m.scripts.withdraw(M, Request.loads(fresh).id, fresh, cancel=False)
    assert m.tag_keys() == 0


def test_a_stale_tag_is_dropped_once_the_model_is_empty(m: Model) -> None:
    """A request dropped without a finish (a malformed one a process LREMs) leaves a tag; the
    next submit to an empty model starts from nothing."""
    x, _ = m.submit("u")
    m.r.lrem(keys.queue(M), 1, x)
    assert m.tags() == {x: 0.0}
    m.r.hset(keys.queue_finish(M), "fu", 100)
    y, _ = m.submit("u")
    assert m.tags() == {y: 0.0}


def push(
    m: Model, user: str, *, bound: int, weight: float = 1.0, fair: bool = True
) -> tuple[str, tuple[int, int | str], str | None]:
    """Submit as web does (``bus.submit``): when the script names a request to push out, call
    it again with that request's error. Returns the item, the last answer, and the id pushed
    out (None when none was)."""
    it, res = m.submit(user, weight=weight, bound=bound, fair=fair)
    if res[0] != 3:
        return it, res, None
    victim = str(res[1])
    err = errors.pushed_out(M, bound, 7).to_reply()
    _, res = m.submit(user, weight=weight, bound=bound, fair=fair, raw=it, push_out=(victim, err))
    return it, res, victim


def id_of(raw: str) -> str:
    return Request.loads(raw).id


def pushed_reply(r: redis.Redis, request_id: str) -> dict[str, Any]:
    [(_id, fields)] = r.xrange(keys.reply(request_id))
    assert fields["t"] == "error"
    return dict(json.loads(fields["d"]))


@pytest.mark.parametrize("fair", [True, False])
def test_a_full_queue_makes_room_for_a_user_within_its_share(m: Model, fair: bool) -> None:
    """Shares apply with fair queues off too: the bound is what the users share."""
    mine = [push(m, "u", bound=3, fair=fair)[0] for _ in range(3)]
    assert m.order() == mine
    # u alone holds the whole bound, its share: one more is refused.
    it, res, gone = push(m, "u", bound=3, fair=fair)
    assert res == (0, 3) and gone is None and it not in m.order()
    # v's first request: within its share (3 / 2): u's newest request makes room.
    theirs, res, gone = push(m, "v", bound=3, fair=fair)
    assert res == (1, 3)
    assert gone == id_of(mine[-1])
    assert sorted(m.order()) == sorted([*mine[:2], theirs])
    reply = pushed_reply(m.r, gone)
    assert reply["status"] == 429 and reply["error"]["code"] == "queue_full"
    assert reply["retry_after"] == 7
    assert mine[-1] not in m.tags()
    assert len(m.tags()) == (3 if fair else 0)
    owners = {k for k in m.r.hkeys(keys.queue_finish(M)) if str(k).startswith("o")}
    assert owners == {"o" + id_of(x) for x in (*mine[:2], theirs)}
    # v now holds 1 of its 1.5 places: a second would put it above its share.
    assert push(m, "v", bound=3, fair=fair)[1] == (0, 3)
    m.serve_all()
    assert m.tag_keys() == 0


@pytest.mark.parametrize("fair", [True, False])
def test_the_newest_request_of_the_user_furthest_above_its_share_goes(m: Model, fair: bool) -> None:
    a = [push(m, "a", bound=6, fair=fair)[0] for _ in range(4)]
    b = [push(m, "b", bound=6, fair=fair)[0] for _ in range(2)]
    # Shares of 6 among a, b, c: 2 each. a is 2 above, b at its share.
    _c1, res, gone = push(m, "c", bound=6, fair=fair)
    assert res == (1, 6) and gone == id_of(a[-1])
    # Now a 3 (1 above), b 2, c 1 (1 below): c's second takes a's newest again.
    c2, _, gone = push(m, "c", bound=6, fair=fair)
    assert gone == id_of(a[-2])
    # All at their share: c's third is refused.
    assert push(m, "c", bound=6, fair=fair)[1] == (0, 6)
    # d's share of 6 among four is 1.5, and a, b and c (2 each) are 0.5 above: equally far,
    # so the newest of their requests goes, c's second; then b's newest (newer than a's).
    assert push(m, "d", bound=6, fair=fair)[2] == id_of(c2)
    assert push(m, "e", bound=6, fair=fair)[2] == id_of(b[-1])
    assert sorted(map(user_of, m.order())) == ["a", "a", "b", "c", "d", "e"]
    m.serve_all()
    assert m.tag_keys() == 0


def test_weights_set_the_shares(m: Model) -> None:
    """a (weight 1) holds 3 of 8 places, b (weight 3) 5. A newcomer c of weight 1: shares are
    8 x 1/5 = 1.6, 4.8 and 1.6, so a is furthest above (1.4 to b's 0.2) though b holds more."""
    a = [push(m, "a", bound=8, weight=1.0)[0] for _ in range(3)]
    for _ in range(5):
        push(m, "b", bound=8, weight=3.0)
    assert push(m, "c", bound=8, weight=1.0)[2] == id_of(a[-1])
    # By counts alone b would have gone: with equal weights it is 5 - 8/3 above.
    m.serve_all()
    for _ in range(3):
        push(m, "a", bound=8)
    b = [push(m, "b", bound=8)[0] for _ in range(5)]
    assert push(m, "c", bound=8)[2] == id_of(b[-1])


def test_requests_in_flight_hold_no_queue_place(m: Model) -> None:
    """u has two in flight and fills the bound of 2 queued: v is within its share (1 of 2)."""
    for _ in range(2):
        push(m, "u", bound=2)
    m.take()
    m.take()
    for _ in range(2):
        push(m, "u", bound=2)
    assert m.r.llen(keys.queue(M)) == 2
    assert push(m, "u", bound=2)[1] == (0, 2)
    assert push(m, "v", bound=2)[1] == (1, 2)
    assert push(m, "v", bound=2)[1] == (0, 2)


def test_anonymous_callers_are_one_user_and_one_at_its_share_is_never_pushed_out(m: Model) -> None:
    anon = [push(m, "", bound=4)[0] for _ in range(4)]
    # Another anonymous caller is the same user: the queue is its whole share already.
    assert push(m, "", bound=4)[1] == (0, 4)
    assert push(m, "u", bound=4)[2] == id_of(anon[-1])
    assert push(m, "u", bound=4)[2] == id_of(anon[-2])
    # Both at their share (2 of 4): neither can push the other out.
    assert push(m, "u", bound=4)[1] == (0, 4)
    assert push(m, "", bound=4)[1] == (0, 4)
    assert sorted(map(user_of, m.order())) == ["", "", "u", "u"]


def test_a_queued_requests_json_starts_with_its_id() -> None:
    """The scripts read a request's id from the start of its JSON (_fair.lua)."""
    raw = item("u", "abc")
    assert raw.startswith('{"id":"abc",')


def test_owner_records_are_mended_from_the_queue(m: Model) -> None:
    """Requests queued with no owner record (before this was recorded) or a record whose
    request was dropped without a finish: the queue itself decides, and the records are
    mended."""
    a = [push(m, "a", bound=4)[0] for _ in range(3)]
    push(m, "b", bound=4)
    m.r.hdel(keys.queue_finish(M), "o" + id_of(a[0]), "o" + id_of(a[1]))
    stale = "o" + "f" * 32
    m.r.hset(keys.queue_finish(M), stale, "1 b")
    # a holds 3 of 4, b 1; c's share is 4/3: a's newest goes.
    assert push(m, "c", bound=4)[2] == id_of(a[2])
    owners = {str(k) for k in m.r.hkeys(keys.queue_finish(M)) if str(k).startswith("o")}
    assert stale not in owners and "o" + id_of(a[0]) in owners
    m.serve_all()
    assert m.tag_keys() == 0


def test_a_named_request_that_left_meanwhile_is_not_answered(m: Model) -> None:
    """The script named a request to push out, which was withdrawn before the second call:
    the queue has room now, and the withdrawn request's reply stream is left alone."""
    a = [push(m, "a", bound=2)[0] for _ in range(2)]
    it, res = m.submit("b", bound=2)
    assert res == (3, id_of(a[-1]))
    assert m.scripts.withdraw(M, id_of(a[-1]), a[-1], cancel=False)
    _, res = m.submit(
        "b", bound=2, raw=it, push_out=(id_of(a[-1]), errors.pushed_out(M, 2).to_reply())
    )
    assert res == (1, 2)
    assert m.r.exists(keys.reply(id_of(a[-1]))) == 0
    assert sorted(m.order()) == sorted([a[0], it])


def test_first_come_first_served_when_fair_queues_are_off(m: Model) -> None:
    heavy = [m.submit("heavy", fair=False)[0] for _ in range(5)]
    light, _ = m.submit("light", fair=False)
    assert m.order() == [*heavy, light]
    assert m.tags() == {}
    assert not [k for k in m.r.hkeys(keys.queue_finish(M)) if not str(k).startswith("o")]


def test_a_handed_back_request_keeps_its_tag_and_a_refused_one_loses_it(m: Model) -> None:
    x, _ = m.submit("u")
    y, _ = m.submit("v")
    m.take()
    counts = work.hand_back(m.r, m.scripts, M, "exited with -9", crashed=True)
    assert counts["requeued"] == 1
    again = m.order()[0]
    assert Request.loads(again).id == Request.loads(x).id and again != x  # attempts counted
    assert m.tags() == {again: 0.0, y: 0.0}
    m.take()
    # The second crash refuses it: answered, its tag gone.
    assert work.hand_back(m.r, m.scripts, M, "exited with -9", crashed=True)["refused"] == 1
    assert m.tags() == {y: 0.0}
    m.serve_all()
    assert m.tag_keys() == 0


def test_failing_the_queue_removes_every_tag(m: Model) -> None:
    for u in ("u", "v", "u"):
        m.submit(u)
    err = ApiError(500, "load failed", type="server_error", code="model_load_failed")
    assert work.fail_queued(m.r, M, err) == 3
    assert m.tag_keys() == 0 and m.order() == []


def test_health_counts_queued_requests_per_user(m: Model) -> None:
    for u in ("user:ann", "user:ann", "", "user:bob"):
        m.submit(u)
    m.take()  # in flight: not queued
    m.r.sadd(keys.models_with_state(), M)
    s = Settings()
    rd = snapshot.read(m.r, s, time.time())
    [rec] = [x for x in snapshot.health_record(rd, s)["models"] if x["name"] == M]
    assert rec["queued"] == 3
    # Subjects shown as /admin/usage shows them: users by name, anonymous callers as '-'.
    assert rec["queued_by_user"] == {"ann": 1, "-": 1, "bob": 1}
    # demand_since is the oldest queued request, wherever fair queueing placed it.
    oldest = min(Request.loads(x).submitted for x in m.order())
    assert rd.snap.models[M].demand_since == oldest


def test_queue_summary_is_pure() -> None:
    a = Request("1", Kind.CHAT, M, {}, False, 5.0, user="user:ann").dumps()
    b = Request("2", Kind.CHAT, M, {}, False, 3.0).dumps()
    c = Request("3", Kind.CHAT, M, {}, False, 4.0, user="admin:ann").dumps()
    assert snapshot.queue_summary([a, b, c, "not json"]) == (
        3.0,
        {"ann": 1, "-": 1, "admin:ann": 1},
    )
    assert snapshot.queue_summary([]) == (None, {})


def test_a_light_users_answer_comes_before_most_of_a_heavy_users(
    start_pool: Callable[..., Pool],
) -> None:
    """A real model process with one slot: heavy queues 20 while the slot is held, then light
    sends one. Light's answer arrives before at least 15 of heavy's (it is served second)."""
    pool = start_pool(debug={"fault_injection": True})  # tiny model "a" has one slot
    c = client_for(pool)
    assert chat(c, "a").status_code == 200  # loaded: the requests below are served at once
    faults(c, hold={"a": True}, token_delay_s={"a": 0.1})

    def send(user: str) -> bus.Call:
        return bus.submit(
            pool.r,
            Scripts(pool.r),
            kind=Kind.CHAT,
            model="a",
            params={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            stream=False,
            bound=-1,
            timeout_s=120,
            user=user,
        )

    heavy = [send("heavy")]
    pool.wait_for(lambda: pool.r.llen(keys.processing("a")) == 1, what="heavy's first held")
    heavy += [send("heavy") for _ in range(19)]
    light = send("light")
    assert pool.r.llen(keys.queue("a")) == 20
    faults(c, hold={"a": False})
    assert light.result()["object"] == "chat.completion"
    answered = sum(1 for call in heavy if final(pool.r, call))
    assert answered <= 5, f"{answered} of heavy's requests were answered before light's"
    for call in heavy:
        assert call.result()["object"] == "chat.completion"
    assert pool.r.exists(keys.queue_tags("a"), keys.queue_finish("a")) == 0


def final(r: redis.Redis, call: bus.Call) -> bool:
    """Whether the reply stream of ``call`` holds its last message (not read yet)."""
    last: Any = r.xrevrange(keys.reply(call.req.id), count=1)
    return bool(last) and last[0][1]["t"] in ("done", "error")


def test_a_request_queued_while_the_queue_is_failed_is_left_for_the_next_load(m: Model) -> None:
    """A failed load answers the requests that waited for it; one queued while that answering
    runs (its client retried at once) arrived after the failure and stays queued, for the next
    load, instead of being told about a failure that happened before it came."""
    for u in ("u", "v"):
        m.submit(u)
    late: list[str] = []

    def retry_at_once(_req_id: str) -> None:
        if not late:
            late.append(m.submit("w")[0])

    err = ApiError(500, "load failed", type="server_error", code="model_load_failed")
    assert work.fail_queued(m.r, M, err, on_answered=retry_at_once) == 2
    assert m.order() == late
