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
class Cached:
    """A free slot as ``choose`` sees it: its index, the tokens its memory holds, when its last
    request ended, whose request filled it, and how many of its first tokens that request
    marked shareable (the part its system message(s) cover)."""

    slot: int
    tokens: Sequence[int]
    used: float = 0.0
    owner: str = ""
    shareable: int = 0


@dataclass(frozen=True)
class Asker:
    """Who a new prompt is for: its user, the length of its own shareable part, and the
    ``[cache] scope`` it was submitted under."""

    owner: str = ""
    shareable: int = 0
    scope: str = "user"


def reusable(c: Cached, prompt: Sequence[int], asker: Asker) -> int:
    """The cached tokens of ``c`` that ``prompt`` may reuse. The same user reuses all it
    shares; across users, ``global`` reuses all, ``shared_system`` no more than both prompts'
    shareable parts, ``user`` nothing — so what a caller reuses (and sees in ``cached_tokens``
    and its time to first token) never depends on another user's prompt beyond its scope."""
    n = common_prefix(c.tokens, prompt)
    if asker.scope == "global" or c.owner == asker.owner:
        return n
    if asker.scope == "shared_system":
        return min(n, c.shareable, asker.shareable)
    return 0


@dataclass(frozen=True)
class Choice:
    slot: int  # index of the slot
    keep: int  # its cached tokens that the prompt reuses (the rest of the cache is dropped)


def choose(free: Sequence[Cached], prompt: Sequence[int], asker: Asker | None = None) -> Choice:
    """The free slot for ``prompt``: the one whose cached tokens it may reuse most of
    (``reusable``); on a tie (no slot shares anything, say), the one used least recently, so
    the caches of other recent conversations live longest. At least one prompt token is
    always left to decode: its logits give the first token."""
    if not free:
        raise ValueError("no free slot")
    who = asker or Asker()
    best = max(free, key=lambda f: (reusable(f, prompt, who), -f.used))
    keep = min(reusable(best, prompt, who), max(len(prompt) - 1, 0))
    return Choice(best.slot, keep)
