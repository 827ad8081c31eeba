"""Where one request's time went, as the model process saw it (pure: no Redis, no llama.cpp).

Reported with its answer as ``timings`` (llama-server's names, plus the queue): ``queue_ms``
from web's submit to this process taking it (two hosts' clocks: a skew shows here, never
below 0), ``prompt_ms`` from taking it to its first generated token (the prompt's prefill and
the first decode step), ``predicted_ms`` from there to its end, and the token counts
``prompt_n``, ``cache_n`` (prompt tokens reused from a cache) and ``predicted_n``. A client
then sees the box's share of its wall time, and what of it was waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

OnStep = Callable[[], None]


@dataclass
class Timings:
    submitted: float  # when web submitted it (epoch seconds)
    taken: float = field(default_factory=time.time)  # when this process took it
    first: float | None = None  # its first generated token

    def on_step(self, inner: OnStep | None) -> OnStep:
        """``inner`` (the per-token hook), noting the first token's time."""

        def step() -> None:
            if self.first is None:
                self.first = time.time()
            if inner is not None:
                inner()

        return step

    def report(self, usage: list[int], end: float | None = None) -> dict[str, Any]:
        """The ``timings`` object; ``usage``: (prompt, completion, cached) tokens."""
        end = time.time() if end is None else end
        first = self.first if self.first is not None else end
        prompt, completion, cached = usage if usage else (0, 0, 0)
        return {
            "queue_ms": _ms(self.taken - self.submitted),
            "prompt_n": prompt,
            "cache_n": cached,
            "prompt_ms": _ms(first - self.taken),
            "predicted_n": completion,
            "predicted_ms": _ms(end - first),
        }


def _ms(seconds: float) -> float:
    return round(max(0.0, seconds) * 1000.0, 3)
