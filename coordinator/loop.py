"""The coordinator: one leader (by Redis lease) runs one loop — events → snapshot → decide →
effects → publish. Standbys wait for the lease. Nothing sleeps on a request path: the loop only
ever waits on its event list (with a timeout) or on the stop event.

Leadership: a coordinator takes the lease (``acquire.lua``: SET NX PX and the epoch INCR in one
step) with a fresh token per term; its own thread renews it every third of the TTL, so a long
pass or a blocking read never lets it lapse. Every write the leader makes — each effect's
script, the plain writes of a pass (``Scripts.fenced``), the retry queue's MULTI — checks that
token inside Redis, so a leader that was paused past the TTL and wakes up changes nothing: its
first refused write raises ``NotLeader`` and it stands by. A standby polls for the free lease
every ``STANDBY_POLL_S``, so it leads within the TTL of the leader's last renewal plus one
poll."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, cast

import redis

from coordinator import failures, prune, retry
from coordinator.effects import Effects, clear_stale_explicit
from residency import keys, metrics, policy_store, registry, route_stats
from residency.box import Box, ConfigStore
from residency.loops import Waker, blmove, run_until_stopped
from residency.lua import Fenced, NotLeader, Scripts
from residency.messages import Event, EventType
from residency.pool import route_room, snapshot
from residency.pool.autosize import CONFIG_VERSION, Autosize
from residency.pool.decide import Action, Blocked, Snapshot, decide, forgettable, waits_for_idle
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
#: The lease's heartbeat: three renewals per TTL, so one slow renewal never lets it lapse.
RENEW_EVERY_S = keys.LEADER_TTL_MS / 1000 / 3
#: How often a standby tries to take a free lease: the takeover's margin over the TTL.
STANDBY_POLL_S = 0.25
#: How often the router policies' samples and choices are read into the health record's
#: ``routing`` (up to ``keys.ROUTE_SAMPLES_MAX`` samples a policy: not on every pass).
ROUTE_STATS_EVERY_S = 10.0


class _SeedClient:
    """What seeding the registry and policies needs of a client: reads go to Redis, writes into
    batches fenced by the leader's lease (the seeding code queues its writes on ``pipeline()``).
    Any other command is an AttributeError, so no write can slip past the fence unnoticed."""

    def __init__(self, r: redis.Redis, fenced: Callable[[], Fenced]) -> None:
        self._r = r
        self._fenced = fenced

    def hgetall(self, name: str) -> object:
        return self._r.hgetall(name)

    def hget(self, name: str, key: str) -> object:
        return self._r.hget(name, key)

    def scan_iter(self, **kwargs: object) -> object:
        return self._r.scan_iter(**kwargs)  # type: ignore[arg-type]

    def pipeline(self, transaction: bool = True) -> Fenced:
        return self._fenced()

    def sadd(self, name: str, *values: object) -> int:
        return int(self._fenced().sadd(name, *values).execute()[0])


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
        self.lease_token = uuid.uuid4().hex  # a fresh one each term (try_lead)
        self.effects = Effects(r, self.scripts, self.lease_token, box.models_dir)
        self.is_leader = False
        self.epoch = 0  # of the current (or last) term
        self.leader_since: float | None = None
        # /health names the leader by host and pid (two coordinators in one process — tests —
        # are told apart by the epoch).
        self.ident = f"{socket.gethostname()}:{os.getpid()}"
        # A lease token names its holder's host, pid namespace and pid (``uuid@host/ns/pid``):
        # a standby that shares both with a holder that has died (SIGKILL, out of memory) takes
        # over at once instead of waiting out the TTL. Elsewhere the TTL is the only signal.
        self._where = f"{socket.gethostname()}/{_pid_namespace()}"
        self._lease_lock = threading.Lock()
        self.settings: Settings = box.base_settings()
        self.passes = 0
        self._starting = False
        self._fresh_data = False
        self._risky = False
        self._unresolved: tuple[tuple[str, str], ...] = ()
        self._last_record: str | None = None
        self._last_publish = 0.0
        self._settings_error = ""  # the last settings problem logged
        self._deferred = True  # until a pass says otherwise (a job may survive a restart)
        # The router policies' last statistics (route_stats), when they were read, and when
        # each policy's prediction error was last warned about.
        self._routing: dict[str, dict[str, Any]] = {}
        self._routing_at: float | None = None
        self._route_warned: dict[str, float] = {}
        self.waker: Waker | None = None

    # -- leadership -------------------------------------------------------------------------

    def try_lead(self) -> bool:
        """Take the lease if it is free, for a new term with a token of its own (so a pass left
        over from an earlier term of this same coordinator is refused too)."""
        token = f"{uuid.uuid4().hex}@{self._where}/{os.getpid()}"
        epoch = self.scripts.acquire(token)
        if not epoch:
            return self.is_leader
        with self._lease_lock:
            self.lease_token = token
            self.effects.lease_token = token
            self.epoch = epoch
            self.leader_since = self.clock()
            self.is_leader = True
        log.info("coordinator %s is leader (epoch %s)", self.ident, epoch)
        try:
            self.on_lead()
        except NotLeader:
            self.stand_by(token, "lost the leader lease while taking the lead")
        return self.is_leader

    def release_dead_holder(self) -> None:
        """Free the lease of a holder that provably died (see ``holder_dead``); the release is a
        compare-and-delete on its token, so a holder that renewed meanwhile keeps it."""
        holder = cast(str | None, self.r.get(keys.leader()))
        if (
            holder
            and holder_dead(holder, self._where, _alive)
            and self.scripts.lease(holder, "release")
        ):
            log.warning("the leader (%s) has died; taking over now", holder.partition("@")[2])

    def fenced(self) -> Fenced:
        """A batch of plain writes, applied only while this term's lease holds."""
        return self.scripts.fenced(self.lease_token)

    def on_lead(self) -> None:
        # The file's models and policies are (re)seeded by whoever leads, so every role sees
        # one registry; the seeding's writes are fenced like every other leader write.
        fresh = not self.r.exists(keys.generation())
        base = self.box.base_settings()
        seed = cast(redis.Redis, _SeedClient(self.r, self.fenced))
        registry.seed_from_file(seed, base.models)
        policy_store.seed_from_file(seed, base.policies)
        snapshot.adopt_model_keys(seed)
        self._starting = True
        self._fresh_data = fresh
        self.fenced().rpush(keys.events(), json.dumps(Event(EventType.CONFIG).to_dict())).execute()

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
                self.fenced().hset(
                    keys.autosize_state(), "config_version", CONFIG_VERSION
                ).execute()
            self._risky = self.r.hget(keys.autosize_state(), "risky") == "1"
        if a.risky != self._risky:
            if a.risky:
                log.warning("%s", a.advisory())
            else:
                log.info("LLM pool back within max_loaded_models (or auto_evict is on)")
            risky = "1" if a.risky else "0"
            self.fenced().hset(keys.autosize_state(), "risky", risky).execute()
            self._risky = a.risky

    def renew(self) -> None:
        with self._lease_lock:
            token, leading = self.lease_token, self.is_leader
        if leading and not self.scripts.lease(token, "renew"):
            self.stand_by(token, "lost the leader lease")

    def stand_by(self, token: str, why: str) -> None:
        """Stop leading at once — unless ``token``'s term is already over and a newer one of
        ours began (a renewal that failed for the old term must not end the new one)."""
        with self._lease_lock:
            if token != self.lease_token or not self.is_leader:
                return
            self.is_leader = False
        log.error("%s (epoch %s); standing by", why, self.epoch)

    def keep_lease(self) -> None:
        """The lease's heartbeat, on a thread of its own: renewed every RENEW_EVERY_S whatever
        the loop is doing, and a lost lease is noticed within that."""

        def tick() -> None:
            if not self.stop.wait(RENEW_EVERY_S):
                self.renew()

        run_until_stopped(self.stop, tick, log, "leader lease")

    def resign(self) -> None:
        if self.is_leader:
            self.scripts.lease(self.lease_token, "release")
            self.is_leader = False

    def leader_record(self) -> dict[str, object]:
        """Who leads, for /health: ``id`` host:pid, ``since`` (epoch seconds), ``epoch``."""
        return {"id": self.ident, "since": self.leader_since, "epoch": self.epoch}

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        log.info("coordinator started")
        # The retry queue's worker lives and dies with this loop (same stop event).
        retries = threading.Thread(
            target=retry.run_worker, args=(self.rq, self.stop), name="retry-worker", daemon=True
        )
        retries.start()
        lease = threading.Thread(target=self.keep_lease, name="leader-lease", daemon=True)
        lease.start()
        self.waker = Waker(self.r, self.stop)
        try:
            run_until_stopped(self.stop, self.iteration, log, "coordinator pass")
        finally:
            lease.join(timeout=10)
            with contextlib.suppress(redis.RedisError):
                self.resign()
            retries.join(timeout=10)
            self.waker.close()
            log.info("coordinator stopped")

    def iteration(self) -> None:
        if not self.is_leader:
            self.release_dead_holder()
            if not self.try_lead():
                self.stop.wait(STANDBY_POLL_S)  # standby: the lease is someone else's
                return
        token = self.lease_token
        try:
            events = self.collect_events(EVENT_WAIT_S)
        except NotLeader:
            self.stand_by(token, "lost the leader lease while waiting for events")
            return
        if self.is_leader:
            self.step(events)

    def collect_events(self, wait_s: float) -> list[Event]:
        """Block for the first event (bounded), then take every event already queued, and while
        the pass would only handle admin changes, those that follow within a quiet spell
        (``coalesce_wait``): a burst of changes costs one pass."""
        # The blocking read only waits for the inbox to be non-empty (BLMOVE of its last event
        # onto itself changes nothing); the events are then taken by a fenced script, so a
        # deposed leader never takes the events the new leader must see (raises NotLeader).
        # A stop unblocks these reads at once (see Waker).
        inbox = keys.events()
        with self.waker.reading() if self.waker else contextlib.nullcontext(self.r) as blocking:
            if _blmove(blocking, inbox, wait_s) is None:
                return []
            events = self._take()
            started = time.monotonic()
            while (wait := coalesce_wait(events, time.monotonic() - started)) > 0:
                nxt = _blmove(blocking, inbox, wait)
                if nxt is None or self.stop.is_set():
                    break
                events += self._take()
        return events

    def _take(self) -> list[Event]:
        """Every queued event (up to MAX_EVENTS_PER_PASS), parsed (a malformed one is dropped)."""
        taken = self.fenced().lpop(keys.events(), MAX_EVENTS_PER_PASS).execute()[0]
        raws = cast(list[str] | None, taken) or []
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
            # Keep enforcing the last good settings rather than none; said once per problem,
            # not on every pass.
            if str(e) != self._settings_error:
                log.error("%s; keeping the previous settings", e)
            self._settings_error = str(e)
        else:
            if self._settings_error:
                log.info("settings valid again")
            self._settings_error = ""
        return self.settings

    def step(self, events: list[Event] | None = None) -> list[Action]:
        """One enforcement pass (``_pass``). A pass of a leader that lost its lease stops at its
        first write, which is refused (NotLeader): it applies and publishes nothing, and the
        coordinator stands by."""
        token = self.lease_token
        try:
            return self._pass(events or [])
        except NotLeader as e:
            self.stand_by(token, f"lost the leader lease during a pass ({e})")
            return []

    def _pass(self, events: list[Event]) -> list[Action]:
        """One enforcement pass, stamped with a fresh generation. Every trigger queued before it
        started (config, policy, load commit, busy -> idle, retry) is handled by this one pass;
        one that arrives while it runs is still in the inbox, so the loop runs again at once —
        a burst of changes costs a few passes, and the last pass sees the last change. Re-plans
        until nothing changes (bounded), so a pool shrinks all the way in one pass and a freed
        slot's load starts in the same pass."""
        trigger = _trigger(events)
        pipe = self.fenced()
        pipe.incr(keys.generation())
        metrics.inc(pipe, metrics.PASSES_TOTAL, {"trigger": trigger})
        gen = int(pipe.execute()[0])
        self.passes += 1
        self.effects.pass_number = self.passes
        s = self.refresh_settings()
        for ev in events:
            if ev.type is EventType.LOAD_FAILED:
                token = str(ev.data.get("token") or "")
                reason = str(ev.data.get("error") or "unknown error")
                failures.settle(
                    self.r, ev.model, token, reason, self.clock(), lease=self.lease_token
                )
            elif ev.type is EventType.READY and ev.data.get("recheck"):
                log.info("%s loaded after the limits changed: re-checking the pool", ev.model)
        actions: list[Action] = []
        for i in range(4):
            rd = snapshot.read(self.r, s, self.clock())
            if i == 0 and not self.sync_limits(gen, rd):
                return []  # not the leader any more: a deposed pass applies nothing
            if self.settle_failures(rd.snap):
                rd = snapshot.read(self.r, s, self.clock())
            clear_stale_explicit(self.scripts, rd.snap, lease=self.lease_token)
            actions = decide(rd.snap)
            if not self.effects.apply(actions, rd.snap, rd.model_hashes, s):
                break
        prune.forget(self.r, forgettable(rd.snap, s.worker.forget_after_s), lease=self.lease_token)
        self.effects.watch_idle(waits_for_idle(actions, rd.snap))
        blocked = {a.type: a.over for a in actions if isinstance(a, Blocked)}
        self.tell_autosize(rd.autosize)
        enforcement = {
            "pass": self.passes,
            "trigger": trigger,
            "blocked": blocked,
            "deferred": bool(blocked),
        }
        routing = self.routing_stats(rd.autosize.floor.per_policy)
        self.publish(
            gen,
            snapshot.health_record(rd, s, enforcement, routing),
            force=bool(events),
            room=route_room.published(rd),
        )
        # After publishing: the retry job reads the published record to know whether the pool
        # is still blocked.
        self.track_deferral(blocked)
        return actions

    def routing_stats(self, policies: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Each policy's routing over the last hour (``route_stats``), read again every
        ROUTE_STATS_EVERY_S or when the policies change; choice minutes older than
        ``keys.ROUTE_SAMPLES_TTL_S`` are deleted, and a policy whose predictions are off is
        warned about once an hour."""
        names = sorted(policies)
        now = self.clock()
        due = self._routing_at is None or now - self._routing_at >= ROUTE_STATS_EVERY_S
        if not due and names == sorted(self._routing):
            return self._routing
        pipe = self.r.pipeline(transaction=False)
        for p in names:
            pipe.lrange(keys.route_samples(p), 0, keys.ROUTE_SAMPLES_MAX - 1)
            pipe.hgetall(keys.route_choices(p))
        res = pipe.execute() if names else []
        stale = self.fenced()
        routing: dict[str, dict[str, Any]] = {}
        for i, p in enumerate(names):
            samples, choices = res[2 * i], res[2 * i + 1]
            stale.hdel(
                keys.route_choices(p),
                *route_stats.stale_choices(choices, now, keys.ROUTE_SAMPLES_TTL_S),
            )
            routing[p] = st = route_stats.stats(samples, choices, now)
            if route_stats.should_warn(st, self._route_warned.get(p), now):
                log.warning("%s", route_stats.warning(p, st))
                self._route_warned[p] = now
        stale.execute()
        self._route_warned = {p: t for p, t in self._route_warned.items() if p in routing}
        self._routing, self._routing_at = routing, now
        return routing

    def settle_failures(self, snap: Snapshot) -> bool:
        """Settle every failed load whose event has not done so yet (``failures.settle``), before
        the pass decides: a load that failed is answered, never silently retried by a load that
        a pass started in between. Returns whether any was settled (then the pool is re-read)."""
        pending = [m for m in snap.models.values() if m.failure_pending]
        for m in pending:
            reason = m.last_error or "unknown error"
            failures.settle(self.r, m.name, m.token, reason, snap.now, lease=self.lease_token)
        return bool(pending)

    def sync_limits(self, gen: int, rd: snapshot.Read) -> bool:
        """Record the limits this pass enforces (stamped with ``gen`` when they changed); loads
        started by this pass carry that generation, and their commit re-checks it."""
        token = self.lease_token
        res = self.scripts.publish_limits(gen, rd.snap.limits, lease=token)
        if res == "not_leader":
            self.stand_by(token, "lost the leader lease during a pass")
            return False
        if res != "stale":
            self.effects.limits_generation = int(res)
        return True

    def track_deferral(self, blocked: dict[str, int]) -> None:
        """Rule 4: a shrink that only busy (or pinned) residents block is retried with backoff
        on the rq retry queue, besides being re-armed by their busy -> idle edge; the job goes
        as soon as a pass finds every pool within its limit."""
        if blocked:
            retry.defer(self.rq, blocked, lease=self.lease_token)
        elif self._deferred and retry.settle(self.rq, lease=self.lease_token):
            log.info("deferred shrink done: every pool is within its limit")
        self._deferred = bool(blocked)

    def publish(
        self,
        gen: int,
        record: dict[str, object],
        *,
        force: bool = False,
        room: dict[str, Any] | None = None,
    ) -> None:
        """Publish the pass's record under its generation, and with it ``room`` (the health
        hash's ``route_room``: what a load of each cold policy candidate would take). A pass
        with no trigger and nothing new publishes at most every PUBLISH_EVERY_S (a heartbeat of
        the record). The record names the leader that publishes it."""
        record["leader"] = self.leader_record()
        body = json.dumps(
            {
                **{k: v for k, v in record.items() if k not in ("published_at", "enforcement")},
                "route_room": room,
            },
            sort_keys=True,
        )
        now = self.clock()
        if not force and body == self._last_record and now - self._last_publish < PUBLISH_EVERY_S:
            return
        record["generation"] = gen
        res = self.scripts.publish_health(gen, record, lease=self.lease_token, route_room=room)
        if res == "ok":
            self._last_record = body
            self._last_publish = now
        else:
            log.info("record of pass %d not published: %s", gen, res)


def holder_dead(token: str, where: str, alive: Callable[[int], bool]) -> bool:
    """Whether the lease ``token`` belongs to a process of this host and pid namespace
    (``where``) that is no longer alive. Tokens of other hosts or namespaces, or of an unknown
    form, are never judged dead: only their TTL ends them."""
    _, _, place = token.partition("@")
    holder_where, _, pid = place.rpartition("/")
    if not holder_where or holder_where != where or not pid.isdigit():
        return False
    return not alive(int(pid))


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "unknown"


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed leader stays a zombie until its
    supervisor reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _blmove(r: redis.Redis, inbox: str, timeout: float) -> object:
    """Wait up to ``timeout`` seconds for the inbox to hold an event, without taking it: its
    last event moves onto its own tail."""
    return blmove(r, inbox, inbox, timeout, "RIGHT", "RIGHT")


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
