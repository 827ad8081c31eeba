"""Where a prompt goes among the live slots and a saved state (``workers.slots.plan``, pure)."""

from __future__ import annotations

from workers.slots import MIN_GAIN, WAIT_STEPS, Action, Asker, Cached, Held, Plan, plan

SYSTEM = list(range(100, 160))  # 60 tokens two conversations share
ANN = Asker("ann")
BOB = Asker("bob")


def held(tokens: list[int], owner: str = "ann", **kw: object) -> Held:
    base = {"prompt_len": len(tokens), "remaining": 100, "cancelled": False}
    base.update(kw)
    return Held(0, tokens, owner, 0, **base)  # type: ignore[arg-type]


def test_a_free_slot_that_holds_the_prefix_is_taken_as_it_is() -> None:
    free = [Cached(1, [*SYSTEM, 1, 2], used=5.0, owner="ann"), Cached(2, [], used=1.0)]
    assert plan(free, [], [*SYSTEM, 1, 2, 3], ANN) == Plan(Action.TAKE, 1, 62)


def test_a_saved_state_is_restored_into_the_least_recently_used_slot() -> None:
    free = [Cached(1, [7, 7], used=5.0), Cached(2, [8], used=1.0)]
    saved = Cached(-1, SYSTEM, owner="ann")
    assert plan(free, [], [*SYSTEM, 1], ANN, saved) == Plan(Action.RESTORE, 2, 60)


def test_a_saved_state_must_gain_enough_over_the_best_free_slot() -> None:
    near = SYSTEM[: 60 - MIN_GAIN + 1]
    free = [Cached(1, near, owner="ann")]
    saved = Cached(-1, SYSTEM, owner="ann")
    assert plan(free, [], [*SYSTEM, 1], ANN, saved).action is Action.TAKE
    free = [Cached(1, SYSTEM[: 60 - MIN_GAIN], owner="ann")]
    assert plan(free, [], [*SYSTEM, 1], ANN, saved).action is Action.RESTORE


def test_the_scope_applies_to_saved_states_as_to_live_slots() -> None:
    free = [Cached(1, [], used=1.0)]
    saved = Cached(-1, SYSTEM, owner="ann", shareable=60)
    assert plan(free, [], [*SYSTEM, 1], BOB, saved).action is Action.TAKE
    shared = Asker("bob", shareable=60, scope="shared_system")
    assert plan(free, [], [*SYSTEM, 1], shared, saved) == Plan(Action.RESTORE, 1, 60)


def test_a_follow_up_waits_for_its_own_slot_that_is_still_writing_its_answer() -> None:
    answer = [5, 6, 7]
    busy = held(SYSTEM + answer, prompt_len=60)  # it generated the answer
    free = [Cached(1, [], used=1.0)]
    follow_up = SYSTEM + answer[:2] + [9]  # the client read two tokens, then asked again
    assert plan(free, [busy], follow_up, ANN, can_copy=True) == Plan(Action.WAIT, source=0)
    # At most WAIT_STEPS: then its memory is copied (or, where it cannot be, a cold slot).
    late = plan(free, [busy], follow_up, ANN, waited=WAIT_STEPS, can_copy=True)
    assert late == Plan(Action.COPY, 1, 62, source=0)
    assert plan(free, [busy], follow_up, ANN, waited=WAIT_STEPS).action is Action.TAKE


def test_a_cancelled_or_ending_slot_is_waited_for_and_a_running_one_is_copied() -> None:
    free = [Cached(1, [], used=1.0)]
    prompt = [*SYSTEM, 9]
    for finishing in ({"cancelled": True}, {"remaining": WAIT_STEPS}):
        assert plan(free, [held(SYSTEM, **finishing)], prompt, ANN).action is Action.WAIT
    # A parallel request of the same user sharing only the prompt: nothing to wait for.
    running = held([*SYSTEM, 4, 4], prompt_len=62)
    assert plan(free, [running], prompt, ANN, can_copy=True) == Plan(Action.COPY, 1, 60, 0)


def test_another_users_busy_slot_is_never_waited_for_and_copied_only_within_the_scope() -> None:
    free = [Cached(1, [], used=1.0)]
    busy = held(SYSTEM, owner="ann", cancelled=True)
    assert plan(free, [busy], [*SYSTEM, 9], BOB, can_copy=True).action is Action.TAKE
    glob = Asker("bob", scope="global")
    assert plan(free, [busy], [*SYSTEM, 9], glob, can_copy=True).action is Action.COPY


def test_at_least_one_prompt_token_is_left_to_decode() -> None:
    free = [Cached(1, [], used=1.0)]
    saved = Cached(-1, SYSTEM, owner="ann")
    assert plan(free, [], SYSTEM, ANN, saved) == Plan(Action.RESTORE, 1, 59)
