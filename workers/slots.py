"""A model's slots: their states, and where a new prompt goes (pure).

A slot is one sequence of the batched engine, with its own share of the context. It keeps the
tokens of its last request in memory after the request ends, so a prompt that starts with them
(the next turn of a conversation) prefills only what is new.

A prompt's prefix may also be found elsewhere: in a busy slot (a shared system prompt another
request is using, or the conversation's own slot still finishing the answer its client stopped
reading), or in a slot state saved to disk before the model was last unloaded. ``plan`` decides
between taking a free slot as it is, restoring a saved state into it, copying a busy slot's
memory into it, or waiting a few steps for the conversation's own slot.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

#: Prompt tokens a restore, a copy or a wait must save over the best free slot to be chosen: each
#: costs something (a read from disk, a copy of a whole slot's memory, a few steps of delay).
MIN_GAIN = 16
#: Engine steps a request waits at most for its conversation's own slot to finish.
WAIT_STEPS = 8


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
    return allowed(common_prefix(c.tokens, prompt), c.owner, c.shareable, asker)


def allowed(n: int, owner: str, shareable: int, asker: Asker) -> int:
    """Of ``n`` leading tokens shared with a cache that ``owner``'s request filled (its first
    ``shareable`` marked shareable), those ``asker`` may reuse (see ``reusable``)."""
    if asker.scope == "global" or owner == asker.owner:
        return n
    if asker.scope == "shared_system":
        return min(n, shareable, asker.shareable)
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


@dataclass(frozen=True)
class Held:
    """A busy slot as ``plan`` sees it: what its memory holds and whose it is, how many of its
    tokens are its request's prompt (the rest it generated), how many it may still generate,
    and whether its request was cancelled (its slot frees at the next step)."""

    slot: int
    tokens: Sequence[int]
    owner: str
    shareable: int
    prompt_len: int
    remaining: int
    cancelled: bool = False


class Action(enum.StrEnum):
    TAKE = "take"  # the free slot as it is (reusing what it holds)
    RESTORE = "restore"  # a saved state restored into the free slot first
    COPY = "copy"  # a busy slot's memory copied into the free slot first
    WAIT = "wait"  # wait for the busy slot holding the conversation (it is finishing)


@dataclass(frozen=True)
class Plan:
    action: Action
    slot: int = -1  # the free slot the request goes to (-1: WAIT)
    keep: int = 0  # prompt tokens reused there
    source: int = -1  # COPY and WAIT: the busy slot


def finishing(h: Held, shared: int) -> bool:
    """Whether a busy slot is about to free: its request was cancelled, it has at most
    WAIT_STEPS tokens left, or a new prompt reuses what it generated — a follow-up to the answer
    it is still writing, whose client has read (or stopped reading) that answer."""
    return h.cancelled or h.remaining <= WAIT_STEPS or shared > h.prompt_len


def plan(
    free: Sequence[Cached],
    held: Sequence[Held],
    prompt: Sequence[int],
    asker: Asker,
    saved: Cached | None = None,
    waited: int = 0,
    can_copy: bool = False,
) -> Plan:
    """Where ``prompt`` goes (``free`` must not be empty): the free slot ``choose`` picks, unless
    a busy slot or the ``saved`` state (from disk) holds at least MIN_GAIN more of its tokens
    that ``asker`` may reuse. Then: a busy slot of the same user that is ``finishing`` is waited
    for (``waited`` steps so far, at most WAIT_STEPS); otherwise its memory is copied when
    ``can_copy``; else the saved state is restored. A restore or copy goes to the least
    recently used free slot: the one whose own cache is worth least."""
    c = choose(free, prompt, asker)
    cap = max(len(prompt) - 1, 0)
    from_saved = min(reusable(saved, prompt, asker), cap) if saved is not None else 0
    target = min(free, key=lambda f: f.used).slot
    best: Held | None = None
    from_held = 0
    for h in held:
        n = min(reusable(Cached(h.slot, h.tokens, 0.0, h.owner, h.shareable), prompt, asker), cap)
        if n > from_held:
            best, from_held = h, n
    if best is not None and from_held >= max(c.keep, from_saved) + MIN_GAIN:
        if best.owner == asker.owner and waited < WAIT_STEPS and finishing(best, from_held):
            return Plan(Action.WAIT, source=best.slot)
        if can_copy:
            return Plan(Action.COPY, target, from_held, best.slot)
    if from_saved >= c.keep + MIN_GAIN:
        return Plan(Action.RESTORE, target, from_saved)
    return Plan(Action.TAKE, c.slot, c.keep)
