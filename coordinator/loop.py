"""The coordinator: one leader (by Redis lease) runs one loop — events → snapshot → decide →
effects → publish. Standbys wait for the lease. Nothing sleeps on a request path: the loop only
ever waits on its event list (with a timeout) or on the stop event."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import cast

import redis

from coordinator import retry, snapshot
from coordinator.autosize import CONFIG_VERSION, Autosize
from coordinator.decide import Action, Blocked, decide, waits_for_idle
from coordinator.effects import Effects, clear_stale_explicit, load_failed
from residency import keys, metrics, policy_store, registry, work
from residency.box import Box, ConfigStore
from residency.loops import Waker, run_until_stopped
from residency.lua import Scripts
from residency.messages import Event, EventType
from residency.settings import Settings, SettingsError

log = logging.getLogger("residency.coordinator")

EVENT_WAIT_S = 0.5
PUBLISH_EVERY_S = 2.0
MAX_EVENTS_PER_PASS = 1000
# A pass woken by admin changes alone waits for a short quiet spell first, so a burst of changes
# sent back to back (a script, a config tool) costs one pass instead of one per change: each
# further change extends the wait by COALESCE_QUIET_S, never past COALESCE_MAX_S in all.
COALESCE_QUIET_S = 0.1
COALESCE_MAX_S = 0.5


class Coordinator:
    def __init__(
        self,
        box: Box,
        r: redis.Redis,
        *,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.box = box
        self.r = r
        self.stop = stop or threading.Event()
        self.clock = clock
        self.scripts = Scripts(r)
        self.rq = retry.connection(r)
        self.config = ConfigStore(box, r)
        self.lease_token = uuid.uuid4().hex
        self.effects = Effects(r, self.scripts, self.lease_token)
        self.is_leader = False
        self.settings: Settings = box.base_settings()
        self.passes = 0
        self._starting = False
        self._fresh_data = False
        self._risky = False
        self._unresolved: tuple[tuple[str, str], ...] = ()
        self._last_record: str | None = None
        self._last_publish = 0.0
        self._deferred = True  # until a pass says otherwise (a job may survive a restart)
        self.waker: Waker | None = None

    # -- leadership -------------------------------------------------------------------------

    def try_lead(self) -> bool:
        if self.r.set(keys.leader(), self.lease_token, nx=True, px=keys.LEADER_TTL_MS):
            epoch = self.r.incr(keys.leader_epoch())
            self.is_leader = True
            log.info("coordinator %s is leader (epoch %s)", self.lease_token[:8], epoch)
            self.on_lead()
        return self.is_leader

    def on_lead(self) -> None:
        # The file's models and policies are (re)seeded by whoever leads, so every role sees
        # one registry.
        fresh = not self.r.exists(keys.generation())
        base = self.box.base_settings()
        registry.seed_from_file(self.r, base.models)
        policy_store.seed_from_file(self.r, base.policies)
        self._starting = True
        self._fresh_data = fresh
        self.r.rpush(keys.events(), json.dumps(Event(EventType.CONFIG).to_dict()))

    def tell_autosize(self, a: Autosize) -> None:
        """Say what autosize does once, when it becomes true: an INFO line at start, a WARNING
        when the risky state (above max_loaded_models with no auto_evict) is entered, and a
        one-time notice on the first start after an upgrade into that state. The risky flag and
        the config version are kept in Redis, so restarts do not repeat them."""
        unresolved = tuple(a.floor.unresolved)
        if unresolved != self._unresolved:
            for policy, cand in unresolved:
                log.warning(
                    "policy %s: candidate %s is not a registered model; it still counts toward "
                    "the LLM candidate floor",
                    policy,
                    cand,
                )
            self._unresolved = unresolved
        if self._starting:
            self._starting = False
            if a.exceeds:
                log.info(
                    "LLM limit is %d: max_loaded_models=%d raised by llm_pool_autosize to the "
                    "%d local candidates of the router policies",
                    a.effective,
                    a.configured,
                    a.floor.floor,
                )
            stored = self.r.hget(keys.autosize_state(), "config_version")
            if int(str(stored or 0)) < CONFIG_VERSION:
                if a.risky and not self._fresh_data:
                    log.warning("upgrade notice: %s", a.advisory())
                self.r.hset(keys.autosize_state(), "config_version", CONFIG_VERSION)
            self._risky = self.r.hget(keys.autosize_state(), "risky") == "1"
        if a.risky != self._risky:
            if a.risky:
                log.warning("%s", a.advisory())
            else:
                log.info("LLM pool back within max_loaded_models (or auto_evict is on)")
            self.r.hset(keys.autosize_state(), "risky", "1" if a.risky else "0")
            self._risky = a.risky

    def renew(self) -> None:
        if self.is_leader and not self.scripts.lease(self.lease_token, "renew"):
            log.error("lost the leader lease; standing by")
            self.is_leader = False

    def resign(self) -> None:
        if self.is_leader:
            self.scripts.lease(self.lease_token, "release")
            self.is_leader = False

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        log.info("coordinator started")
        # The retry queue's worker lives and dies with this loop (same stop event).
        retries = threading.Thread(
            target=retry.run_worker, args=(self.rq, self.stop), name="retry-worker", daemon=True
        )
        retries.start()
        self.waker = Waker(self.r, self.stop)
        try:
            run_until_stopped(self.stop, self.iteration, log, "coordinator pass")
        finally:
            with contextlib.suppress(redis.RedisError):
                self.resign()
            retries.join(timeout=10)
            self.waker.close()
            log.info("coordinator stopped")

    def iteration(self) -> None:
        if not self.is_leader and not self.try_lead():
            self.stop.wait(1.0)  # standby: the lease is someone else's
            return
        events = self.collect_events(EVENT_WAIT_S)
        self.renew()
        if self.is_leader:
            self.step(events)

    def collect_events(self, wait_s: float) -> list[Event]:
        """Block for the first event (bounded), then take every event already queued, and while
        the pass would only handle admin changes, those that follow within a quiet spell
        (``coalesce_wait``): a burst of changes costs one pass."""
        # A stop unblocks these reads at once (see Waker).
        with self.waker.reading() if self.waker else contextlib.nullcontext(self.r) as blocking:
            first = blocking.blpop([keys.events()], timeout=wait_s)
            if first is None:
                return []
            events = self._take(str(first[1]))
            started = time.monotonic()
            while (wait := coalesce_wait(events, time.monotonic() - started)) > 0:
                nxt = blocking.blpop([keys.events()], timeout=wait)
                if nxt is None or self.stop.is_set():
                    break
                events += self._take(str(nxt[1]))
        return events

    def _take(self, first: str) -> list[Event]:
        """``first`` and every event queued behind it, parsed (a malformed one is dropped)."""
        raws = [first]
        more = cast(list[str] | None, self.r.lpop(keys.events(), MAX_EVENTS_PER_PASS))
        if more:
            raws += more
        events = []
        for raw in raws:
            try:
                events.append(Event.loads(raw))
            except (ValueError, KeyError):
                log.error("dropping malformed event %r", raw)
        return events

    def refresh_settings(self) -> Settings:
        try:
            self.settings, _ = self.config.load()
        except SettingsError as e:
            # Keep enforcing the last good settings rather than none.
            log.error("%s; keeping the previous settings", e)
        return self.settings

    def step(self, events: list[Event] | None = None) -> list[Action]:
        """One enforcement pass, stamped with a fresh generation. Every trigger queued before it
        started (config, policy, load commit, busy -> idle, retry) is handled by this one pass;
        one that arrives while it runs is still in the inbox, so the loop runs again at once —
        a burst of changes costs a few passes, and the last pass sees the last change. Re-plans
        until nothing changes (bounded), so a pool shrinks all the way in one pass and a freed
        slot's load starts in the same pass."""
        events = events or []
        trigger = _trigger(events)
        pipe = self.r.pipeline(transaction=False)
        pipe.incr(keys.generation())
        metrics.inc(pipe, metrics.PASSES_TOTAL, {"trigger": trigger})
        gen = int(pipe.execute()[0])
        self.passes += 1
        self.effects.pass_number = self.passes
        s = self.refresh_settings()
        for ev in events:
            if ev.type is EventType.LOAD_FAILED:
                reason = str(ev.data.get("error", "unknown error"))
                n = work.fail_queued(self.r, ev.model, load_failed(ev.model, reason))
                log.error(
                    "load of %s failed (%s); answered %d queued request(s)", ev.model, reason, n
                )
            elif ev.type is EventType.READY and ev.data.get("recheck"):
                log.info("%s loaded after the limits changed: re-checking the pool", ev.model)
        actions: list[Action] = []
        for i in range(4):
            rd = snapshot.read(self.r, s, self.clock())
            if i == 0 and not self.sync_limits(gen, rd):
                return []  # not the leader any more: a deposed pass applies nothing
            clear_stale_explicit(self.r, rd.snap)
            actions = decide(rd.snap)
            if not self.effects.apply(actions, rd.snap, rd.model_hashes, s):
                break
        self.effects.watch_idle(waits_for_idle(actions, rd.snap))
        blocked = {a.type: a.over for a in actions if isinstance(a, Blocked)}
        self.tell_autosize(rd.autosize)
        enforcement = {
            "pass": self.passes,
            "trigger": trigger,
            "blocked": blocked,
            "deferred": bool(blocked),
        }
        self.publish(gen, snapshot.health_record(rd, s, enforcement), force=bool(events))
        # After publishing: the retry job reads the published record to know whether the pool
        # is still blocked.
        self.track_deferral(blocked)
        return actions

    def sync_limits(self, gen: int, rd: snapshot.Read) -> bool:
        """Record the limits this pass enforces (stamped with ``gen`` when they changed); loads
        started by this pass carry that generation, and their commit re-checks it."""
        res = self.scripts.publish_limits(gen, rd.snap.limits, lease=self.lease_token)
        if res == "not_leader":
            log.error("lost the leader lease during a pass; standing by")
            self.is_leader = False
            return False
        if res != "stale":
            self.effects.limits_generation = int(res)
        return True

    def track_deferral(self, blocked: dict[str, int]) -> None:
        """Rule 4: a shrink that only busy (or pinned) residents block is retried with backoff
        on the rq retry queue, besides being re-armed by their busy -> idle edge; the job goes
        as soon as a pass finds every pool within its limit."""
        if blocked:
            retry.defer(self.rq, blocked)
        elif self._deferred and retry.settle(self.rq):
            log.info("deferred shrink done: every pool is within its limit")
        self._deferred = bool(blocked)

    def publish(self, gen: int, record: dict[str, object], *, force: bool = False) -> None:
        """Publish the pass's record under its generation. A pass with no trigger and nothing
        new publishes at most every PUBLISH_EVERY_S (a heartbeat of the record)."""
        body = json.dumps(
            {k: v for k, v in record.items() if k not in ("published_at", "enforcement")},
            sort_keys=True,
        )
        now = self.clock()
        if not force and body == self._last_record and now - self._last_publish < PUBLISH_EVERY_S:
            return
        record["generation"] = gen
        res = self.scripts.publish_health(gen, record, lease=self.lease_token)
        if res == "ok":
            self._last_record = body
            self._last_publish = now
        else:
            log.info("record of pass %d not published: %s", gen, res)


def coalesce_wait(events: list[Event], waited: float) -> float:
    """How much longer to collect events before a pass: only a pass that admin changes alone
    would run waits (demand, load commits, busy -> idle edges and retries run at once)."""
    if not events or any(e.type is not EventType.CONFIG for e in events):
        return 0.0
    return max(0.0, min(COALESCE_QUIET_S, COALESCE_MAX_S - waited))


def _trigger(events: list[Event]) -> str:
    """What woke a pass, for the passes metric: the most specific trigger among its events."""
    kinds = {e.type for e in events}
    for kind, label in (
        (EventType.CONFIG, "config"),
        (EventType.RETRY, "retry"),
        (EventType.IDLE, "idle"),
        (EventType.READY, "load_commit"),
    ):
        if kind in kinds:
            return label
    return "event" if events else "timer"


def main(box: Box, stop: threading.Event) -> None:
    Coordinator(box, box.redis(), stop=stop).run()
