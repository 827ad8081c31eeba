"""The engine's grammar order and budget (workers.engine), on a fake Backend behind the same
interface: it decodes nothing, draws the token the test scripts, and counts how often the
grammar was asked about one token and how often it was applied to the whole vocabulary.

Its grammar is a set of allowed tokens; its grammar work burns CPU time for as long as the
test says (the engine's budget counts the engine thread's CPU time), so a test can make one
request's grammar costly and assert what happens to it and to the request beside it: counts
and orders, never a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from workers.engine import End, Engine, GrammarBudgetExceeded, Job, Sampling, Token

WAIT_S = 30.0  # bounds a broken test only
VOCAB = 16
EOG = 15


def burn(cpu_s: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_s:
        pass


@dataclass
class FakeGrammar:
    """``Sampling.grammar`` for the fake: the tokens it allows, and the CPU each call costs."""

    allowed: frozenset[int]
    cost_s: float = 0.0


@dataclass
class FakeSampler:
    picks: list[int]  # what the chain draws, in turn (the last one repeats)
    grammar: FakeGrammar | None
    accepted: list[int] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        self.closed = True

    def next_pick(self) -> int:
        return self.picks.pop(0) if len(self.picks) > 1 else self.picks[0]


class FakeBackend:
    n_vocab = VOCAB

    def __init__(self, picks: Callable[[Sampling], list[int]]) -> None:
        self._picks = picks
        self.samplers: list[FakeSampler] = []
        self.checks = 0  # the grammar asked about one token
        self.applied = 0  # the grammar applied to the whole vocabulary
        self.lock = threading.Lock()

    def sampler(self, sampling: Sampling) -> FakeSampler:
        s = FakeSampler(list(self._picks(sampling)), sampling.grammar)
        with self.lock:
            self.samplers.append(s)
        return s

    def add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        pass

    def decode(self) -> int:
        return 0

    def sample(self, sampler: FakeSampler, idx: int) -> int:
        token = sampler.next_pick()
        sampler.accepted.append(token)
        return token

    def draw(self, sampler: FakeSampler, idx: int, grammar: bool) -> int | None:
        token = sampler.next_pick()
        if not grammar:
            return token
        g = sampler.grammar
        assert g is not None
        self.applied += 1
        burn(g.cost_s)
        # The chain's best among what the grammar leaves: the smallest allowed token.
        return min(g.allowed) if g.allowed else None

    def allows(self, sampler: FakeSampler, token: int) -> bool:
        g = sampler.grammar
        assert g is not None
        self.checks += 1
        burn(g.cost_s)
        return token in g.allowed

    def accept(self, sampler: FakeSampler, token: int) -> None:
        g = sampler.grammar
        assert g is None or token in g.allowed, "accepted a token the grammar refuses"
        sampler.accepted.append(token)

    def logits(self, idx: int) -> np.ndarray:
        return np.zeros(VOCAB, dtype=np.float32)

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def seq_rm(self, seq: int, p0: int) -> bool:
        return True

    def seq_pos_min(self, seq: int) -> int:
        return 0

    def close(self) -> None:
        pass


def drain(job: Job) -> tuple[list[Token], End | BaseException]:
    out: list[Token] = []
    while True:
        try:
            item = job.next()
        except BaseException as e:  # what failed the job
            return out, e
        if isinstance(item, End):
            return out, item
        out.append(item)


def run_one(
    backend: FakeBackend, sampling: Sampling, max_tokens: int = 5, budget: float = 0.0, **kw: Any
) -> tuple[list[Token], End | BaseException]:
    engine = Engine(backend, n_slots=1, n_ctx_slot=64, n_batch=8, grammar_budget_s=budget)
    try:
        return drain(engine.submit(Job([1, 2], max_tokens, sampling, **kw)))
    finally:
        engine.close()


def test_a_token_the_grammar_allows_is_taken_without_applying_the_grammar() -> None:
    b = FakeBackend(lambda sp: [3])
    tokens, end = run_one(b, Sampling(grammar=FakeGrammar(frozenset({3, 4}))))
    assert end == End("length")
    assert [t.id for t in tokens] == [3] * 5
    assert (b.checks, b.applied) == (5, 0)  # one cheap check per token, nothing more
    assert b.samplers[0].accepted == [3] * 5  # into the grammar and the chain, each time
    assert b.samplers[0].closed


def test_a_refused_token_applies_the_grammar_and_the_chain_draws_again() -> None:
    # The chain wants 7 (refused), then 4 (allowed), then 7 again.
    b = FakeBackend(lambda sp: [7, 7, 4, 7, 7])
    tokens, end = run_one(b, Sampling(grammar=FakeGrammar(frozenset({3, 4}))), max_tokens=3)
    assert end == End("length")
    # 7 refused: resampled under the grammar (its best is 3); 4 allowed as drawn; 7 refused.
    assert [t.id for t in tokens] == [3, 4, 3]
    assert (b.checks, b.applied) == (3, 2)
    assert b.samplers[0].accepted == [3, 4, 3]


def test_without_a_grammar_the_chain_samples_alone() -> None:
    b = FakeBackend(lambda sp: [5])
    tokens, end = run_one(b, Sampling())
    assert [t.id for t in tokens] == [5] * 5 and end == End("length")
    assert (b.checks, b.applied) == (0, 0)


def test_a_grammar_that_leaves_no_token_ends_its_request_without_accepting() -> None:
    b = FakeBackend(lambda sp: [7])
    tokens, end = run_one(b, Sampling(grammar=FakeGrammar(frozenset())))
    assert tokens == [] and isinstance(end, RuntimeError)
    assert b.samplers[0].accepted == []


def test_an_allowed_end_of_generation_token_stops() -> None:
    b = FakeBackend(lambda sp: [3, EOG])
    tokens, end = run_one(b, Sampling(grammar=FakeGrammar(frozenset({3, EOG}))))
    assert [t.id for t in tokens] == [3] and end == End("stop")


def test_logprobs_come_from_the_raw_logits_also_after_a_refusal() -> None:
    b = FakeBackend(lambda sp: [7])
    tokens, _ = run_one(b, Sampling(grammar=FakeGrammar(frozenset({3}))), 2, n_probs=2)
    # Flat logits: every token has log(1/VOCAB), the grammar's choice included.
    assert all(t.id == 3 for t in tokens)
    assert all(t.logprob == pytest.approx(-np.log(VOCAB)) for t in tokens)
    assert all(len(t.top) == 2 for t in tokens)


def test_the_stop_token_check_gets_the_sampled_token_only() -> None:
    seen: list[Any] = []

    def stop(token: int) -> bool:
        seen.append(token)
        return token == 9

    b = FakeBackend(lambda sp: [2, 2, 9])
    tokens, end = run_one(b, Sampling(), max_tokens=10, stop_token=stop)
    assert [t.id for t in tokens] == [2, 2] and end == End("stop")
    assert seen == [2, 2, 9]  # each token as it came, not the context


def test_a_costly_grammar_ends_its_request_alone_and_the_other_slot_keeps_one_token_a_step() -> (
    None
):
    costly = FakeGrammar(frozenset({3}), cost_s=0.002)
    # The costly request's chain always wants a refused token: each of its tokens costs a check
    # and an application (4 ms of CPU); its budget is 10 ms: it ends on its third token.
    b = FakeBackend(lambda sp: [7] if sp.grammar is costly else [5])
    engine = Engine(b, n_slots=2, n_ctx_slot=512, n_batch=8, grammar_budget_s=0.01)
    try:
        victim = engine.submit(Job([1], 200, Sampling()))
        bad = engine.submit(Job([1], 200, Sampling(grammar=costly)))
        bad_tokens, bad_end = drain(bad)
        victim_tokens, victim_end = drain(victim)
        steps = engine.steps
    finally:
        engine.close()
    assert isinstance(bad_end, GrammarBudgetExceeded)
    assert bad_end.budget_s == 0.01 and bad_end.spent_s > 0.01
    assert 1 <= len(bad_tokens) < 5
    # The other request got every one of its tokens, one per step throughout (the two were
    # admitted in the same step), and was never charged for the other's grammar.
    assert victim_end == End("length")
    assert len(victim_tokens) == 200 and all(t.id == 5 for t in victim_tokens)
    assert steps == 200
    assert victim.grammar_s == 0.0 and victim.grammar_applied == 0
    assert bad.grammar_applied == b.applied
