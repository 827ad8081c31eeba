"""Slot shares per user in a model process (workers/slot_shares.py): plain values, a clock the
test moves."""

from __future__ import annotations

import json
import math

from residency.messages import Kind, Request
from workers.slot_shares import SlotShares


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def shares(parallel: int = 4, grace_s: float = 0.25) -> tuple[SlotShares, Clock]:
    clock = Clock()
    return SlotShares(parallel, grace_s, clock), clock


def fill(s: SlotShares, user: str, n: int, weight: float = 1.0) -> None:
    for _ in range(n):
        assert s.may_take(user), f"{user} refused at {s.in_flight(user)}"
        s.started(user, weight)


def test_a_lone_user_takes_every_slot() -> None:
    s, _ = shares()
    fill(s, "user:heavy", 4)
    assert s.capped() == frozenset()
    assert s.in_flight("user:heavy") == 4


def test_two_users_get_two_of_four_slots_each() -> None:
    s, _ = shares()
    fill(s, "heavy", 3)
    fill(s, "victim", 1)  # not active before: never capped
    # heavy at 3 of its 2, victim below: heavy is capped until victim holds its 2.
    assert s.capped() == {"heavy"}
    s.finished("heavy")
    assert not s.may_take("heavy") and s.may_take("victim")
    s.started("victim")
    # Both at their share (2 of 2): nobody is below, so any request may take a slot.
    assert s.capped() == frozenset()
    # Now heavy is below: the free slot is held for it, not for victim's third.
    s.finished("heavy")
    assert s.capped() == {"victim"} and s.may_take("heavy")


def test_a_user_between_its_requests_keeps_its_share_for_the_grace() -> None:
    s, clock = shares(grace_s=0.25)
    fill(s, "heavy", 2)
    fill(s, "victim", 1)
    s.finished("victim")  # its answer is out; its next request is not queued yet
    clock.now += 0.2
    assert not s.may_take("heavy")
    assert s.hold_until() == 100.25
    clock.now += 0.05  # the grace is over: heavy alone is active and takes every slot
    assert s.may_take("heavy") and s.hold_until() is None
    fill(s, "heavy", 2)
    assert s.in_flight("heavy") == 4


def test_three_users_share_four_slots() -> None:
    s, _ = shares()
    fill(s, "a", 1)
    fill(s, "b", 1)
    fill(s, "c", 1)
    # Shares 4/3: each of the three is below it with one slot; one may take the fourth.
    assert s.capped() == frozenset()
    fill(s, "a", 1)
    s.finished("b")
    # a (2) is above 4/3, b (0) and c (1) below: a's next request waits, theirs take.
    assert s.capped() == {"a"}
    assert s.may_take("b") and s.may_take("c") and not s.may_take("a")
    fill(s, "c", 1)
    # c (2) is above too now; b still below.
    assert s.capped() == {"a", "c"}
    assert s.may_take("newcomer")  # not active: its first request takes a slot


def test_weights_set_the_shares() -> None:
    s, _ = shares()
    fill(s, "gold", 1, weight=3.0)
    fill(s, "plain", 1)
    # gold's share 4 x 3/4 = 3, plain's 1: plain at its share, gold below.
    assert s.capped() == {"plain"}
    fill(s, "gold", 2, weight=3.0)
    assert s.capped() == frozenset()  # gold 3 of 3, plain 1 of 1


def test_a_weight_that_is_not_a_positive_number_counts_as_one() -> None:
    for bad in (0.0, -5.0, math.inf, math.nan):
        s, _ = shares()
        fill(s, "a", 2, weight=bad)
        fill(s, "b", 1)
        assert s.capped() == {"a"}, bad


def test_anonymous_callers_are_one_user() -> None:
    s, _ = shares()
    fill(s, "", 2)
    fill(s, "user:u", 1)
    assert s.capped() == {""}


def test_grace_zero_is_purely_work_conserving() -> None:
    s, _ = shares(grace_s=0.0)
    fill(s, "heavy", 3)
    fill(s, "victim", 1)
    s.finished("heavy")
    assert s.capped() == frozenset() and s.may_take("heavy")
    s.finished("victim")
    assert s.hold_until() is None


def test_a_user_whose_grace_ended_is_forgotten() -> None:
    s, clock = shares(grace_s=1.0)
    fill(s, "gold", 1, weight=3.0)
    s.finished("gold")
    clock.now += 1.0
    fill(s, "a", 4)
    assert s.capped() == frozenset()
    assert s.hold_until() is None


def test_a_requests_weight_travels_in_its_json_and_older_json_reads_as_one() -> None:
    req = Request("1", Kind.CHAT, "m", {}, False, 1.0, user="user:u", weight=3.0)
    assert Request.loads(req.dumps()).weight == 3.0
    old = json.loads(req.dumps())
    del old["weight"]
    assert Request.loads(json.dumps(old)).weight == 1.0
