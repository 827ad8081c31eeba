"""Each engine step's decode thread count (workers.decode_threads), and the engine using it:
the costs are given, never timed, so every assertion is a count or an order."""

from __future__ import annotations

import itertools

from tests.unit.test_engine_grammar import EOG, FakeBackend, drain
from workers import decode_threads
from workers.decode_threads import Chooser, candidates
from workers.engine import End, Engine, Job, Sampling


def run(chooser: Chooser, cost: dict[int, float], steps: int, n_tokens: int = 8) -> list[int]:
    """``steps`` steps of ``n_tokens`` whose cost per token is ``cost[threads]``; the counts
    chosen, in order."""
    used = []
    for _ in range(steps):
        t = chooser.choose(n_tokens)
        chooser.observe(n_tokens, t, cost[t] * n_tokens)
        used.append(t)
    return used


def test_candidates_are_all_threads_and_one_fewer() -> None:
    assert candidates(1) == (1,)
    assert candidates(2) == (2, 1)
    assert candidates(16) == (16, 15)


def test_all_threads_first_then_the_other_count_tried_and_the_cheaper_one_kept() -> None:
    c = Chooser(2)
    used = run(c, {2: 1.0, 1: 3.0}, 400)
    every = decode_threads.EXPLORE_EVERY
    assert used[: every - 1] == [2] * (every - 1)  # a new box starts with all its threads
    assert used.index(1) == every - 1  # the other count first tried after EXPLORE_EVERY steps
    assert c.measured(8) == (2, 1) and c.preferred(8) == 2
    retries = 400 // (every * 3) + 2
    assert used.count(1) <= retries * decode_threads.PROBE_STEPS


def test_fewer_threads_must_be_clearly_cheaper_to_be_preferred() -> None:
    """Inside the box two threads carry the other roles' wake-ups in their measured time: one
    thread is preferred only when it is MARGIN cheaper, not for a few percent."""
    a = Chooser(2)
    run(a, {2: 1.0, 1: 0.95}, 300)
    assert a.preferred(8) == 2
    b = Chooser(2)
    run(b, {2: 1.0, 1: 0.7}, 300)
    assert b.preferred(8) == 1


def test_a_new_size_starts_with_the_count_the_nearest_size_prefers() -> None:
    """On a box where one thread is cheaper, a size seen for the first time (a step with a
    prompt chunk) starts with one thread, not with every count in turn."""
    c = Chooser(2)
    run(c, {2: 5.0, 1: 1.0}, 500, n_tokens=8)
    assert c.preferred(8) == 1
    assert c.choose(300) == 1


def test_a_slow_first_step_does_not_condemn_a_count() -> None:
    """A size's first decode pays for what it touches first: it is replaced by the next
    measure, so the faster count is preferred from the start."""
    c = Chooser(2)
    first = {2: True}

    def cost(t: int) -> float:
        if t == 2 and first.pop(2, False):
            return 100.0
        return {2: 1.0, 1: 1.5}[t]

    for _ in range(4):
        t = c.choose(8)
        c.observe(8, t, cost(t) * 8)
    assert c.preferred(8) == 2


def test_a_count_much_worse_is_retried_less_often() -> None:
    """A count ten times dearer is tried several times less often than one a little dearer
    (at least every EXPLORE_EVERY x MAX_BACKOFF steps), so trying costs under 3.5% of the
    decode time."""
    steps = 20_000
    near = run(Chooser(2), {2: 1.0, 1: 1.2}, steps).count(1)
    far = run(Chooser(2), {2: 1.0, 1: 10.0}, steps).count(1)
    assert far * 5 < near
    spent_exploring = far * (10.0 - 1.0)  # what the retries cost beyond the cheaper count
    assert spent_exploring < steps * 1.0 * 0.035


def test_the_choice_follows_a_box_that_gets_busy() -> None:
    """Two threads are cheaper on a quiet box; when the box gets busy (one thread now cheaper),
    the chooser moves to one thread within a bounded number of steps, and back again."""
    c = Chooser(2)
    run(c, {2: 1.0, 1: 1.6}, 500)
    assert c.preferred(8) == 2
    used = run(c, {2: 10.0, 1: 1.6}, 500)
    assert c.preferred(8) == 1
    assert used[-100:].count(1) >= 95
    used = run(c, {2: 1.0, 1: 1.6}, 20_000)
    assert c.preferred(8) == 2
    assert used[-100:].count(2) >= 95


def test_the_step_after_a_change_is_not_measured_and_a_retry_is_two_steps() -> None:
    """Changing the count costs the step after it (llama.cpp's threads regroup): that step's
    time is not the count's, so a count is not condemned for it, and a retry runs two steps
    so that one is measured."""
    c = Chooser(2)
    last = 0
    used = []
    for _ in range(2000):
        t = c.choose(8)
        switched = t != last
        steady = {2: 1.0, 1: 1.3}[t]
        c.observe(8, t, (steady + (5.0 if switched else 0.0)) * 8, switched)
        used.append(t)
        last = t
    assert c.preferred(8) == 2
    runs = [
        len(list(g)) for k, g in itertools.groupby(used[4:]) if k == 1
    ]  # after the first measures: every retry of one thread is PROBE_STEPS steps long
    assert runs and set(runs) == {decode_threads.PROBE_STEPS}


def test_steps_of_different_sizes_are_judged_apart() -> None:
    """A prompt chunk and a generation step cost per token nothing alike: each size keeps its
    own measure (here the chunk prefers two threads while the step prefers one)."""
    c = Chooser(2)
    for _ in range(300):
        for n, cost in ((8, {2: 5.0, 1: 1.0}), (512, {2: 0.1, 1: 0.2})):
            t = c.choose(n)
            c.observe(n, t, cost[t] * n)
    assert c.preferred(8) == 1
    assert c.preferred(512) == 2
    assert c.preferred(100_000) is None  # never seen


class ThreadedBackend(FakeBackend):
    """The grammar tests' fake, whose decode costs ``cost[threads]`` on a clock it advances:
    the engine's timing is exercised without a wall clock."""

    def __init__(self, cost: dict[int, float]) -> None:
        super().__init__(lambda s: [1])  # token 1 forever: streams end at max_tokens
        self.cost = cost
        self.now = 0.0
        self.threads = 0
        self.set_calls: list[int] = []

    def set_threads(self, threads: int) -> None:
        self.threads = threads
        self.set_calls.append(threads)

    def decode(self) -> int:
        self.now += self.cost[self.threads]
        return 0


def test_the_engine_decodes_each_step_with_the_chosen_count() -> None:
    b = ThreadedBackend({2: 4.0, 1: 1.0})
    chooser = Chooser(2)
    e = Engine(b, n_slots=2, n_ctx_slot=512, n_batch=64, threads=chooser, clock=lambda: b.now)
    try:
        jobs = [e.submit(Job([3, 4, 5], 200, Sampling(temperature=0))) for _ in range(2)]
        for j in jobs:
            toks, end = drain(j)
            assert isinstance(end, End) and end.reason == "length"
            assert len(toks) == 200 and EOG not in {t.id for t in toks}
    finally:
        e.close()
    # Both counts were set and measured; then one thread (4x cheaper here) was kept, and the
    # backend was told only when the count changed.
    assert b.set_calls[:2] == [2, 1]
    assert chooser.preferred(2) == 1
    assert all(a != b for a, b in zip(b.set_calls, b.set_calls[1:], strict=False))
    assert b.set_calls.count(2) < e.steps // 4


def test_an_engine_without_a_chooser_never_sets_threads() -> None:
    b = ThreadedBackend({0: 1.0})
    e = Engine(b, n_slots=1, n_ctx_slot=512, n_batch=64)
    try:
        drain(e.submit(Job([3, 4], 20, Sampling(temperature=0))))
    finally:
        e.close()
    assert b.set_calls == []


def test_two_sizes_alternating_each_step_still_get_measured() -> None:
    """Steps of two sizes in turn, each preferring another count: every step comes right after
    a change, yet both sizes are measured (from those steps) and settle."""
    c = Chooser(2)
    last = 0
    for _ in range(400):
        for n, cost in ((1, {2: 3.0, 1: 1.0}), (512, {2: 0.1, 1: 0.3})):
            t = c.choose(n)
            c.observe(n, t, cost[t] * n, t != last)
            last = t
    assert c.preferred(1) == 1
    assert c.preferred(512) == 2
