"""Quotas: what one user, and one API key, may ask of the box — requests per minute, requests
in flight, tokens and load-seconds per day.

A request must fit the quotas of its user and of its key. All of them are checked, and the
places the request takes (one in its minute's window, one in flight) are taken, in one Lua
script (``admit.lua``) in Redis, so the web processes together never admit one request over a
quota however many ask at once. The daily quotas are checked against totals that the model
processes count in the same steps that count usage (``finish.lua``: tokens; ``commit_load.lua``:
the load time charged to the user whose request caused the load).

A refusal is 429 ``quota_exceeded`` with ``Retry-After``: until the window frees a place, one
of the requests in flight ends (about one request's time in its slot), or the UTC day ends.
Anonymous callers, and users and keys without quotas, cost no Redis round trip here.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass

import redis
from flask import g

from residency import keys
from residency.auth import ANONYMOUS, Principal, Quotas
from residency.errors import ApiError
from residency.lua import Scripts

log = logging.getLogger(__name__)

#: Bounds of the Retry-After of a refusal by a window or by the requests in flight.
MIN_RETRY_S = 1
MAX_RETRY_S = 60
DAY_S = 86400


def principal() -> Principal:
    """The caller of the request being served (anonymous until the auth layer set one)."""
    p = g.get("principal", ANONYMOUS)
    return p if isinstance(p, Principal) else ANONYMOUS


def subjects(p: Principal) -> list[tuple[str, str, Quotas]]:
    """(``user`` / ``key``, name, quotas) of each part of ``p`` that has quotas: the user's
    under its subject (``user:<name>``, the name its usage is counted under), the key's under
    its id."""
    out: list[tuple[str, str, Quotas]] = []
    if p.kind == "user" and p.user_quotas.any():
        out.append(("user", p.subject, p.user_quotas))
    if p.key_id and p.key_quotas.any():
        out.append(("key", p.key_id, p.key_quotas))
    return out


@dataclass(frozen=True)
class Ticket:
    """One admitted request's places in flight, given back when the web tier finishes it."""

    id: str
    held: tuple[str, ...]  # the in-flight sets it holds a place in

    def release(self, r: redis.Redis) -> None:
        if not self.held:
            return
        try:
            pipe = r.pipeline(transaction=False)
            for key in self.held:
                pipe.zrem(key, self.id)
            pipe.execute()
        except redis.RedisError:
            # Its place expires at its deadline (the score it was added with).
            log.warning("could not give back the in-flight place of %s", self.id)


def day_of(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def admit(
    r: redis.Redis,
    scripts: Scripts,
    p: Principal,
    model: str,
    *,
    hold_s: float,
    may_load: bool = True,
    now: float | None = None,
) -> Ticket | None:
    """Admit one request of ``p`` for ``model`` (None: nothing to check), or raise the 429.
    ``hold_s``: the longest the request can last (its place in flight expires then, should this
    process die holding it); ``may_load``: ``model`` is local (its load can be caused)."""
    subs = subjects(p)
    if not subs:
        return None
    now = time.time() if now is None else now
    admission_id = uuid.uuid4().hex
    res = scripts.admit(
        model,
        admission_id,
        day=day_of(now),
        hold_s=hold_s,
        may_load=may_load,
        subjects=subs,
    )
    if not res:
        held = tuple(keys.quota_concurrent(s, n) for s, n, q in subs if q.concurrent is not None)
        return Ticket(admission_id, held)
    index, quota, limit, used, retry, state = res
    subject, name, _ = subs[int(index)]
    raise refusal(p, subject, name, quota, limit, used, retry, model, state, now)


def _who(p: Principal, subject: str, name: str) -> str:
    if subject == "key":
        return f"API key '{name}' of user '{p.name}'" if p.name else f"API key '{name}'"
    return f"user '{p.name}'"


def _num(text: str) -> str:
    return f"{float(text):g}"


def refusal(
    p: Principal,
    subject: str,
    name: str,
    quota: str,
    limit: str,
    used: str,
    retry: str,
    model: str,
    state: str,
    now: float,
) -> ApiError:
    """The 429 for a request refused by ``quota`` of ``subject`` ``name``: the message names
    the quota, its limit and when it resets."""
    who = _who(p, subject, name)
    if retry == "":
        wait = max(MIN_RETRY_S, math.ceil(DAY_S - now % DAY_S))
    else:
        wait = max(MIN_RETRY_S, min(MAX_RETRY_S, math.ceil(float(retry))))
    if quota == "requests_per_minute":
        msg = f"{who} reached its quota of {limit} requests per minute; it resets in {wait} s"
    elif quota == "concurrent":
        msg = (
            f"{who} reached its quota of {limit} concurrent requests; retry in {wait} s, when "
            "one of them has ended"
        )
    elif quota == "tokens_per_day":
        msg = (
            f"{who} reached its quota of {limit} tokens per day ({_num(used)} used today); it "
            f"resets at 00:00 UTC, in {wait} s"
        )
    else:
        msg = (
            f"{who} reached its quota of {_num(limit)} load-seconds per day "
            f"({float(used):.1f} used today) and model '{model}' is not loaded (it is {state}): "
            "a request that would load a model is refused until the quota resets at 00:00 UTC, "
            f"in {wait} s; models already loaded still serve it"
        )
    return ApiError(429, msg, type="rate_limit_error", code="quota_exceeded", retry_after=wait)
