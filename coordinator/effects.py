"""Carry out the decisions of ``residency.pool.decide`` against Redis.

Each effect is one Lua script (state change and the command it implies commit together),
fenced by the leader lease token; logging and metrics follow the commit. Every other write of
the leader (explicit wishes, the idle watch, counters) goes through a fenced batch
(``Scripts.fenced``). A refused write raises ``NotLeader``, which ends the pass: a deposed
leader applies nothing more.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import redis

from coordinator import failures
from residency import errors, keys, metrics, registry, tracing, work
from residency.lua import Fenced, NotLeader, Scripts
from residency.messages import Request
from residency.pool.decide import (
    Action,
    Backoff,
    Blocked,
    Evict,
    Load,
    Reap,
    Reject,
    Resume,
    Snapshot,
    Wait,
    Yield,
)
from residency.settings import Settings
from residency.states import ModelState

log = logging.getLogger("residency.coordinator")


class Effects:
    def __init__(
        self, r: redis.Redis, scripts: Scripts, lease_token: str, models_dir: Path | None = None
    ) -> None:
        self.r = r
        self.models_dir = models_dir  # the box's DATA_DIR/models (admin models may lie there)
        self.scripts = scripts
        self.lease_token = lease_token
        self._last_waits: dict[str, str] = {}
        # Generation of the limits the current pass enforces: sent with every load it starts,
        # so the load's commit can tell whether the limits changed while it loaded.
        self.limits_generation = 0
        # The last evictions started, as (pass number, model, reason): what a pass did, for
        # logs and tests (bounded).
        self.evictions: deque[tuple[int, str, str]] = deque(maxlen=100)
        self.pass_number = 0
        self.tracing = tracing.setup("coordinator")

    def apply(
        self,
        actions: Iterable[Action],
        snap: Snapshot,
        model_hashes: dict[str, dict[str, str]],
        s: Settings,
    ) -> int:
        """Returns how many actions changed something (so the caller can re-read and re-plan)."""
        changed = 0
        waits: dict[str, str] = {}
        for a in actions:
            if isinstance(a, Wait):
                waits[a.model] = a.reason
                continue
            if isinstance(a, Blocked):
                waits[f"{a.type} pool"] = f"{a.over} over the limit, shrink waits for busy models"
                continue
            try:
                changed += self._apply_one(a, snap, model_hashes, s)
            except (redis.RedisError, NotLeader):
                raise
            except Exception:
                # One bad action (a registry entry that vanished…) must not stop the others.
                log.exception("action %s failed", a)
        for model, reason in waits.items():
            if self._last_waits.get(model) != reason:
                log.info("%s waits: %s", model, reason)
        self._last_waits = waits
        return changed

    def _apply_one(
        self, a: Action, snap: Snapshot, model_hashes: dict[str, dict[str, str]], s: Settings
    ) -> int:
        if isinstance(a, Load):
            return self.load(a, s, snap.models[a.model].pool)
        if isinstance(a, Evict):
            loaded_at = model_hashes.get(a.model, {}).get("loaded_at")
            return self.evict(a, snap.now, float(loaded_at) if loaded_at else None)
        if isinstance(a, Reject):
            if a.code == "too_large":
                err = errors.model_too_large(a.model, a.need, a.largest)
            elif a.code == "memory_pinned":
                err = errors.memory_pinned(a.model, a.need)
            else:
                err = errors.slots_pinned(a.model, snap.models[a.model].type)
            n = work.fail_queued(self.r, a.model, err, lease=self.lease_token)
            self.fenced().hdel(keys.explicit(), a.model).execute()
            log.warning("rejected %d request(s) for %s: %s", n, a.model, a.code)
            return 0
        if isinstance(a, Reap):
            return self.reap(a, snap.models[a.model].state, snap.now)
        if isinstance(a, Yield):
            return self.yield_slot(a, snap.now)
        if isinstance(a, Resume):
            return self.resume(a)
        if isinstance(a, Backoff):
            err = failures.load_backoff(
                a.model, until=a.until, now=snap.now, failures=a.failures, last_error=a.last_error
            )
            n = work.fail_queued(self.r, a.model, err, lease=self.lease_token)
            self.fenced().hdel(keys.explicit(), a.model).execute()
            log.warning("answered %d request(s) for %s at once: in backoff", n, a.model)
            return 0
        return 0

    def fenced(self) -> Fenced:
        """A batch of plain writes, applied only while this leader's lease holds."""
        return self.scripts.fenced(self.lease_token)

    def watch_idle(self, on: bool) -> None:
        """Ask model processes for busy -> idle events only while a decision waits for one."""
        if on:
            self.fenced().set(keys.idle_watch(), "1", ex=keys.IDLE_WATCH_TTL_S).execute()
        else:
            self.fenced().delete(keys.idle_watch()).execute()

    def load(self, a: Load, s: Settings, pool: str) -> int:
        entry = registry.get(self.r, a.model)
        if entry is None:
            return 0
        token = uuid.uuid4().hex
        command = {
            "op": "load",
            "model": a.model,
            "token": token,
            "device": a.device,
            "spec": entry.spec.model_dump(),
            "fault_injection": s.debug.fault_injection,
            "grammar_budget_s": s.worker.grammar_budget_s,
            "slot_share_grace_s": s.worker.slot_share_grace_s,
            "model_dirs": registry.load_dirs(entry, self.models_dir, s),
            "limits_generation": self.limits_generation,
        }
        span = self._load_span(a) if self.tracing.on else None
        if span is not None:
            command["trace"] = tracing.traceparent(span)
        try:
            ok, prev = self.scripts.start_load(
                a.model,
                token=token,
                host=a.host,
                device=a.device,
                now=time.time(),
                command=command,
                lease=self.lease_token,
                pool=pool,
            )
        finally:
            if span is not None:
                span.end()
        if prev == "not_leader":
            raise NotLeader(f"load of {a.model} refused")
        if not ok:
            log.info("load of %s not started: state is %s", a.model, prev)
            return 0
        self.fenced().hdel(keys.explicit(), a.model).execute()
        log.info("loading %s on %s/%s", a.model, a.host, a.device)
        return 1

    def _load_span(self, a: Load) -> tracing.Span:
        """The decision's span, in the trace of the request the load is started for: the next
        one its queue serves, which ``start_load.lua`` charges the load to (read once more
        here, only when tracing is on; a request taken in between leaves the load a trace of
        its own). The command carries its context to the agent."""
        head = self.r.lindex(keys.queue(a.model), -1)
        cause = ""
        if head is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                cause = Request.loads(str(head)).trace
        return self.tracing.start(
            "load decision",
            parent=cause,
            attributes={
                "residency.model": a.model,
                "residency.host": a.host,
                "residency.device": a.device,
            },
        )

    def evict(self, a: Evict, now: float, loaded_at: float | None) -> int:
        res = self.scripts.begin_drain(
            a.model,
            token=a.token,
            control={"op": "unload", "token": a.token, "reason": a.reason},
            now=now,
            lease=self.lease_token,
        )
        if res == "not_leader":
            raise NotLeader(f"eviction of {a.model} refused")
        if res != "ok":
            log.info("eviction of %s (%s) refused: %s", a.model, a.reason, res)
            return 0
        pipe = self.fenced()
        if a.reason == "admin":
            pipe.hdel(keys.explicit(), a.model)
        metrics.inc(pipe, metrics.EVICTIONS_TOTAL, {"reason": a.reason})
        if loaded_at is not None:
            metrics.observe(pipe, metrics.AGE_AT_EVICTION, {"model": a.model}, now - loaded_at)
        pipe.execute()
        self._wake(a.model)
        self.evictions.append((self.pass_number, a.model, a.reason))
        log.info("evicting %s (%s)", a.model, a.reason)
        return 1

    def yield_slot(self, a: Yield, now: float) -> int:
        """Mark the model yielding (for whom, since when) and wake its process, so it stops
        taking requests within one wait. The mark outlives its unload until its next load
        (``start_load.lua`` clears it): the slot it gives goes to ``for_model`` first."""
        pipe = self.fenced()
        pipe.hset(keys.model(a.model), mapping={"yielding": a.for_model, "yielding_since": now})
        metrics.inc(pipe, metrics.YIELDS_TOTAL, {"model": a.model})
        pipe.execute()
        self._wake(a.model)
        log.info("%s yields its slot to %s, which waited pool.max_busy_s", a.model, a.for_model)
        return 1

    def resume(self, a: Resume) -> int:
        """Call a yield off: the model takes requests again (woken now, not after its wait)."""
        self.fenced().hdel(keys.model(a.model), "yielding", "yielding_since").execute()
        self._wake(a.model)
        log.info("%s takes requests again: nobody waits for its slot any more", a.model)
        return 1

    def _wake(self, model: str) -> None:
        """Unblock the model process's queue read (its ``reader`` connection), so it sees the
        unload now instead of at the end of its idle wait. Only latency rides on it: a failed
        wake-up leaves the unload to that wait's end."""
        with contextlib.suppress(redis.RedisError, ValueError):
            reader = self.r.hget(keys.model(model), "reader")
            if reader:
                self.r.client_unblock(int(str(reader)))

    def reap(self, a: Reap, state: ModelState, now: float) -> int:
        dst = ModelState.FAILED if state is ModelState.LOADING else ModelState.UNLOADED
        ok, _ = self.scripts.transition(
            a.model,
            dst,
            token=a.token,
            fields={
                "error": a.reason,
                "pid": None,
                "host": None,
                "device": None,
                "draining_since": None,
            },
            lease=self.lease_token,
        )
        if not ok:
            return 0
        work.hand_back(self.r, self.scripts, a.model, a.reason, lease=self.lease_token)
        if dst is ModelState.FAILED:
            failures.record(self.r, a.model, a.token, a.reason, now, lease=self.lease_token)
            work.fail_queued(
                self.r, a.model, failures.load_failed(a.model, a.reason), lease=self.lease_token
            )
        log.warning("reaped %s: %s", a.model, a.reason)
        return 1


def clear_stale_explicit(scripts: Scripts, snap: Snapshot, *, lease: str) -> None:
    """Drop explicit load/unload requests that are already true (or whose model is gone);
    fenced by the leader's ``lease``."""
    stale = [
        name
        for name, m in snap.models.items()
        if (m.explicit == "load" and m.occupying)
        or (m.explicit == "unload" and not m.occupying)
        or (m.explicit and not m.registered)
    ]
    if stale:
        scripts.fenced(lease).hdel(keys.explicit(), *stale).execute()
