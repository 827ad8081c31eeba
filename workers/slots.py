"""A model's slots: their states, and which free slot a new prompt goes to (pure).

A slot is one sequence of the batched engine, with its own share of the context. It keeps the
tokens of its last request in memory after the request ends, so a prompt that starts with them
(the next turn of a conversation) prefills only what is new.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class SlotState(enum.StrEnum):
    FREE = "free"  # no request; its cached tokens wait for a prompt that shares them
    PREFILL = "prefill"  # its prompt's uncached tokens are being decoded, a chunk per step
    GENERATE = "generate"  # one token per step


TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.FREE: frozenset({SlotState.PREFILL}),
    # A prompt fully decoded samples its first token; a request can end while prefilling
    # (cancelled, or a decode error).
    SlotState.PREFILL: frozenset({SlotState.GENERATE, SlotState.FREE}),
    SlotState.GENERATE: frozenset({SlotState.FREE}),
}


def check_transition(old: SlotState, new: SlotState) -> None:
    if new not in TRANSITIONS[old]:
        raise RuntimeError(f"slot cannot go from {old} to {new}")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Choice:
    slot: int  # index of the slot
    keep: int  # its cached tokens that the prompt reuses (the rest of the cache is dropped)


def choose(free: Sequence[tuple[int, Sequence[int], float]], prompt: Sequence[int]) -> Choice:
    """The free slot for ``prompt``: the one whose cached tokens share the longest prefix with
    it; on a tie (no slot shares anything, say), the one used least recently, so the caches of
    other recent conversations live longest. ``free`` holds (index, cached tokens, last used).
    At least one prompt token is always left to decode: its logits give the first token."""
    if not free:
        raise ValueError("no free slot")
    best = max(free, key=lambda f: (common_prefix(f[1], prompt), -f[2]))
    keep = min(common_prefix(best[1], prompt), max(len(prompt) - 1, 0))
    return Choice(best[0], keep)
