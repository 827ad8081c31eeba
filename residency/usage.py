"""Usage reports: what each user used of each model on each UTC day, read from the day hashes
the model processes count in (``keys.usage(day)``), and the table ``residency usage`` prints.

``report`` reads one day hash per day of the range (pipelined: one round trip) and sums them
per user, per model and per day; ``parse_range`` checks a query's dates (the web tier answers
400 naming the bad parameter). Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

import redis

from residency import keys
from residency.auth import subject_label

#: The counters of a usage row, in the order of the table's columns.
COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "load_seconds")
#: The most days one report covers: as long as the day hashes are kept.
MAX_DAYS = keys.USAGE_TTL_S // 86400


class RangeError(ValueError):
    """A bad query: ``param`` names the parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _day(text: str, param: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise RangeError(param, f"'{param}' must be a date YYYY-MM-DD, got {text!r}") from None


@dataclass(frozen=True)
class Range:
    first: date
    last: date

    def days(self) -> list[str]:
        n = (self.last - self.first).days
        return [(self.first + timedelta(days=i)).isoformat() for i in range(n + 1)]


def parse_range(first: str | None, last: str | None, today: date) -> Range:
    """The days ``from``..``to`` (both included; default: today, and ``from`` = ``to``)."""
    end = _day(last, "to") if last else today
    start = _day(first, "from") if first else end
    if start > end:
        raise RangeError("from", f"'from' ({start}) is after 'to' ({end})")
    if (end - start).days + 1 > MAX_DAYS:
        raise RangeError("from", f"a report covers at most {MAX_DAYS} days (usage is kept so long)")
    return Range(start, end)


def _zero() -> dict[str, float]:
    return dict.fromkeys(COUNTERS, 0)


def _add(into: dict[str, float], counter: str, value: float) -> None:
    into[counter] = into.get(counter, 0) + value


def _finish(totals: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {
        k: (round(v, 3) if k == "load_seconds" else int(v)) for k, v in totals.items()
    }
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def summarize(
    days: Iterable[tuple[str, dict[str, str]]], user: str | None = None, model: str | None = None
) -> dict[str, Any]:
    """Totals of the day hashes ``days`` ((day, hash) each), optionally of one ``user`` and one
    ``model``: in all, per user, per model, per day, and one row per (day, user, model). Users
    are shown (and ``user`` given) as ``residency.auth.subject_label`` writes them: a user's
    name, ``admin:<name>`` for an admin token, ``-`` for anonymous callers."""
    total = _zero()
    users: dict[str, dict[str, float]] = {}
    models: dict[str, dict[str, float]] = {}
    per_day: dict[str, dict[str, float]] = {}
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    for day, fields in days:
        per_day.setdefault(day, _zero())
        for field, raw in fields.items():
            # Names never hold '|' (users, models), so the last two parts are model and counter.
            subject, _, rest = field.partition("|")
            u = subject_label(subject)
            m, _, counter = rest.rpartition("|")
            if counter not in COUNTERS or not m:
                continue
            if (user is not None and u != user) or (model is not None and m != model):
                continue
            value = float(raw)
            for bucket in (
                total,
                users.setdefault(u, _zero()),
                models.setdefault(m, _zero()),
                per_day[day],
                rows.setdefault((day, u, m), _zero()),
            ):
                _add(bucket, counter, value)
    return {
        "total": _finish(total),
        "users": {k: _finish(v) for k, v in sorted(users.items())},
        "models": {k: _finish(v) for k, v in sorted(models.items())},
        "days": {k: _finish(v) for k, v in sorted(per_day.items())},
        "rows": [
            {"day": d, "user": u, "model": m, **_finish(v)} for (d, u, m), v in sorted(rows.items())
        ],
    }


def report(
    r: redis.Redis, span: Range, user: str | None = None, model: str | None = None
) -> dict[str, Any]:
    """The usage of ``span`` (see ``summarize``), read in one round trip."""
    days = span.days()
    pipe = r.pipeline(transaction=False)
    for d in days:
        pipe.hgetall(keys.usage(d))
    hashes = pipe.execute()
    out = summarize(zip(days, hashes, strict=True), user, model)
    return {"from": days[0], "to": days[-1], "user": user, "model": model, **out}


def render(rep: dict[str, Any]) -> str:
    """A report as the table ``residency usage`` prints: one line per day, user and model, then
    the totals."""
    cols = ["day", "user", "model", "requests", "prompt", "completion", "load s"]

    def cells(row: dict[str, Any]) -> list[str]:
        return [
            str(row["requests"]),
            str(row["prompt_tokens"]),
            str(row["completion_tokens"]),
            f"{row['load_seconds']:.1f}",
        ]

    rows = [[x["day"], x["user"], x["model"], *cells(x)] for x in rep["rows"]]
    rows.append(["total", "", "", *cells(rep["total"])])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def line(values: list[str]) -> str:
        # Names to the left, numbers to the right.
        return "  ".join(
            v.ljust(w) if i < 3 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return "\n".join([line(cols), *(line(r) for r in rows)])
