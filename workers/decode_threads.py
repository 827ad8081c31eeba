"""How many threads each engine step decodes with (pure: the engine times the steps).

llama.cpp's CPU threads meet at a spinning barrier after every operation of the graph. While
all of them run, that is the fastest way to decode; when one is taken off its core (the box's
own web workers, Redis and serving threads want the same cores between and during steps), the
others spin until it comes back, and a step of a few hundred microseconds takes milliseconds.
On a 2-core box with 8 streams of a small model this made two threads decode at a tenth of the
rate of one. A fixed count cannot be right for both cases: one thread halves a large model's
rate on an idle box.

So the engine measures. A ``Chooser`` keeps, per size of step (its token count, by powers of
two: a prompt chunk costs per token nothing like a generation step) and per candidate thread
count, a moving average of the step's wall time per token, and picks the count that has been
cheapest. The other count is tried again from time to time to see whether the box got quieter
or busier: after ``explore_every`` steps of that size, times how much worse it was last seen,
so a count that costs ten times more is retried ten times less often and exploration never
costs more than about ``1 / explore_every`` of the decode time.

Candidates: all the threads the model may use, and one fewer (a core left to the path each
token travels). A model whose ``n_threads`` is set in its config gets exactly that: no
chooser.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EWMA = 0.25  # weight of the newest step in a count's moving average
EXPLORE_EVERY = 32  # steps of one size before the count not chosen is tried again (at best)
MAX_BACKOFF = 64  # a count is retried at least every EXPLORE_EVERY x this many steps


def candidates(threads: int) -> tuple[int, ...]:
    """The counts a chooser picks from: ``threads`` and one fewer (just ``threads`` for 1)."""
    return (threads, threads - 1) if threads > 1 else (threads,)


@dataclass
class _Size:
    """What is known of steps of one size."""

    cost: dict[int, float] = field(default_factory=dict)  # threads -> seconds per token
    tried: dict[int, int] = field(default_factory=dict)  # threads -> step number when last used
    steps: int = 0


class Chooser:
    def __init__(self, threads: int, explore_every: int = EXPLORE_EVERY) -> None:
        self.options = candidates(threads)
        self.explore_every = explore_every
        self._sizes: dict[int, _Size] = {}
        self.explored = 0  # steps decoded with a count other than the cheapest known, to learn

    @staticmethod
    def size(n_tokens: int) -> int:
        return max(1, n_tokens).bit_length()

    def choose(self, n_tokens: int) -> int:
        """The thread count for the next step of ``n_tokens`` tokens."""
        s = self._sizes.setdefault(self.size(n_tokens), _Size())
        s.steps += 1
        for t in self.options:  # each count is measured once before any is preferred
            if t not in s.cost:
                return self._use(s, t)
        best = min(self.options, key=lambda t: s.cost[t])
        for t in self.options:
            if t == best:
                continue
            worse = min(MAX_BACKOFF, max(1.0, s.cost[t] / s.cost[best]))
            if s.steps - s.tried.get(t, 0) >= self.explore_every * worse:
                self.explored += 1
                return self._use(s, t)
        return self._use(s, best)

    @staticmethod
    def _use(s: _Size, threads: int) -> int:
        s.tried[threads] = s.steps
        return threads

    def observe(self, n_tokens: int, threads: int, seconds: float) -> None:
        """A step of ``n_tokens`` decoded with ``threads`` threads took ``seconds``."""
        s = self._sizes.setdefault(self.size(n_tokens), _Size())
        per_token = seconds / max(1, n_tokens)
        prev = s.cost.get(threads)
        s.cost[threads] = per_token if prev is None else prev + EWMA * (per_token - prev)

    def preferred(self, n_tokens: int) -> int | None:
        """The count cheapest so far for steps of this size (None: not measured yet)."""
        s = self._sizes.get(self.size(n_tokens))
        if s is None or any(t not in s.cost for t in self.options):
            return None
        return min(self.options, key=lambda t: s.cost[t])
