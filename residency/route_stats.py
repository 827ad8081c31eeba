"""A router policy's last hour, for ``/health``: which candidates it chose and why, and how far
its predicted waits (``residency.route_wait``) were from the waits its requests had.

Pure (the caller reads the policy's ``keys.route_samples`` and ``keys.route_choices`` and gives
the time). Samples are what a model process recorded with each routed request it served:
the prediction's terms, and the actual wait split into its queue (submitted to taken: this
includes any load and room a cold candidate needed) and its first token (taken to first token).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The window the statistics cover.
WINDOW_S = 3600.0
#: A relative error is taken against at least this actual wait: a request that waited nothing
#: would otherwise make any small absolute miss an infinite relative one.
REL_FLOOR_S = 0.1
#: A policy whose median relative error is above this, over at least ``WARN_MIN_SAMPLES``
#: samples, is logged (at most once per ``WARN_EVERY_S``).
ROUTE_ERROR_BOUND = 0.5
WARN_MIN_SAMPLES = 20
WARN_EVERY_S = 3600.0

_PREDICTED = ("wait", "queue", "load", "room", "prefill")
_ACTUAL = ("wait", "queue", "first")


@dataclass(frozen=True)
class Sample:
    t: float
    predicted: dict[str, float]
    actual: dict[str, float]


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) and f >= 0 else None


def _terms(d: object, names: Sequence[str]) -> dict[str, float] | None:
    if not isinstance(d, dict):
        return None
    out = {k: _num(d.get(k)) for k in names}
    if any(v is None for v in out.values()):
        return None
    return {k: float(v) for k, v in out.items() if v is not None}


def parse(raw: str | bytes) -> Sample | None:
    """One ``keys.route_samples`` item; None when it lacks a time or any term."""
    try:
        d = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not isinstance(d, dict):
        return None
    t = _num(d.get("t"))
    predicted = _terms(d.get("predicted"), _PREDICTED)
    actual = _terms(d.get("actual"), _ACTUAL)
    if t is None or predicted is None or actual is None:
        return None
    return Sample(t, predicted, actual)


def _choice(field: str) -> tuple[int, str, str] | None:
    """``<epoch minute>|<candidate>|<reason>`` (a candidate's name may hold a ``|``)."""
    minute, _, rest = field.partition("|")
    candidate, _, reason = rest.rpartition("|")
    if not minute.isdigit() or not candidate or not reason:
        return None
    return int(minute), candidate, reason


def stale_choices(fields: Iterable[str], now: float, ttl_s: float) -> list[str]:
    """The choice fields of minutes older than ``ttl_s`` (the coordinator deletes them)."""
    out = []
    for f in fields:
        c = _choice(f)
        if c is not None and (c[0] + 1) * 60 <= now - ttl_s:
            out.append(f)
    return out


def _rel(diff: float, actual: float) -> float:
    return diff / max(actual, REL_FLOOR_S)


def _p90(values: Sequence[float]) -> float:
    """The nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def _off(samples: Sequence[Sample]) -> dict[str, Any] | None:
    """The term the predictions missed most: the queue side (predicted queue + load + room
    against the actual queue) or the prefill side (predicted prefill against the actual first
    token), whichever has the larger median absolute difference. On the queue side the
    predicted term that weighs most over the samples is named."""
    queue_abs, queue_rel, first_abs, first_rel = [], [], [], []
    for s in samples:
        p, a = s.predicted, s.actual
        d = abs(p["queue"] + p["load"] + p["room"] - a["queue"])
        queue_abs.append(d)
        queue_rel.append(_rel(d, a["queue"]))
        d = abs(p["prefill"] - a["first"])
        first_abs.append(d)
        first_rel.append(_rel(d, a["first"]))
    q, f = statistics.median(queue_abs), statistics.median(first_abs)
    if q == 0 and f == 0:
        return None
    if f > q:
        return {"term": "prefill", "median_rel": round(statistics.median(first_rel), 4)}
    sums = {k: sum(s.predicted[k] for s in samples) for k in ("queue", "load", "room")}
    if sums["load"] > 0 and sums["load"] >= max(sums["queue"], sums["room"]):
        term = "load"
    elif sums["room"] > 0 and sums["room"] >= sums["queue"]:
        term = "room"
    else:
        term = "queue"
    return {"term": term, "median_rel": round(statistics.median(queue_rel), 4)}


def stats(
    samples: Iterable[str | bytes], choices: Mapping[str, str | int], now: float
) -> dict[str, Any]:
    """A policy's routing over the last ``WINDOW_S``: its choices per candidate and per reason,
    and its samples' prediction error (null without samples)."""
    since = now - WINDOW_S
    by_candidate: Counter[str] = Counter()
    by_reason: Counter[str] = Counter()
    first_minute = math.floor(since / 60)
    for field, count in choices.items():
        c = _choice(field)
        try:
            n = int(count)
        except (TypeError, ValueError):
            continue
        if c is None or c[0] < first_minute:
            continue
        by_candidate[c[1]] += n
        by_reason[c[2]] += n
    window = [s for raw in samples if (s := parse(raw)) is not None and s.t >= since]
    error: dict[str, float] | None = None
    if window:
        abs_err = [abs(s.predicted["wait"] - s.actual["wait"]) for s in window]
        rel = [_rel(d, s.actual["wait"]) for d, s in zip(abs_err, window, strict=True)]
        error = {
            "median_abs_s": round(statistics.median(abs_err), 4),
            "median_rel": round(statistics.median(rel), 4),
            "p90_rel": round(_p90(rel), 4),
        }
    return {
        "choices": dict(sorted(by_candidate.items())),
        "reasons": dict(sorted(by_reason.items())),
        "samples": len(window),
        "error": error,
        "off": _off(window) if window else None,
    }


def should_warn(st: Mapping[str, Any], last_warned: float | None, now: float) -> bool:
    """Whether a policy's stats call for the warning: its median relative error above
    ``ROUTE_ERROR_BOUND`` over at least ``WARN_MIN_SAMPLES`` samples, and no warning for it in
    the last ``WARN_EVERY_S``."""
    error = st.get("error")
    if not error or int(st.get("samples") or 0) < WARN_MIN_SAMPLES:
        return False
    if float(error.get("median_rel") or 0.0) <= ROUTE_ERROR_BOUND:
        return False
    return last_warned is None or now - last_warned >= WARN_EVERY_S


def warning(policy: str, st: Mapping[str, Any]) -> str:
    """The warning's text: the policy, its median error and the term that was off."""
    error = st.get("error") or {}
    off = st.get("off") or {}
    rel = float(error.get("median_rel") or 0.0)
    abs_s = float(error.get("median_abs_s") or 0.0)
    return (
        f"router policy {policy}: predicted waits are off by a median {rel:.0%} ({abs_s:.2f} s) "
        f"over {st.get('samples')} requests in the last hour; the term most off is "
        f"{off.get('term', 'unknown')} (median {float(off.get('median_rel') or 0.0):.0%})"
    )
