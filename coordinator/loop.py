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

from coordinator import snapshot
from coordinator.autosize import CONFIG_VERSION, Autosize
from coordinator.decide import Action, decide, waits_for_idle
from coordinator.effects import Effects, clear_stale_explicit, load_failed
from residency import keys, policy_store, registry, work
from residency.box import Box, ConfigStore
from residency.loops import run_until_stopped
from residency.lua import Scripts
from residency.messages import Event, EventType
from residency.settings import Settings, SettingsError

log = logging.getLogger("residency.coordinator")

EVENT_WAIT_S = 0.5
PUBLISH_EVERY_S = 2.0
MAX_EVENTS_PER_PASS = 1000


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
        try:
            run_until_stopped(self.stop, self.iteration, log, "coordinator pass")
        finally:
            with contextlib.suppress(redis.RedisError):
                self.resign()
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
        """Block for the first event (bounded), then take every event already queued: a burst of
        changes costs one pass."""
        first = self.r.blpop([keys.events()], timeout=wait_s)
        if first is None:
            return []
        raws = [str(first[1])]
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
        """One pass. Re-plans until nothing changes, so a decision that frees a slot and the
        load it enables happen in one call (bounded)."""
        self.passes += 1
        s = self.refresh_settings()
        for ev in events or []:
            if ev.type is EventType.LOAD_FAILED:
                reason = str(ev.data.get("error", "unknown error"))
                n = work.fail_queued(self.r, ev.model, load_failed(ev.model, reason))
                log.error(
                    "load of %s failed (%s); answered %d queued request(s)", ev.model, reason, n
                )
        actions: list[Action] = []
        for _ in range(4):
            rd = snapshot.read(self.r, s, self.clock())
            clear_stale_explicit(self.r, rd.snap)
            actions = decide(rd.snap)
            if not self.effects.apply(actions, rd.snap, rd.model_hashes, s):
                break
        self.effects.watch_idle(waits_for_idle(actions, rd.snap))
        self.tell_autosize(rd.autosize)
        self.publish(snapshot.health_record(rd, s))
        return actions

    def publish(self, record: dict[str, object]) -> None:
        body = json.dumps({k: v for k, v in record.items() if k != "published_at"}, sort_keys=True)
        now = self.clock()
        if body == self._last_record and now - self._last_publish < PUBLISH_EVERY_S:
            return
        gen = int(self.r.incr(keys.generation()))
        record["generation"] = gen
        if self.scripts.publish_health(gen, record):
            self._last_record = body
            self._last_publish = now


def main(box: Box, stop: threading.Event) -> None:
    Coordinator(box, box.redis(), stop=stop).run()
