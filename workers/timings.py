"""Where one request's time went, as the model process saw it (pure: no Redis, no llama.cpp).

Reported with its answer as ``timings`` (llama-server's names, plus the queue): ``queue_ms``
from web's submit to this process taking it (two hosts' clocks: a skew shows here, never
below 0), ``prompt_ms`` from taking it to its first generated token (the prompt's prefill and
the first decode step), ``predicted_ms`` from there to its end, and the token counts
``prompt_n``, ``cache_n`` (prompt tokens reused from a cache) and ``predicted_n``. A client
then sees the box's share of its wall time, and what of it was waiting.

The same times feed the router's predictions (``residency.route_wait``): the model's pace
(``fold_service``, written to ``keys.service``) and, for a routed request, its actual wait set
against the predicted one (``route_sample``, written to ``keys.route_samples``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from residency.policies.schema import POLICY_NAME_RE
from residency.route_wait import Service

OnStep = Callable[[], None]

#: Weight of the newest request in the moving averages of a model's pace.
SERVICE_EWMA = 0.2


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

    def actual_wait(self) -> dict[str, float] | None:
        """What a router predicts, as it happened (seconds): ``queue`` from submit to being
        taken, ``first`` from there to the first generated token, ``wait`` their sum; None
        without a first token. Never below 0 (two hosts' clocks)."""
        if self.first is None:
            return None
        queue = round(max(0.0, self.taken - self.submitted), 4)
        first = round(max(0.0, self.first - self.taken), 4)
        return {"wait": round(queue + first, 4), "queue": queue, "first": first}


def _ewma(prev: float | None, value: float) -> float:
    return value if prev is None else prev + SERVICE_EWMA * (value - prev)


def fold_service(
    prev: Service, served_s: float, first_s: float | None = None, new_bytes: float | None = None
) -> Service:
    """``prev`` with one request folded in: ``served_s`` in its slot, and (a generation that
    reached its first token) ``first_s`` from being taken to it for ``new_bytes`` uncached
    prompt bytes (``residency.prompt_size``), with the square and product the line's fit needs.
    A request without them (an embedding, a rerank, one ended before its first token) leaves
    those averages as they were."""
    if first_s is None or new_bytes is None:
        return replace(prev, service_s=_ewma(prev.service_s, served_s))
    y, x = max(0.0, first_s), max(0.0, float(new_bytes))
    return Service(
        _ewma(prev.service_s, served_s),
        _ewma(prev.first_s, y),
        _ewma(prev.new_bytes, x),
        _ewma(prev.bytes_sq, x * x),
        _ewma(prev.bytes_first, x * y),
    )


def route_sample(
    route: dict[str, Any], model: str, actual: dict[str, float] | None, now: float
) -> tuple[str, str, float] | None:
    """(policy, sample JSON, seconds between the predicted and the actual wait) of a routed
    request, or None: not routed, nothing predicted, no first token, or a policy name that is
    not one (web checked it; a request that did not come from web names no key here)."""
    policy, predicted = route.get("policy"), route.get("predicted")
    if actual is None or not isinstance(predicted, dict) or not isinstance(policy, str):
        return None
    wait = predicted.get("wait")
    if not POLICY_NAME_RE.match(policy) or not isinstance(wait, int | float):
        return None
    sample = {
        "t": round(now, 3),
        "candidate": model,
        "rule": str(route.get("rule", "")),
        "predicted": predicted,
        "actual": actual,
    }
    error = round(abs(float(wait) - actual["wait"]), 4)
    return policy, json.dumps(sample, separators=(",", ":")), error


def _ms(seconds: float) -> float:
    return round(max(0.0, seconds) * 1000.0, 3)
