"""Model failures, recorded in one place (the coordinator leader): a failed load (the model
process's or agent's ``load_failed`` event, or the reaper giving up on a ``loading`` model). A
process that dies after its load (a ``gone`` event, even one marked ``crashed``) is no failure
of the model: an out-of-memory kill or an operator's SIGKILL says nothing about whether it loads,
and a request that keeps crashing it is refused by its own attempt count
(``residency.work.MAX_CRASHES``); counting those deaths put healthy models in backoff. A model
with
``keys.LOAD_FAILURE_LIMIT`` failures within ``keys.LOAD_FAILURE_WINDOW_S`` is in backoff: the
pure decision (``residency.pool.decide.backoff_until``) answers its requests at once with the last
cause instead of loading it again, until the window frees a slot or an admin loads it
explicitly (which deletes the window)."""

from __future__ import annotations

import json
import logging
import math
from typing import cast

import redis

from residency import errors, keys, work
from residency.lua import Scripts
from residency.states import ModelState

log = logging.getLogger("residency.coordinator")


def load_failed(model: str, reason: str) -> errors.ApiError:
    return errors.ApiError(
        500,
        f"model '{model}' failed to load: {reason}",
        type="server_error",
        code="model_load_failed",
    )


def load_backoff(
    model: str, *, until: float, now: float, failures: int, last_error: str
) -> errors.ApiError:
    """503 for a request to a model in a crash loop: names the last cause, and Retry-After is
    when the window frees a slot (an admin load clears it sooner)."""
    wait = max(1, math.ceil(until - now))
    return errors.ApiError(
        503,
        f"model '{model}' failed {failures} times in the last "
        f"{keys.LOAD_FAILURE_WINDOW_S // 60} minutes (last: {last_error}); not loading it again "
        f"for {wait} s (POST /admin/models/{model}/load retries now)",
        type="server_error",
        code="model_load_backoff",
        retry_after=wait,
    )


def record(r: redis.Redis, model: str, token: str, error: str, now: float, *, lease: str) -> str:
    """Add one failure to the model's window: 'ok' or 'duplicate' (this load token's failure is
    already counted). A deposed leader records nothing: NotLeader."""
    member = json.dumps({"token": token, "error": error[:500], "at": now}, sort_keys=True)
    return Scripts(r).record_failure(
        model,
        token=token,
        member=member,
        now=now,
        window=keys.LOAD_FAILURE_WINDOW_S,
        lease=lease,
    )


def settle(r: redis.Redis, model: str, token: str, reason: str, now: float, *, lease: str) -> None:
    """Settle a failed load once: count it, and answer the requests queued for it with its
    cause. Whichever comes first settles — the load's ``load_failed`` event, or a pass that finds
    the model ``failed`` without the ``failure_seen`` mark (every pass settles such models before
    it decides, so no new load can start for a failure nobody has answered) — and the other
    only finds it counted. Requests queued after that are the next load's. Nothing is answered
    when a newer load already took the model (the event may arrive after one started)."""
    state, cur, seen = cast(
        list[str | None], r.hmget(keys.model(model), ["state", "token", "failure_seen"])
    )
    record(r, model, token, reason, now, lease=lease)
    if state != ModelState.FAILED.value or (token and cur != token) or seen == cur:
        log.info("load of %s failed (%s); already settled or superseded (%s)", model, reason, state)
        return
    n = work.fail_queued(r, model, load_failed(model, reason), lease=lease)
    log.error("load of %s failed (%s); answered %d queued request(s)", model, reason, n)
