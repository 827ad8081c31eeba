"""How many threads each engine step decodes with (pure: the engine times the steps).

llama.cpp's CPU threads meet at a spinning barrier after every operation of the graph. While
all of them run, that is the fastest way to decode; when one is taken off its core (the box's
own web workers, Redis and serving threads want the same cores between and during steps), the
others spin until it comes back, and a step of a few hundred microseconds takes milliseconds.
On a 2-core box with 8 streams of a small model this made two threads decode at a tenth of the
rate of one. A fixed count cannot be right for both cases: on an idle box one thread is slower
(Gemma 3 270M: 17-18 ms a token against 12-17 ms).

So the engine measures. A ``Chooser`` keeps, per size of step (its token count, by powers of
two: a prompt chunk costs per token nothing like a generation step) and per candidate thread
count, a moving average of the step's wall time per token, and picks the count that has been
cheapest. The other count is tried again from time to time to see whether the box got quieter
or busier: after ``explore_every`` steps of that size, times how much worse it was last seen,
so a count that costs ten times more is retried ten times less often (but at least every
``EXPLORE_EVERY x MAX_BACKOFF`` steps) and retrying costs about 3% of the decode time at most.
A size seen for the first time starts with the count preferred at the nearest size measured
(all the threads at first), measured twice (the first measure replaced: a size's first step
pays for what a first decode touches); the other count is first tried after EXPLORE_EVERY steps
of it, so a size seldom seen, such as a step with a prompt chunk, is not made to try every
count. The step right after the count changed is not measured: it pays for the change
(llama.cpp's threads regroup), so a retry is two steps, the second one timed.

Candidates: all the threads the model may use, and one fewer (a core left to the path each
token travels). A model whose ``n_threads`` is set in its config gets exactly that: no
chooser.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EWMA = 0.25  # weight of the newest step in a count's moving average
EXPLORE_EVERY = 64  # steps of one size before the count not chosen is tried again (at best)
# A count r times dearer is retried every EXPLORE_EVERY x r steps, at least every EXPLORE_EVERY
# x MAX_BACKOFF: a retry (PROBE_STEPS steps) then costs PROBE_STEPS x (r - 1) / (EXPLORE_EVERY
# x r), under 3.2% of the decode time for r up to MAX_BACKOFF, and one unlucky measure (the box
# busy for a moment) keeps the better count unused for EXPLORE_EVERY x r steps.
MAX_BACKOFF = 32
# Each count is measured this many times before one is preferred, the first measure replaced
# by the next (a size's first step pays for what a first decode touches).
FIRST_MEASURES = 2
# The first step after the count changed is slower (llama.cpp's thread team changes size: on
# Gemma 3 270M, 19 ms against 13 ms steady for two threads): it is not measured. So a retry is
# this many steps in a row, the last one measured.
PROBE_STEPS = 2
# Fewer threads than all must be this much cheaper to be preferred: inside the box a step's
# time carries the other roles' wake-ups (a flush, web's read, the client), which weigh on two
# threads more than on one, while the tokens/s of all threads stayed higher (Gemma 3 270M, one
# stream on 2 cores: 58-59 tok/s with two threads, 43-55 with the count chosen on time alone).
MARGIN = 0.15
# A count never used twice in a row (steps of two sizes alternating, each preferring another
# count) is measured from its steps right after a change, after this many of them.
SWITCHED_ENOUGH = 8


def candidates(threads: int) -> tuple[int, ...]:
    """The counts a chooser picks from: ``threads`` and one fewer (just ``threads`` for 1)."""
    return (threads, threads - 1) if threads > 1 else (threads,)


@dataclass
class _Size:
    """What is known of steps of one size."""

    cost: dict[int, float] = field(default_factory=dict)  # threads -> seconds per token
    tried: dict[int, int] = field(default_factory=dict)  # threads -> step number when last used
    measured: dict[int, int] = field(default_factory=dict)  # threads -> steps whose time counted
    switched: dict[int, int] = field(default_factory=dict)  # threads -> steps right after a change
    steady: dict[int, int] = field(default_factory=dict)  # threads -> steps with the same count
    steps: int = 0
    probe: int = 0  # a count being retried (0: none), for ``probe_left`` more steps
    probe_left: int = 0

    def known(self, threads: int) -> bool:
        return (
            self.measured.get(threads, 0) >= FIRST_MEASURES
            or self.switched.get(threads, 0) >= SWITCHED_ENOUGH
        ) and threads in self.cost


class Chooser:
    def __init__(self, threads: int, explore_every: int = EXPLORE_EVERY) -> None:
        self.options = candidates(threads)
        self.explore_every = explore_every
        self._sizes: dict[int, _Size] = {}
        self.explored = 0  # retries of a count other than the cheapest known, to learn

    @staticmethod
    def size(n_tokens: int) -> int:
        return max(1, n_tokens).bit_length()

    def choose(self, n_tokens: int) -> int:
        """The thread count for the next step of ``n_tokens`` tokens."""
        size = self.size(n_tokens)
        s = self._sizes.setdefault(size, _Size())
        s.steps += 1
        if s.probe_left > 0:
            s.probe_left -= 1
            return self._use(s, s.probe)
        known = [t for t in self.options if s.known(t)]
        if not known:  # a size not seen yet starts where the nearest known size is
            return self._use(s, self._prior(size))
        best = self._best(s, known)
        for t in self.options:
            if t == best:
                continue
            # A count not measured at this size yet is first tried after EXPLORE_EVERY steps:
            # a size seldom seen (a prompt chunk) is not made to try every count at once.
            worse = min(MAX_BACKOFF, max(1.0, s.cost[t] / s.cost[best])) if t in known else 1.0
            if s.steps - s.tried.get(t, 0) >= self.explore_every * worse:
                self.explored += 1
                s.probe, s.probe_left = t, PROBE_STEPS - 1
                return self._use(s, t)
        return self._use(s, best)

    def _best(self, s: _Size, known: list[int]) -> int:
        """The cheapest of the measured counts, all the threads unless another is MARGIN
        cheaper."""
        best = min(known, key=lambda t: s.cost[t])
        full = self.options[0]
        if best != full and full in known and s.cost[best] > s.cost[full] * (1 - MARGIN):
            return full
        return best

    def _prior(self, size: int) -> int:
        """The count preferred at the nearest size with a measure (all threads: none)."""
        near = [k for k, s in self._sizes.items() if any(s.known(t) for t in self.options)]
        if not near:
            return self.options[0]
        s = self._sizes[min(near, key=lambda k: (abs(k - size), k))]
        return self._best(s, [t for t in self.options if s.known(t)])

    @staticmethod
    def _use(s: _Size, threads: int) -> int:
        s.tried[threads] = s.steps
        return threads

    def observe(self, n_tokens: int, threads: int, seconds: float, switched: bool = False) -> None:
        """A step of ``n_tokens`` decoded with ``threads`` threads took ``seconds``;
        ``switched``: the step before it used another count."""
        s = self._sizes.setdefault(self.size(n_tokens), _Size())
        if switched:
            n = s.switched[threads] = s.switched.get(threads, 0) + 1
            if s.steady.get(threads, 0) or (threads in s.cost and n < SWITCHED_ENOUGH):
                return  # the change's own cost, not the count's
        else:
            s.steady[threads] = s.steady.get(threads, 0) + 1
        per_token = seconds / max(1, n_tokens)
        seen = s.measured.get(threads, 0)
        s.measured[threads] = seen + 1
        prev = s.cost.get(threads)
        if prev is None or seen < FIRST_MEASURES:
            s.cost[threads] = per_token  # the first measures are replaced, not averaged
        else:
            s.cost[threads] = prev + EWMA * (per_token - prev)

    def preferred(self, n_tokens: int) -> int | None:
        """The count cheapest so far among those measured for steps of this size (None: none
        measured yet)."""
        s = self._sizes.get(self.size(n_tokens))
        known = [t for t in self.options if s is not None and s.known(t)]
        if s is None or not known:
            return None
        return self._best(s, known)

    def measured(self, n_tokens: int) -> tuple[int, ...]:
        """The counts measured for steps of this size."""
        s = self._sizes.get(self.size(n_tokens))
        return tuple(t for t in self.options if s is not None and s.known(t))
