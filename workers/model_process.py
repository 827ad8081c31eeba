"""One model process: loads one model on one device, serves its queue, drains on unload.

Started by the agent as ``python -m workers.model_process`` with the load command as JSON on
stdin-free argv. It owns the model's state only while its load token is the model's token: the
moment another party takes the state (reaped, timed out), it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import redis
from opentelemetry import trace

from residency import keys, ledger, metrics, procs, prompt_size, registry, tracing, vision, work
from residency.box import Box, ConfigStore, connect
from residency.errors import ApiError, deadline_exceeded
from residency.loops import REDIS_DOWN, Waker, blmove
from residency.lua import Scripts
from residency.messages import REPORT_PARAM, Event, EventType, Kind, ReplyType, Request
from residency.route_wait import Service
from residency.settings import CACHE_DIR_ENV, CacheSettings, ModelSpec, WorkerSettings
from residency.states import ModelState
from workers import chat_shape, memory, reasoning, request_spans
from workers.completion import REPORT, CacheUse, OnUsage
from workers.engine import EngineClosed, EngineDied
from workers.faults import FaultyRuntime, StepFaults
from workers.gate import Gate, Reason, Stopped, Watcher
from workers.kvstore import Stamp
from workers.load_progress import Reporter as LoadProgress
from workers.runtime import LlamaRuntime, Runtime
from workers.slot_cache import MIN_SAVE_TOKENS, SlotCache, spec_digest
from workers.slot_shares import SlotShares
from workers.timings import Timings, fold_service, route_sample

log = logging.getLogger("residency.model")
T = TypeVar("T")

# How long an idle process blocks on its queue before it looks at control and ownership. An
# eviction does not wait for it: the coordinator unblocks the read (CLIENT UNBLOCK on the
# ``reader`` connection this process publishes) right after it asks for the unload.
TAKE_WAIT_S = 1.0
REDIS_BACKOFF_S = (0.1, 2.0)  # first and longest wait between tries while Redis is unreachable
# A reply stream's TTL is renewed this often while it runs (it expires REPLY_TTL_S after the
# last renewal, so a stream longer than the TTL never loses its key mid-reply).
RENEW_TTL_S = keys.REPLY_TTL_S / 4
OWNERSHIP_CHECK_S = 1.0
# After a stream's first text, its chunks are batched: every FLUSH_EVERY_S while the process
# serves one or two streams, longer with more (FLUSH_EVERY_S per two streams, at most
# FLUSH_MAX_S): a flush costs a Redis round trip here and a read and a write in web whatever it
# carries, so with many streams fewer, fuller flushes cost less CPU per token, while each
# stream's text still moves at least every FLUSH_MAX_S.
FLUSH_EVERY_S = 0.02
FLUSH_MAX_S = 0.05
FLUSH_STREAMS = 2


def flush_interval(streams: int) -> float:
    """How long a stream's chunks wait for company while ``streams`` requests are served."""
    return min(FLUSH_MAX_S, FLUSH_EVERY_S * max(1.0, streams / FLUSH_STREAMS))


# For a load command that carries none (written by an older coordinator).
GRAMMAR_BUDGET_S = float(WorkerSettings.model_fields["grammar_budget_s"].default)
SLOT_SHARE_GRACE_S = float(WorkerSettings.model_fields["slot_share_grace_s"].default)
# How long a slot held for a user below its share waits before the queue is looked at again
# (a finish here ends the wait at once): that user's next request is taken at most this late.
HOLD_POLL_S = 0.01
# How deep into the queue a contended take looks for a request of a user below its share
# (each look copies one queued request inside Redis: bounded per try).
SHARE_DEPTH = 16


class ModelProcess:
    def __init__(
        self,
        r: redis.Redis,
        *,
        model: str,
        token: str,
        device: str,
        spec: ModelSpec,
        runtime: Runtime,
        stop: threading.Event,
        limits_generation: int = 0,
        model_dirs: list[str] | None = None,
        slot_share_grace_s: float = SLOT_SHARE_GRACE_S,
        cache_root: Path | None = None,
        cache_settings: Callable[[], CacheSettings] = CacheSettings,
        load_trace: str = "",
    ) -> None:
        self.r = r
        # Folders the model file's real path must lie in at load (None: a config-file model).
        self.model_dirs = model_dirs
        self.scripts = Scripts(r)
        self.model = model
        self.token = token
        self.device = device
        self.spec = spec
        self.runtime = runtime
        self.stop = stop
        # The generation of the limits the coordinator decided this load under (re-checked at
        # commit).
        self.limits_generation = limits_generation
        self._idle_event = Event(EventType.IDLE, model).to_dict()
        self._next_check = 0.0
        # Raw items of the requests its threads serve (added before a thread gets one, removed
        # after its finish): anything else on its processing list is an orphan.
        self._in_flight: set[str] = set()
        # Started by serve(): reads the current request's cancel flag and writes progress.
        self.watcher = Watcher(r, model)
        self.parallel = 1  # slots, known once loaded
        self.waker: Waker | None = None  # made at load, just before the commit
        # The coordinator asked it to give its slot to a waiting model: it takes nothing new.
        self.yielding = False
        # Moving averages of a request's time in its slot, its time to a first token and its
        # uncached prompt bytes, with the square and product a line's fit needs (keys.service).
        self._service = Service()
        self._service_lock = threading.Lock()
        # What stopped the runtime's engine thread: the process then takes nothing more and
        # exits (procs.ENGINE_DIED_EXIT) instead of answering every request with an error.
        self.engine_error: BaseException | None = None
        # Slot shares between users ([worker] slot_share_grace_s); sized at serve().
        self.slot_share_grace_s = slot_share_grace_s
        self.shares = SlotShares(1, slot_share_grace_s, time.monotonic)
        self._finished = threading.Event()  # set when a request leaves its slot
        # Saved slot caches: the host's folder (None: none kept), the live [cache] settings,
        # the model's entries once loaded, and the engine's prefix counts last published.
        self.cache_root = cache_root
        self.cache_settings = cache_settings
        self.slot_cache: SlotCache | None = None
        self._prefix_seen: dict[str, int] = {}
        self._cache_lock = threading.Lock()
        self.saved_at_drain = False  # its slots were saved when it was told to unload
        # Traces: the load's parent (the agent's span, from the command), then the load's own
        # span and when it was committed, linked from every request queued before that.
        self.tracing = tracing.setup("model")
        self.load_trace = load_trace
        self.load_span: trace.SpanContext | None = None
        self.ready_at = 0.0

    def _event(self, kind: EventType, **data: Any) -> dict[str, Any]:
        return Event(kind, self.model, {"token": self.token, **data}).to_dict()

    def retrying(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, tried again with backoff while Redis is unreachable (a restart): the
        process keeps its model loaded and carries on when Redis is back. Raises only when the
        process is told to stop."""
        return retry_while_down(what, fn, self.stop)

    # -- load -------------------------------------------------------------------------------

    def load(self) -> bool:
        if not self.tracing.on:
            return self._load()
        span = self.tracing.start(
            "load",
            parent=self.load_trace,
            attributes={"residency.model": self.model, "residency.device": self.device},
        )
        try:
            ok = self._load()
            span.set_attribute("residency.parallel", self.parallel)
            if not ok:
                span.set_status(trace.StatusCode.ERROR, "not committed")
            self.load_span = span.get_span_context()
            return ok
        finally:
            span.end()

    def _load(self) -> bool:
        t0 = time.monotonic()
        try:
            if self.model_dirs is not None and self.spec.path is not None:
                # Re-checked here, not only at registration: the file may have been swapped for
                # a symlink that leads out of the model directories since.
                registry.check_path(self.spec.path, self.model_dirs)
                if self.spec.mmproj is not None:
                    registry.check_path(self.spec.mmproj, self.model_dirs)
            progress = LoadProgress(self.r, self.model, self.token)
            progress.start()
            try:
                self.runtime.load(self.spec, self.device, progress.note)
            finally:
                progress.stop()
            self.parallel = self.runtime.parallel
        except Exception as e:
            if self.stop.is_set():
                log.info("%s: load stopped by shutdown", self.model)
                return False
            msg = f"{type(e).__name__}: {e}"
            log.error("load of %s failed: %s", self.model, msg)
            self.retrying("report the failed load", lambda: self._report_failed_load(msg))
            return False
        seconds = time.monotonic() - t0
        if self.stop.is_set():
            # Stopped while loading: commit nothing; the agent hands the waiting work back.
            log.info("%s: stopped during its load; not committing it", self.model)
            return False
        # Its memory as loaded, and what residency.footprint expected of it (after the load's
        # seconds are taken: neither counts in them).
        footprint_bytes = memory.measured(self.device)
        estimate_bytes = ledger.estimated(self.spec, self.device, self.parallel)
        # After the measure (the model's bytes, not the index's), before the first request.
        self._open_cache()
        now = time.time()
        # The blocking connection of the queue reads, made now so that its id is published
        # with the state: a stop unblocks it from inside, an eviction from the coordinator.
        self.waker = Waker(self.r, self.stop)
        reader = self.retrying("open the queue connection", self.waker.client_id)
        # Who caused this load (recorded when it started): its time is charged to them; when
        # the coordinator started it (a client waiting for this load waits for the process's
        # spawn too, which ``seconds`` leaves out); and the spec's load time measured so far,
        # which this load is folded into.
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(keys.model(self.model), ["load_user", "load_key", "loading_since"])
        pipe.hmget(keys.footprint(self.model), ["load_s", "load_spec"])
        (cause_user, cause_key, since), before = self.retrying(
            "read who caused the load", pipe.execute
        )
        waited = _since(since, now, seconds)
        ok, res = self.retrying(
            "commit the load",
            lambda: self.scripts.commit_load(
                self.model,
                token=self.token,
                limits_generation=self.limits_generation,
                ready_event=self._event(EventType.READY),
                load_seconds=seconds,
                charge_user=str(cause_user or ""),
                charge_key=str(cause_key or ""),
                now=now,
                fields={
                    "pid": os.getpid(),
                    "parallel": self.parallel,
                    "reader": reader,
                    "loaded_at": now,
                    "load_seconds": round(seconds, 4),
                    "last_used": now,
                    "loading_since": None,
                    "footprint_bytes": footprint_bytes,
                    "estimate_bytes": estimate_bytes,
                },
            ),
        )
        if not ok:
            log.warning("load of %s finished but the state is %s now; exiting", self.model, res)
            self.waker.close()
            return False
        if res == "recheck":
            log.info("%s: the limits changed while it loaded; asked for a full pass", self.model)
        pipe = self.r.pipeline(transaction=False)
        metrics.inc(pipe, metrics.LOADS_TOTAL, {"model": self.model, "outcome": "ok"})
        metrics.observe(pipe, metrics.LOAD_SECONDS, {"model": self.model}, seconds)
        if res == "recheck":
            metrics.inc(pipe, metrics.RECHECKS_TOTAL, {"model": self.model})
        digest = ledger.digest(self.spec, self.device, self.parallel)
        if footprint_bytes is not None and digest is not None:
            # Outlives the unload: the next load of the same spec is counted for what this one
            # measured rather than for the estimate.
            pipe.hset(
                keys.footprint(self.model),
                mapping={
                    "bytes": footprint_bytes,
                    "estimate": estimate_bytes or "",
                    "spec": digest,
                },
            )
        if digest is not None:
            # Outlives the unload too: the router predicts the next cold load of the same spec
            # from it (measured or not, a load's time is known).
            pipe.hset(
                keys.footprint(self.model),
                mapping={"load_s": round(load_average(before, digest, waited), 4),
                         "load_spec": digest},
            )  # fmt: skip
        self.retrying("count the load", pipe.execute)
        self.retrying("publish the slot cache", self.publish_cache)
        self.ready_at = now
        log.info("%s ready on %s in %.3fs", self.model, self.device, seconds)
        return True

    # -- saved slot caches ------------------------------------------------------------------

    def _open_cache(self) -> None:
        """Index the entries saved under this spec (and the current clear epochs), deleting
        what cannot be restored; prompts may start from them while ``[cache] disk_mb`` > 0. A
        cache that cannot be opened is logged and left out: it never fails a load."""
        if self.cache_root is None or self.spec.type != "llm":
            return
        try:
            self._index_cache(self.cache_root)
        except REDIS_DOWN:
            raise
        except Exception:
            log.exception("%s: its slot cache cannot be opened; loading without it", self.model)
            self.slot_cache = None

    def _index_cache(self, root: Path) -> None:
        every, mine = self.retrying(
            "read the slot cache epochs",
            lambda: self.r.hmget(keys.kvcache_epochs(), ["*", self.model]),
        )
        digest = spec_digest(self.spec, self.parallel, self.runtime.state_format)
        stamp = Stamp(digest, int(every or 0), int(mine or 0))

        def fresh() -> bool:  # no clear since the load (asked before each restore)
            now = self.r.hmget(keys.kvcache_epochs(), ["*", self.model])
            return (int(now[0] or 0), int(now[1] or 0)) == (stamp.epoch_all, stamp.epoch_model)

        cache = SlotCache(root, self.model, stamp, fresh)
        cache.scan()
        self.slot_cache = cache
        try:
            restores = self.cache_settings().disk_mb > 0
        except ValueError as e:  # a bad config: the admin API reports it; keep serving
            log.error("%s: settings unreadable (%s); saved slots not restored", self.model, e)
            restores = False
        if restores:
            self.runtime.attach_cache(cache)

    def save_slots(self, why: str) -> None:
        """Write the free slots' memory to the slot cache (at a drain or a stop), within
        ``[cache] save_timeout_s`` and ``disk_mb`` as they are now: a save that does not fit is
        skipped, and nothing here fails or holds the unload past the timeout."""
        cache = self.slot_cache
        if cache is None or self.engine_error is not None:
            return
        try:
            cs = self.cache_settings()
        except ValueError as e:
            log.error("%s: settings unreadable (%s); slots not saved", self.model, e)
            return
        if cs.disk_mb == 0 or cs.save_timeout_s == 0:
            return
        t0 = time.monotonic()
        deadline = t0 + cs.save_timeout_s
        try:
            images = self.runtime.slot_images(MIN_SAVE_TOKENS, cs.save_timeout_s)
        except (TimeoutError, EngineClosed) as e:
            log.warning("%s: slots not saved (%s): %s", self.model, why, e)
            return
        report = cache.save(images, cs.disk_mb << 20, deadline)
        log.info(
            "%s: %d slot(s) saved (%s, %d bytes, %.3fs)%s",
            self.model,
            report.saved,
            why,
            report.bytes,
            time.monotonic() - t0,
            f", skipped {report.skipped}" if report.skipped else "",
        )
        self.retrying("count the slot cache", self.publish_cache)

    def publish_cache(self, force: bool = True) -> None:
        """What the slot cache and the engine's prefix reuse did since the last call, as
        metrics, with the model's cache record for /health, in one round trip (none when
        nothing changed, unless ``force``)."""
        cache = self.slot_cache
        with self._cache_lock:
            prefix = self.runtime.prefix_counts()
            delta = {k: v - self._prefix_seen.get(k, 0) for k, v in prefix.items()}
            self._prefix_seen = prefix
            counts = cache.take_counts() if cache is not None else None
        if not (force or any(delta.values()) or (counts is not None and counts.any())):
            return
        pipe = self.r.pipeline(transaction=False)
        m = {"model": self.model}
        if delta.get("copies"):
            metrics.inc(pipe, metrics.SLOT_COPIES_TOTAL, m, delta["copies"])
        for outcome in ("own", "copied", "cold"):
            if delta.get(f"wait_{outcome}"):
                labels = {**m, "outcome": outcome}
                metrics.inc(pipe, metrics.SLOT_WAITS_TOTAL, labels, delta[f"wait_{outcome}"])
        if cache is not None and counts is not None:
            if counts.saves:
                metrics.inc(pipe, metrics.KV_SAVES_TOTAL, {**m, "outcome": "saved"}, counts.saves)
                metrics.inc(pipe, metrics.KV_SAVED_BYTES_TOTAL, m, counts.saved_bytes)
            for outcome, n in counts.skipped.items():
                metrics.inc(pipe, metrics.KV_SAVES_TOTAL, {**m, "outcome": outcome}, n)
            if counts.restores:
                metrics.inc(pipe, metrics.KV_RESTORES_TOTAL, m, counts.restores)
                metrics.inc(pipe, metrics.KV_RESTORED_TOKENS_TOTAL, m, counts.restored_tokens)
            for sec in counts.restore_seconds:
                metrics.observe(pipe, metrics.KV_RESTORE_SECONDS, m, sec)
            for reason, n in counts.bad.items():
                metrics.inc(pipe, metrics.KV_DROPPED_TOTAL, {**m, "reason": reason}, n)
            entries, size = cache.usage()
            pipe.hset(keys.kvcache(self.model), mapping={"entries": entries, "bytes": size})
            pipe.hincrby(keys.kvcache(self.model), "hits", counts.restores)
        pipe.execute()

    def _report_failed_load(self, msg: str) -> None:
        self.scripts.transition(
            self.model, ModelState.FAILED, token=self.token, fields={"error": msg[:500]}
        )
        pipe = self.r.pipeline(transaction=False)
        metrics.inc(pipe, metrics.LOADS_TOTAL, {"model": self.model, "outcome": "error"})
        pipe.rpush(keys.events(), json.dumps(self._event(EventType.LOAD_FAILED, error=msg)))
        pipe.execute()

    # -- serve ------------------------------------------------------------------------------

    def serve(self) -> None:
        waker = self.waker or Waker(self.r, self.stop)  # a stop unblocks the queue read at once
        self._next_check = time.monotonic() + OWNERSHIP_CHECK_S
        self.watcher.start()
        # One thread per slot serves a request from its queue entry to its last reply; the
        # runtime decodes all of them together.
        self._free = threading.Semaphore(self.parallel)
        self.shares = SlotShares(self.parallel, self.slot_share_grace_s, time.monotonic)
        self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="request")

        def step() -> bool:  # True: exit (stopped, its engine dead, unloaded, or not the owner)
            return self.stop.is_set() or self._engine_dead() or self.serve_once(waker)

        try:
            while not self.retrying("serve the queue", step):
                pass
        except REDIS_DOWN:
            pass  # stopped while Redis was down
        finally:
            self._pool.shutdown(wait=True)  # the requests in flight end first
            self.watcher.close()
            waker.close()

    def serve_once(self, waker: Waker) -> bool:
        """Take at most one request while a slot is free (none while the model yields its slot:
        then wait for the unload instead; none of a user at its slot share while another active
        user is below its own: then one of that user's, or hold the slot a moment) and start
        serving it, then look at control and (every OWNERSHIP_CHECK_S) ownership; True when the
        process should exit: it unloaded, or its state is no longer its own (reaped, or lost
        with a Redis that restarted empty)."""
        if self.yielding:
            self._await_control(waker)
        elif self._take_slot():
            self._finished.clear()  # before the decision: a finish after it ends the hold
            capped = self.shares.capped()
            if capped:
                self._take_share(capped)
            else:
                self._take(waker)
        if self.check_control() == "unloaded":
            return True
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + OWNERSHIP_CHECK_S
            if not self.owns_state():
                log.warning("%s: state no longer ours; exiting", self.model)
                return True
            self.hand_back_orphans()
        return False

    def _take(self, waker: Waker) -> None:
        """Take the queue head into the slot already acquired (waiting up to TAKE_WAIT_S for
        one) and start serving it; the slot is released when nothing came."""
        try:
            with waker.reading() as blocking:
                raw = blmove(
                    blocking,
                    keys.queue(self.model),
                    keys.processing(self.model),
                    TAKE_WAIT_S,
                    "RIGHT",
                    "LEFT",
                )
        except BaseException:
            self._free.release()
            raise
        if raw is None:
            self._free.release()
        else:
            self._started(raw)

    @staticmethod
    def _parse(raw: str) -> Request | None:
        """A taken request, parsed once for the slot shares and its serving (None: malformed;
        ``handle`` drops it)."""
        try:
            return Request.loads(raw)
        except (ValueError, KeyError, TypeError):
            return None

    def _take_share(self, capped: frozenset[str]) -> None:
        """With ``capped`` users at their slot share while another active user is below its
        own: take the first queued request (in fair order, at most SHARE_DEPTH deep) of a user
        not capped, in one script. Fair queueing usually puts such a request at the head, but
        not always: a light user served faster than a heavy one has had more turns, and queues
        behind some of the heavy user's requests. None: hold the free slot (it stays free: an
        unload or a yield sees nothing more in flight) a moment, then decide again."""
        try:
            raw = self.scripts.take_share(self.model, capped, SHARE_DEPTH)
        except BaseException:
            self._free.release()
            raise
        if raw is None:
            self._free.release()
            self._hold()
        else:
            self._started(raw)

    def _started(self, raw: str) -> None:
        req = self._parse(raw)
        user = req.user if req is not None else ""
        self.shares.started(user, req.weight if req is not None else 1.0)
        self._in_flight.add(raw)
        self._pool.submit(self._serve_request, raw, req)

    def _hold(self) -> None:
        """Wait (bounded) for what may change a held slot's decision: a finish here, a grace
        that ends, or (looked at again after HOLD_POLL_S) another user's request queued."""
        wait = HOLD_POLL_S
        until = self.shares.hold_until()
        if until is not None:
            wait = max(0.0, min(wait, until - time.monotonic()))
        self._finished.wait(wait)

    def _engine_dead(self) -> bool:
        err = self.runtime.failure()
        if err is not None and self.engine_error is None:
            log.error("%s: its engine thread died (%r); exiting", self.model, err)
            self.engine_error = err
        return err is not None

    def hand_back_orphans(self) -> None:
        """Requests on this model's processing list that none of its threads serves: only a
        Redis that came back from an older persisted state (a kill between fsyncs) puts them
        there — e.g. one whose finish was lost. Nothing else would ever take them off (the
        agent hands back only a dead process's list), so they are handed back like a dead
        process's: requeued if they produced no output yet, else answered with an error."""
        items = cast(list[str], self.r.lrange(keys.processing(self.model), 0, -1))
        orphans = {raw for raw in items if raw not in self._in_flight}
        if orphans:
            counts = work.hand_back(
                self.r, self.scripts, self.model, "orphaned", only=orphans, announce=False
            )
            log.warning("%s: requests on its processing list nobody served: %s", self.model, counts)

    def owns_state(self) -> bool:
        state, token = cast(
            list[str | None], self.r.hmget(keys.model(self.model), ["state", "token"])
        )
        return token == self.token and state in (ModelState.READY, ModelState.DRAINING)

    def _take_slot(self) -> bool:
        """A free slot, waited for up to TAKE_WAIT_S. One that frees up during the wait is
        taken only if the model was not asked to yield meanwhile (read again then: the last
        read was before the wait), so a yield stops admission within one wait."""
        if self._free.acquire(blocking=False):
            return True
        if not self._free.acquire(timeout=TAKE_WAIT_S):
            return False
        try:
            self.yielding = bool(self.r.hget(keys.model(self.model), "yielding"))
        except BaseException:
            self._free.release()
            raise
        if self.yielding:
            self._free.release()
        return not self.yielding

    def _await_control(self, waker: Waker) -> None:
        """While yielding, take nothing from the queue: wait (bounded, without taking it) for
        the unload command on the control list instead, so it is seen the moment it comes."""
        control = keys.control(self.model)
        with waker.reading() as blocking:
            blmove(blocking, control, control, TAKE_WAIT_S, "RIGHT", "RIGHT")

    def check_control(self) -> str | None:
        # Whether the model yields its slot is read in the same round trip: while it does, the
        # next iteration takes nothing new (the coordinator unblocks the queue read on a yield).
        pipe = self.r.pipeline(transaction=False)
        pipe.lpop(keys.control(self.model))
        pipe.hget(keys.model(self.model), "yielding")
        raw, yielding = pipe.execute()
        self.yielding = bool(yielding)
        if raw is None:
            return None
        try:
            cmd = json.loads(raw)
        except ValueError:
            return None
        if cmd.get("op") != "unload" or cmd.get("token") != self.token:
            return None  # addressed to an earlier load of this model
        if not self._in_flight:
            # Before the unload commits: the memory stays counted as this model's until the
            # save is done. A request queued meanwhile rescues the model (the save was early,
            # not wrong: its entries are what the slots hold).
            self.save_slots(str(cmd.get("reason") or "unload"))
            self.saved_at_drain = True
        res = self.scripts.try_unload(
            self.model,
            token=self.token,
            unloaded_event=self._event(EventType.UNLOADED),
            rescued_event=self._event(EventType.RESCUED),
        )
        log.info("%s: unload request -> %s", self.model, res)
        return res

    def _serve_request(self, raw: str, req: Request | None) -> None:
        try:
            self.handle(raw, req)
        except BaseException:
            # Only a stop while Redis is down gets here (handle answers everything else); the
            # request stays on the processing list for the agent to hand back.
            log.exception("%s: request left unfinished", self.model)
        finally:
            self._in_flight.discard(raw)
            self.shares.finished(req.user if req is not None else "")
            self._free.release()
            self._finished.set()

    def handle(self, raw: str, req: Request | None = None) -> None:
        """Serve one taken request to its last reply (``req``: ``raw`` already parsed)."""
        if req is None:
            req = self._parse(raw)
        if req is None:
            log.error("%s: dropping malformed request", self.model)
            self.r.lrem(keys.processing(self.model), 1, raw)
            return
        last: tuple[str, dict[str, Any]] | None = None
        tail: list[dict[str, Any]] = []  # a stream's last chunks, written with its last reply
        # Prompt, completion and cached prompt tokens, summed over its generations.
        usage: list[int] = []
        served: float | None = None  # seconds it held its slot, when it generated to the end
        # A stream stopped at shutdown goes on (its loop answers shutting_down once it has
        # output); a non-stream one is left on the processing list for the agent to requeue.
        gate = Gate(req.id, req.deadline, None if req.stream else self.stop)
        # Always timed: the model's pace and a routed request's wait are measured from it.
        timed = Timings(req.submitted)
        try:
            if self.r.exists(keys.cancel(req.id)):
                pass  # its client went away while it was queued
            elif gate.expired():
                last = self._deadline_error(req)  # answered without generating
            else:
                self.watcher.add(gate)
                started = time.monotonic()
                try:
                    last = self.generate(req, gate, tail, usage, timed)
                finally:
                    self.watcher.remove(gate)
                served = time.monotonic() - started
        except Stopped as e:
            if e.reason is Reason.SHUTDOWN:
                log.info("%s: request %s left for the agent to requeue", self.model, req.id)
                return
            if e.reason is Reason.DEADLINE:
                log.info("%s: request %s stopped by its deadline", self.model, req.id)
                last = self._deadline_error(req)
            else:
                self._cancelled(req.id, gate.chunks_sent)
        except EngineDied:
            # Not this request's fault: it stays on the processing list, and the agent hands
            # it back (requeued for the reloaded model if it has no output yet) once this
            # process has exited.
            log.warning("%s: request %s left to the agent: the engine died", self.model, req.id)
            self._engine_dead()
            return
        except ApiError as e:
            last = (ReplyType.ERROR, e.to_reply())
        except REDIS_DOWN as e:
            # Its reply could not be written: once Redis is back the client (if still
            # reading) gets a clean error, and the request leaves the processing list.
            log.warning("%s: Redis lost during request %s: %s", self.model, req.id, e)
            err = ApiError(
                503,
                "the reply was cut off by a storage outage; retry the request",
                type="server_error",
                code="redis_unavailable",
                retry_after=1,
            )
            last = (ReplyType.ERROR, err.to_reply())
        except Exception as e:
            log.exception("%s: request %s failed", self.model, req.id)
            err = ApiError(500, f"generation failed: {e}", type="server_error", code="internal")
            last = (ReplyType.ERROR, err.to_reply())
        # The last reply message goes out with the removal from the processing list, in one
        # script (see finish.lua for the race that prevents), with the stream's last chunks,
        # the model's pace and a routed request's sample: one round trip. Retried through a
        # Redis restart.
        service = None if served is None else self._served(req, served, timed, usage)
        sample = None
        if last is not None and last[0] == ReplyType.DONE and req.route:
            sample = route_sample(req.route, self.model, timed.actual_wait(), time.time())
        # A restore, copy or wait it made, counted before its client has the answer (no round
        # trip when there is none; on a Redis outage, counted with a later request's).
        with contextlib.suppress(*REDIS_DOWN):
            self.publish_cache(force=False)
        self.retrying(
            "finish a request",
            lambda: self.scripts.finish(
                self.model,
                raw,
                now=time.time(),
                idle_event=self._idle_event,
                request_id=req.id,
                last=last,
                chunks=tail if last is not None else None,
                service=service,
                route_sample=sample,
                user=req.user,
                key=req.key,
                usage=(usage[0], usage[1]) if usage else None,
            ),
        )
        if self.tracing.on:
            request_spans.record(
                self.tracing,
                req,
                timed,
                usage,
                model=self.model,
                slots=self.parallel,
                end=time.time(),
                load=self.load_span,
                ready_at=self.ready_at,
                failed=last is None or last[0] == ReplyType.ERROR,
            )

    def _served(self, req: Request, seconds: float, timed: Timings, usage: list[int]) -> Service:
        """Fold one request into the model's pace (web reads it to tell a refused client when
        to retry, the router to predict waits): its time in its slot and, a generation that
        reached its first token, that time and its uncached prompt bytes. Returns the new
        averages."""
        first_s = new_bytes = None
        if req.kind in (Kind.CHAT, Kind.COMPLETION) and timed.first is not None and usage:
            first_s = timed.first - timed.taken
            # In the router's measure (it never tokenizes): the prompt's bytes, less the share
            # of its tokens a cache held.
            prompt, cached = usage[0], usage[2]
            uncached = (prompt - cached) / prompt if prompt > 0 else 1.0
            new_bytes = prompt_size.prompt_bytes(req.params) * max(0.0, uncached)
        with self._service_lock:
            self._service = fold_service(self._service, seconds, first_s, new_bytes)
            return self._service

    def _deadline_error(self, req: Request) -> tuple[str, dict[str, Any]]:
        err = deadline_exceeded(self.model, req.deadline - req.submitted)
        return ReplyType.ERROR, err.to_reply()

    def generate(
        self,
        req: Request,
        gate: Gate | None = None,
        tail: list[dict[str, Any]] | None = None,
        usage: list[int] | None = None,
        timed: Timings | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        """Run the request; returns its last reply message (None when its client cancelled).
        ``gate.step`` runs on every generated token and raises ``Stopped`` to end it. A
        stream's chunks not written yet when it ends go to ``tail`` (see ``stream``); the
        tokens it used are added to ``usage`` (prompt, completion, cached) as they become
        known."""
        if usage is None:
            usage = []
        on_usage = _adder(usage)
        if req.kind is Kind.EMBEDDING:
            out = self.runtime.embed(list(req.params["input"]))
            out["model"] = self.model
            if isinstance(out.get("usage"), dict):
                on_usage(int(out["usage"].get("prompt_tokens", 0)), 0, 0)
            return ReplyType.DONE, out
        if req.kind is Kind.RERANK:
            out = self.runtime.rerank(str(req.params["query"]), list(req.params["documents"]))
            out["model"] = self.model
            on_usage(int(out["usage"]["prompt_tokens"]), 0, 0)
            return ReplyType.DONE, out
        if req.kind in (Kind.CHAT, Kind.TOKENIZE):
            # Refused here whatever path it came by: a model that cannot see never answers
            # as if it had looked at the image.
            vision.refuse_images(req.params, self.model, self.spec)
        if req.kind is Kind.TOKENIZE:
            return ReplyType.DONE, self.runtime.count_tokens(dict(req.params))
        call = self.runtime.chat if req.kind is Kind.CHAT else self.runtime.completion
        if timed is None:
            timed = Timings(req.submitted)
        step = timed.on_step(gate.step if gate is not None else None)
        # Ours, not llama.cpp's: the usage chunk is written here, from what the engine counted.
        params = dict(req.params)
        opts = params.pop("stream_options", None) or {}
        report = bool(params.pop(REPORT_PARAM, False))
        result = call(
            params,
            req.stream,
            step,
            on_usage,
            on_progress=gate.progress if gate is not None else None,
            cache=CacheUse(req.user, req.cache_scope),
        )
        if not req.stream:
            assert isinstance(result, dict)
            result["model"] = self.model
            result["timings"] = timed.report(usage)
            if req.kind is Kind.CHAT:
                chat_shape.answer(result)
            if report:
                _stop_sequence(result)
            return ReplyType.DONE, result
        assert not isinstance(result, dict)
        if req.kind is Kind.CHAT:
            result = chat_shape.chunks(result)
        if report:
            result = _reported(result)
        if opts.get("include_usage"):
            result = _with_usage(result, usage, self.model, timed)
        return self.stream(req, result, gate, tail)

    def stream(
        self,
        req: Request,
        chunks: Iterable[dict[str, Any]],
        gate: Gate | None = None,
        tail: list[dict[str, Any]] | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        """Forward chunks in small batches: everything up to and including the first chunk with
        text at once (llama.cpp sends a role-only chunk first; batching the first token behind
        it cost a whole batch interval of time to first token), then every ``flush_interval``
        (longer the more streams this process serves); each flush also reads the cancel flag
        in the same round trip, so a client that went away stops the generation within one
        batch even without the watcher. A stream stopped by its deadline sends what it has
        before the error. With ``tail``, the chunks left when it ends go there, for the caller
        to write with the last reply (else they are flushed here)."""
        batch: list[dict[str, Any]] = []
        sent = 0
        texted = False
        last_flush = 0.0
        last_ttl = 0.0
        it = iter(chunks)
        try:
            for chunk in it:
                if self.stop.is_set():
                    raise ApiError(
                        503,
                        "the model process is stopping; retry the request",
                        type="server_error",
                        code="shutting_down",
                        retry_after=1,
                    )
                chunk["model"] = self.model
                batch.append(chunk)
                now = time.monotonic()
                if not texted:
                    texted = _has_text(chunk)
                    due = True
                else:
                    due = now - last_flush >= flush_interval(len(self._in_flight))
                if due:
                    last_flush = now
                    renew = sent == 0 or now - last_ttl >= RENEW_TTL_S
                    if renew:
                        last_ttl = now
                    if self._flush(req.id, batch, renew=renew, gate=gate):
                        self._cancelled(req.id, sent)
                        return None
                    sent += len(batch)
                    if gate is not None:
                        gate.chunks_sent = sent
                    batch.clear()
            if batch and tail is not None:
                tail.extend(batch)
            elif batch and self._flush(req.id, batch, gate=gate):
                self._cancelled(req.id, sent)
                return None
            return ReplyType.DONE, {}
        except Stopped as e:
            if e.reason is Reason.DEADLINE and batch:
                self._flush(req.id, batch, gate=gate)
            raise
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # stops llama.cpp's generator at once when we leave early

    def _cancelled(self, req_id: str, chunks_sent: int) -> None:
        log.info("%s: request %s cancelled by its client", self.model, req_id)
        pipe = self.r.pipeline(transaction=False)
        metrics.inc(pipe, metrics.CANCELLED_TOTAL, {"model": self.model})
        metrics.inc(pipe, metrics.CANCELLED_CHUNKS_TOTAL, {"model": self.model}, chunks_sent)
        pipe.execute()

    def _flush(
        self,
        req_id: str,
        batch: list[dict[str, Any]],
        *,
        renew: bool = True,
        gate: Gate | None = None,
    ) -> bool:
        """Write a batch of chunks; returns True when the request was cancelled (then nothing
        is written: its client's web thread deleted the reply stream, and a write would make
        it again). The watcher's flag saves the round trip; the script checks the flag itself
        in the same step as the write."""
        if gate is not None and gate.cancelled.is_set():
            return True
        return self.scripts.flush(req_id, batch, renew=renew)


#: The weight of the newest load in a spec's measured load time. Loads of one spec differ by
#: more than noise: one that finds the agent's warm process takes the model's own load time, one
#: right after it (the warm process not yet replaced) a process start too.
LOAD_EWMA = 0.3


def load_average(before: list[Any], digest: str, seconds: float) -> float:
    """The spec's load time with this load's ``seconds`` folded in; ``before``: the footprint
    hash's ``load_s`` and ``load_spec`` (another spec's time, or none, starts afresh)."""
    prev, spec = [*before, None, None][:2]
    try:
        p = float(prev)
    except (TypeError, ValueError):
        return seconds
    if spec != digest or not math.isfinite(p) or p < 0:
        return seconds
    return p + LOAD_EWMA * (seconds - p)


def _since(loading_since: Any, now: float, seconds: float) -> float:
    """Seconds of a load as a waiting client saw it: from ``loading_since`` (the coordinator's
    start of it, a wall-clock time) to ``now``; ``seconds`` (this process's own) when that is
    unknown or reads as less (another host's clock)."""
    try:
        since = float(loading_since)
    except (TypeError, ValueError):
        return seconds
    return max(seconds, now - since)


def _adder(total: list[int]) -> OnUsage:
    """Adds each generation's (prompt, completion, cached) tokens to ``total`` (a chat handler
    may run more than one generation for a request)."""

    def add(prompt: int, completion: int, cached: int) -> None:
        if not total:
            total.extend((0, 0, 0))
        total[0] += prompt
        total[1] += completion
        total[2] += cached

    return add


def _with_usage(
    chunks: Iterable[dict[str, Any]], usage: list[int], model: str, timed: Timings | None = None
) -> Iterator[dict[str, Any]]:
    """``stream_options.include_usage``: after the last chunk, one more with no choices and
    the request's usage (OpenAI's shape) and ``timings``; every chat chunk before it carries
    ``usage: null``
    (a completion chunk does not: OpenAI's schema has no null there). The engine has counted
    the tokens by the time the chunks end, and the runtime a chat's reasoning tokens
    (``reasoning.TALLY``, this thread's: None when its model splits no reasoning off)."""
    last: dict[str, Any] | None = None
    it = iter(chunks)
    try:
        for chunk in it:
            if chunk.get("object") == "chat.completion.chunk":
                chunk.setdefault("usage", None)
            last = chunk
            yield chunk
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    prompt, completion, cached = usage if usage else (0, 0, 0)
    details: dict[str, Any] = {}
    chat = last is None or last["object"] == "chat.completion.chunk"
    if chat and reasoning.TALLY.tokens is not None:
        details["completion_tokens_details"] = {"reasoning_tokens": reasoning.TALLY.tokens}
    yield {
        "id": last["id"] if last else "",
        "object": last["object"] if last else "chat.completion.chunk",
        "created": last["created"] if last else int(time.time()),
        "model": model,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            **details,
        },
        **({"timings": timed.report(usage)} if timed is not None else {}),
    }


def _stop_sequence(obj: dict[str, Any]) -> None:
    """Name the stop string that ended the generation in the choice that stopped (REPORT is
    this thread's: the generation ran, or is running, in it)."""
    for choice in obj.get("choices") or []:
        if choice.get("finish_reason") == "stop":
            choice["stop_sequence"] = REPORT.stop_sequence


def _reported(chunks: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A stream with ``REPORT_PARAM``'s fields: the prompt's tokens in its first chunk (known
    once the generation was submitted, which was before the first chunk), the stop string in
    the chunk that ends it."""
    it = iter(chunks)
    first = True
    try:
        for chunk in it:
            if first:
                chunk["prompt_tokens"] = REPORT.prompt_tokens
                first = False
            _stop_sequence(chunk)
            yield chunk
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def retry_while_down(what: str, fn: Callable[[], T], stop: threading.Event) -> T:
    """``fn()``, tried again with backoff (REDIS_BACKOFF_S) while Redis is unreachable; raises
    the last error once ``stop`` is set."""
    backoff = REDIS_BACKOFF_S[0]
    while True:
        try:
            return fn()
        except REDIS_DOWN as e:
            if stop.is_set():
                raise
            log.warning("Redis unreachable (%s) trying to %s; again in %.1fs", e, what, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, REDIS_BACKOFF_S[1])


def build_runtime(
    r: redis.Redis,
    model: str,
    fault_injection: bool,
    stop: threading.Event,
    grammar_budget_s: float = 0.0,
) -> Runtime:
    if not fault_injection:
        return LlamaRuntime(grammar_budget_s=grammar_budget_s)
    steps = StepFaults(stop)
    return FaultyRuntime(
        LlamaRuntime(wrap=steps.wrap, grammar_budget_s=grammar_budget_s), r, model, stop, steps
    )


def wait_for_command(r: redis.Redis, key: str, stop: threading.Event) -> str | None:
    """A standby process waits here (bounded waits, woken at once by a stop) for its one
    command."""
    waker = Waker(r, stop)

    def take() -> str | None:
        with waker.reading() as blocking:
            item = blocking.blpop([key], timeout=1)
        if item is None:
            return None
        r.delete(key)
        return str(item[1])

    try:
        while not stop.is_set():
            try:
                raw = retry_while_down("wait for a load command", take, stop)
            except REDIS_DOWN:
                return None  # stopped while Redis was down
            if raw is not None:
                return raw
        return None
    finally:
        waker.close()


def _live_cache_settings(r: redis.Redis) -> Callable[[], CacheSettings]:
    """``[cache]`` as it is now (file, environment and admin changes; the agent hands its own
    config file and environment down): re-read when the config generation moves."""
    store = ConfigStore(Box.from_env(), r)
    seen: list[Any] = [None, CacheSettings()]

    def current() -> CacheSettings:
        gen = store.config_generation()
        if gen != seen[0]:
            seen[1] = store.load()[0].cache
            seen[0] = gen
        return cast(CacheSettings, seen[1])

    return current


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="residency-model-process")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--command", help="the agent's load command (JSON)")
    group.add_argument(
        "--standby", metavar="KEY", help="start warm and wait on this list for the load command"
    )
    args = ap.parse_args(argv)
    stop = threading.Event()

    def _on_term(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    r = connect(os.environ["RESIDENCY_REDIS_URL"])
    if args.standby:
        LlamaRuntime.warm_up()
        raw = wait_for_command(r, args.standby, stop)
        if raw is None:
            return 0
        cmd = json.loads(raw)
    else:
        cmd = json.loads(args.command)
    logging.basicConfig(
        level=os.environ.get("RESIDENCY_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s model[{cmd['model']}] %(message)s",
    )
    spec = ModelSpec.model_validate(cmd["spec"])
    proc = ModelProcess(
        r,
        model=cmd["model"],
        token=cmd["token"],
        device=cmd["device"],
        spec=spec,
        runtime=build_runtime(
            r,
            cmd["model"],
            bool(cmd.get("fault_injection")),
            stop,
            float(cmd.get("grammar_budget_s", GRAMMAR_BUDGET_S)),
        ),
        stop=stop,
        limits_generation=int(cmd.get("limits_generation", 0)),
        model_dirs=cmd.get("model_dirs"),
        slot_share_grace_s=float(cmd.get("slot_share_grace_s", SLOT_SHARE_GRACE_S)),
        cache_root=Path(os.environ[CACHE_DIR_ENV]) if os.environ.get(CACHE_DIR_ENV) else None,
        cache_settings=_live_cache_settings(r),
        load_trace=str(cmd.get("trace", "")),
    )
    if not proc.load():
        return 1
    try:
        proc.serve()
        if stop.is_set() and not proc.saved_at_drain:
            proc.save_slots("shutdown")  # the box stops: its slots survive a restart
    finally:
        proc.runtime.close()
    if proc.engine_error is not None:
        # The agent reports it as a crash: its in-flight requests are handed back and the
        # model is loaded again on demand.
        return procs.ENGINE_DIED_EXIT
    # Exiting without committing an unload (SIGTERM) leaves the state to the agent, which hands
    # any in-flight request back to the queue.
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
