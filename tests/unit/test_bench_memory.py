"""bench/memory.py's offline policies: Belady's plan is optimal, and the sequence is seeded."""

from __future__ import annotations

import functools
import random
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import memory  # noqa: E402


def optimal_loads(seq: tuple[str, ...], capacity: int) -> int:
    """The fewest loads over every choice of victim: exhaustive, for short sequences only."""

    @functools.cache
    def best(i: int, resident: frozenset[str]) -> int:
        if i == len(seq):
            return 0
        name = seq[i]
        if name in resident:
            return best(i + 1, resident)
        if len(resident) < capacity:
            return 1 + best(i + 1, resident | {name})
        return 1 + min(best(i + 1, (resident - {v}) | {name}) for v in resident)

    return best(0, frozenset())


def test_belady_on_a_known_sequence() -> None:
    # 2 slots: a b load | c evicts b (a is needed first) | b evicts c (never again) | d evicts
    # b (a is needed first) | the last b finds a and d both unused again: the tie goes to a.
    # 6 loads, where LRU misses on all 8.
    seq = list("abcabdab")
    plan = memory.belady_plan(seq, 2)
    assert plan == [None, None, "b", None, "c", "b", None, "a"]
    assert memory.belady_loads(seq, 2) == 6
    assert memory.lru_loads(seq, 2) == 8


def test_belady_matches_the_exhaustive_optimum() -> None:
    rng = random.Random(7)
    for _ in range(60):
        seq = tuple(rng.choice("abcde") for _ in range(rng.randint(1, 14)))
        for capacity in (1, 2, 3):
            assert memory.belady_loads(seq, capacity) == optimal_loads(seq, capacity), seq


def test_no_unload_while_a_slot_is_free_and_none_on_a_hit() -> None:
    seq = ["a", "a", "b", "b", "a"]
    assert memory.belady_plan(seq, 2) == [None] * 5
    assert memory.belady_loads(seq, 2) == 2


def test_zipf_sequence_is_seeded_and_skewed_to_the_first_name() -> None:
    names = ("m1", "m2", "m3", "m4")
    a = memory.zipf_sequence(600, names, 1.0, 42)
    assert a == memory.zipf_sequence(600, names, 1.0, 42)
    counts = [a.count(n) for n in names]
    assert set(a) <= set(names)
    assert counts[0] == max(counts) and counts[0] > 2 * counts[3]
