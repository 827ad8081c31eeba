"""Quotas: what one user, and one API key, may ask of the box — requests per minute, requests
in flight, tokens and load-seconds per day.

A request must fit the quotas of its user and of its key. All of them are checked, and what
the request takes (a place in its minute's window, a place in flight, a reservation of the
tokens it may use) is taken, in one Lua script (``admit.lua``) in Redis, so however many ask at
once across the web processes:

- ``requests_per_minute`` and ``concurrent`` never admit one request over the quota;
- ``tokens_per_day`` admits a request while the day's charged tokens plus the reservations of
  the requests in flight are below the quota, and the request then reserves the most it may
  use (``reservation``: its prompt counted as one token per byte, plus its ``max_tokens`` as
  capped for its model), so the day ends at most one request over the quota (the last one
  admitted; plus what a routing helper of a request generated, and any request whose prompt
  took more tokens than it has bytes). A request is admitted when any tokens are left rather
  than having its ``max_tokens`` cut to what is left: its answer is never truncated by the
  quota. The reservation is given back when the request ends (``release.lua``), after its
  real usage was charged (``finish.lua`` writes the last reply in the step that charges it;
  a remote's usage is charged by web, ``charge``); a web process that dies holding one leaks
  it only until the UTC day ends (it lives in that day's hash). A request web abandons while
  it generates (its client gone, its timeout) gives its reservation back at once and is
  charged what it used when its model process stops it, at its next token. A request still
  running at 00:00 UTC is charged to the new day, unreserved there;
- ``load_seconds_per_day`` refuses a request that would load a model once the day's load time
  charged to the user (``commit_load.lua``: the user whose request caused the load) reached it.

A refusal is 429 ``quota_exceeded`` with ``Retry-After``: until the window frees a place, one
of the requests in flight ends (about one request's time in its slot), or the UTC day ends.
Anonymous callers, and users and keys without quotas, cost no Redis round trip here.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from flask import g

from residency import keys
from residency.auth import ANONYMOUS, Principal, Quotas
from residency.errors import ApiError
from residency.lua import Scripts
from residency.prompt_size import prompt_bytes

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
    """One admitted request's places in flight and token reservation, given back when the web
    tier finishes it."""

    id: str
    day: str  # the UTC day it was admitted on: its reservation lives in that day's totals
    held: tuple[str, ...]  # the in-flight sets it holds a place in
    reserved: tuple[str, ...] = field(default=())  # the reserved-tokens fields it added to

    def release(self, scripts: Scripts) -> None:
        if not self.held and not self.reserved:
            return
        try:
            scripts.release(
                self.id, day=self.day, held=list(self.held), reserved=list(self.reserved)
            )
        except redis.RedisError:
            # Its place expires at its deadline (the score it was added with), its reservation
            # with its day's totals.
            log.warning("could not give back the quota places of %s", self.id)


def day_of(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def reservation(params: Mapping[str, Any], max_tokens: int | None) -> int:
    """The most tokens one request may use: its prompt (``prompt_bytes``) and ``max_tokens``
    (as capped for its model; None for a request that generates nothing)."""
    return prompt_bytes(params) + max(0, max_tokens or 0)


def admit(
    r: redis.Redis,
    scripts: Scripts,
    p: Principal,
    model: str,
    *,
    hold_s: float,
    may_load: bool = True,
    reserve: int = 0,
    now: float | None = None,
) -> Ticket | None:
    """Admit one request of ``p`` for ``model`` (None: nothing to check), or raise the 429.
    ``hold_s``: the longest the request can last (its place in flight expires then, should this
    process die holding it); ``may_load``: ``model`` is local (its load can be caused);
    ``reserve``: the most tokens it may use (``reservation``), held against the
    tokens-per-day quotas until it is released."""
    subs = subjects(p)
    if not subs:
        return None
    now = time.time() if now is None else now
    admission_id = uuid.uuid4().hex
    day = day_of(now)
    res = scripts.admit(
        model,
        admission_id,
        day=day,
        hold_s=hold_s,
        may_load=may_load,
        subjects=subs,
        reserve=reserve,
    )
    if not res:
        held = tuple(keys.quota_concurrent(s, n) for s, n, q in subs if q.concurrent is not None)
        reserved = tuple(
            keys.quota_field("reserved", s, n)
            for s, n, q in subs
            if q.tokens_per_day is not None and reserve > 0
        )
        return Ticket(admission_id, day, held, reserved)
    index, quota, limit, used, retry, state, in_flight = res
    subject, name, _ = subs[int(index)]
    raise refusal(p, subject, name, quota, limit, used, retry, model, state, now, in_flight)


def admit_load(
    r: redis.Redis, scripts: Scripts, p: Principal, model: str, *, now: float | None = None
) -> None:
    """Check only the load-seconds quotas of ``p`` for the local ``model`` (429 when the
    request would load it past them): for a request admitted before its model was known (a
    policy's, admitted before its routing helpers ran). Takes nothing."""
    only = [
        (s, n, Quotas(load_seconds_per_day=q.load_seconds_per_day))
        for s, n, q in subjects(p)
        if q.load_seconds_per_day is not None
    ]
    if not only:
        return
    now = time.time() if now is None else now
    res = scripts.admit(
        model, uuid.uuid4().hex, day=day_of(now), hold_s=0, may_load=True, subjects=only
    )
    if res:
        index, quota, limit, used, retry, state, in_flight = res
        subject, name, _ = only[int(index)]
        raise refusal(p, subject, name, quota, limit, used, retry, model, state, now, in_flight)


def charge(
    scripts: Scripts, p: Principal, model: str, usage: tuple[int, int], now: float | None = None
) -> None:
    """Count what a request of ``p`` used of the remote ``model`` (no model process counts
    it): its usage and its user's and key's tokens of the day, as a local model's finish does."""
    try:
        scripts.charge(
            model,
            user=p.user or "",
            key=p.key_id or "",
            usage=usage,
            now=time.time() if now is None else now,
        )
    except redis.RedisError:
        log.warning("could not count the usage of a request to remote model %s", model)


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
    in_flight: str = "0",
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
    elif quota == "tokens_per_day" and retry != "":
        msg = (
            f"{who} reached its quota of {limit} tokens per day with its requests in flight "
            f"({_num(used)} used today, {_num(in_flight)} reserved by them); retry in {wait} s, "
            "when one of them has ended and given back what it did not use"
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
