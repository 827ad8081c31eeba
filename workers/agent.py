"""The worker agent: one per host. Registers the host, heartbeats, spawns one model process per
load command, and reports every process that exits or stops owning its model.

It never decides residency; it only carries out load commands and watches its children. A
child whose model state is no longer its own (reaped, load timed out) is stopped.

A child that stalls — busy (a request on its processing list) with no progress
(``keys.progress``) for ``worker.stall_s`` — is killed, and its in-flight requests are answered
``model_stalled`` rather than requeued (the generation hung; it would hang the next process).

Three rules keep a host from being lost while it works:
- the heartbeat runs on its own thread, so nothing the loop does (a slow spawn, a stop) can let
  the worker record lapse and make the coordinator reap a host whose models still generate;
- stopping a child never blocks the loop: it is sent SIGTERM, watched, and killed after a grace;
- a command is moved to a processing list (``agent_taken``) when taken and removed only once
  acted on, so a crash in between re-drives it on restart; each carries the model's load token,
  and a command whose token no longer owns a ``loading`` state is dropped as stale.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

import redis

from residency import hosts, keys, ledger, procs, tracing, work
from residency.box import Box, ConfigStore
from residency.errors import ApiError, model_stalled
from residency.loops import Waker, blmove, run_until_stopped
from residency.lua import Scripts
from residency.messages import Event, EventType
from residency.settings import CACHE_DIR_ENV
from residency.states import OCCUPYING, ModelState
from workers import devices, kvstore
from workers.pull import PullRunner

log = logging.getLogger("residency.agent")

HEARTBEAT_S = 2.0
COMMAND_WAIT_S = 0.5
STOP_GRACE_S = 10.0
CACHE_SWEEP_S = 60.0  # how often the slot cache folder is swept of stale entries anyway
EXIT_GRACE_S = 5.0  # a process that committed its unload gets this long to exit by itself


@dataclass
class Child:
    model: str
    token: str
    device: str
    proc: subprocess.Popen[bytes]
    stop_sent_at: float = 0.0
    disowned_at: float = 0.0
    # Stall watchdog: the progress value last seen while busy, and when (agent's clock) it was
    # first seen; ``stalled`` is the error its in-flight requests get once it was killed.
    progress: str | None = None
    progress_seen_at: float = 0.0
    stalled: ApiError | None = None

    @property
    def stop_requested(self) -> bool:
        """Whether the agent asked it to stop (its exit is then no crash)."""
        return self.stop_sent_at > 0.0


class Agent:
    def __init__(
        self,
        box: Box,
        r: redis.Redis,
        *,
        host: str | None = None,
        device_list: list[str] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.box = box
        self.r = r
        self.scripts = Scripts(r)
        # RESIDENCY_HOST (default: the host name), validated: it names this host's keys.
        self.host = hosts.check(host) if host is not None else hosts.host_id(box.environ)
        self.devices = device_list or devices.discover(dict(box.environ))
        self.stop = stop or threading.Event()
        # What each device may hold in loaded models (bytes; None: no byte limit), reported with
        # every heartbeat: the coordinator places a load only where its bytes fit.
        ws = box.base_settings().worker
        self.budgets = ledger.budgets(
            devices.device_totals(self.devices), ws.device_budget_mb, ws.memory_reserve_mb
        )
        self.waker: Waker | None = None  # set by run(): a stop unblocks the command read
        self.tracing = tracing.setup("agent")
        self.children: dict[str, Child] = {}
        # Guards ``children`` between the loop (which changes it) and the heartbeat thread
        # (which reports it).
        self._lock = threading.Lock()
        # A load command for a model whose older process is still stopping: started once that
        # process has exited (model -> raw command, still on the taken list).
        self.deferred: dict[str, str] = {}
        self.unacked: list[str] = []  # taken commands not yet handled, oldest first
        self._beat_error = False
        # One warm process per device, already started and with llama.cpp imported, takes the
        # next load on that device: a load then costs the model's own load time only.
        self.use_standby = box.base_settings().worker.standby_process
        self.standbys: dict[str, Child] = {}
        # worker.stall_s is live: re-read when the admin config generation or the config file
        # changes (see _stall_s).
        self._stall_s = box.base_settings().worker.stall_s
        self._stall_source: tuple[int, tuple[int, int, int] | None] | None = None
        # The host's saved slot caches: the folder its model processes write, and when they
        # were last swept of what a clear made stale (see slot_cache_usage).
        self.cache_dir = box.slot_cache_dir(box.base_settings())
        self._cache_epochs: dict[str, int] | None = None
        self._cache_swept = 0.0
        # Model files the admin pulls onto this host: downloaded on a thread of their own.
        self.puller = PullRunner(box, r, self.host, self.stop)

    # -- registration -----------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Renew the worker record. ``children`` lists the model processes this agent runs as
        {model: load token}; ``children_at`` is taken before that list is read, so a model
        committed before ``children_at`` whose token is missing has no process here (the
        coordinator reaps such a state)."""
        now = time.time()
        with self._lock:
            children = {m: c.token for m, c in self.children.items()}
        cache = self.slot_cache_usage()
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            keys.worker(self.host),
            mapping={
                "devices": json.dumps(self.devices),
                "memory_total": devices.memory_total(),
                "memory": json.dumps(devices.memory_used(self.devices, self._pressure())),
                "budgets": json.dumps(self.budgets, sort_keys=True),
                "pid": os.getpid(),
                "last_heartbeat": now,
                "children": json.dumps(children, sort_keys=True),
                "children_at": now,
                "slot_cache": json.dumps(cache, sort_keys=True),
            },
        )
        pipe.expire(keys.worker(self.host), keys.WORKER_TTL_S)
        pipe.sadd(keys.workers(), self.host)
        # Outlives the record: a gone host is listed with it until worker.forget_after_s.
        pipe.hset(keys.hosts_seen(), self.host, now)
        pipe.execute()

    def slot_cache_usage(self) -> dict[str, Any]:
        """The host's slot cache folder, its entries and bytes, after deleting what a clear
        made stale (the admin API bumps the clear epochs in Redis; it cannot reach this disk):
        swept when the epochs moved, and every CACHE_SWEEP_S for entries a process loaded
        before the clear saved after it."""
        raw = cast(dict[str, str], self.r.hgetall(keys.kvcache_epochs()))
        epochs = {str(k): int(v) for k, v in raw.items()}
        now = time.monotonic()
        if epochs != self._cache_epochs or now - self._cache_swept >= CACHE_SWEEP_S:
            self._cache_epochs, self._cache_swept = epochs, now
            n = kvstore.purge_cleared(self.cache_dir, epochs)
            if n:
                log.info("slot cache: %d cleared entr%s deleted", n, "y" if n == 1 else "ies")
        entries, size = kvstore.usage(self.cache_dir)
        return {"dir": str(self.cache_dir), "entries": entries, "bytes": size}

    def beat_until_stopped(self) -> None:
        """The heartbeat thread: every HEARTBEAT_S until the stop, whatever the loop is doing.
        A Redis outage is logged once; beats resume when Redis is back."""
        while not self.stop.wait(HEARTBEAT_S):
            try:
                self.heartbeat()
            except redis.RedisError as e:
                if not self._beat_error:
                    log.error("heartbeat failed (%s); retrying every %.0fs", e, HEARTBEAT_S)
                self._beat_error = True
            else:
                if self._beat_error:
                    log.info("heartbeat restored")
                self._beat_error = False

    def _pressure(self) -> float | None:
        """The ``memory_pressure`` fault (written only when fault injection is enabled)."""
        raw = cast(str | None, self.r.hget(keys.faults(), "memory_pressure"))
        return float(raw) if raw else None

    def reconcile_on_start(self) -> None:
        """After a restart: commands the previous agent took but had not finished go back to the
        front of the command list (in order). Models this host held have lost their processes
        (they die with their parent): give their work back and free their slots — except a
        load whose command is still pending, which runs next."""
        while self.r.lmove(
            keys.agent_taken(self.host), keys.agent_commands(self.host), "RIGHT", "LEFT"
        ):
            pass
        # The states first, then the pending commands: a coordinator may place a load here at
        # any moment (the previous agent's record has not expired), and it writes the loading
        # state and its command in one script. Read in this order, a load placed between the
        # two reads is either not seen loading or seen with its command; read the other way, it
        # was seen loading without its command and released ("agent restarted").
        names = sorted(cast(set[str], self.r.smembers(keys.models_with_state())))
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.model(name))
        states = cast(list[dict[str, str]], pipe.execute())
        pending = set()
        for raw in cast(list[str], self.r.lrange(keys.agent_commands(self.host), 0, -1)):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                pending.add(json.loads(raw)["token"])
        for name, h in zip(names, states, strict=True):
            if h.get("host") != self.host:
                continue
            state = ModelState(h.get("state", "unloaded"))
            if state is ModelState.LOADING and h.get("token") in pending:
                continue
            if state in OCCUPYING:
                self._release(name, h.get("token", ""), "agent restarted")

    # -- loop -------------------------------------------------------------------------------

    def run(self) -> None:
        log.info("agent on %s with devices %s", self.host, self.devices)
        self.heartbeat()
        self.reconcile_on_start()
        self.r.rpush(
            keys.events(), json.dumps(Event(EventType.WORKER, "", {"host": self.host}).to_dict())
        )
        beat = threading.Thread(target=self.beat_until_stopped, name="heartbeat", daemon=True)
        beat.start()
        pulls = threading.Thread(target=self.puller.run, name="pulls", daemon=True)
        pulls.start()
        self.waker = Waker(self.r, self.stop)
        try:
            run_until_stopped(self.stop, self.iteration, log, "agent loop")
        finally:
            beat.join(timeout=10)  # before deregistering: a late beat would re-register
            pulls.join(timeout=10)
            self.shutdown()
            self.waker.close()

    def iteration(self) -> None:
        with self.waker.reading() if self.waker else contextlib.nullcontext(self.r) as blocking:
            raw = blmove(
                blocking,
                keys.agent_commands(self.host),
                keys.agent_taken(self.host),
                COMMAND_WAIT_S,
                "LEFT",
                "RIGHT",
            )
        if raw is not None:
            self.unacked.append(raw)
        # A command whose handling failed (a Redis error) stays first in line and is tried
        # again: it is still on the taken list, and nothing else would re-drive it while this
        # agent lives.
        while self.unacked:
            self.handle(self.unacked[0])
            self.unacked.pop(0)
        self.watch_children()

    def ack(self, raw: str) -> None:
        """The command is carried out (or dropped): off the taken list."""
        self.r.lrem(keys.agent_taken(self.host), 1, raw)

    def handle(self, raw: str) -> None:
        try:
            cmd = json.loads(raw)
            model, token, device = cmd["model"], cmd["token"], cmd["device"]
        except (ValueError, KeyError, TypeError):
            log.error("dropping malformed command %r", raw)
            self.ack(raw)
            return
        if cmd.get("op") != "load":
            log.error("unknown command %r", cmd.get("op"))
            self.ack(raw)
            return
        state, cur, host = cast(
            list[str | None], self.r.hmget(keys.model(model), ["state", "token", "host"])
        )
        if state != ModelState.LOADING.value or cur != token or host != self.host:
            # Written for a load that was since reaped, failed or replaced (e.g. while this
            # agent was down): running it now would load a model nobody waits for.
            log.info("dropping stale load command for %s (state %s)", model, state)
            self.ack(raw)
            return
        old = self.children.get(model)
        if old is not None and old.token == token:
            self.ack(raw)  # started already; only its acknowledgement was lost
            return
        if old is not None and old.proc.poll() is None:
            # An older process of this model still runs (its state was taken from it): stop
            # it, and start the new one once it has exited, so one model never has two
            # processes — without blocking this loop meanwhile.
            self._request_stop(old)
            self.deferred[model] = raw
            return
        self.start(model, token, device, raw)
        self.ack(raw)

    def start(self, model: str, token: str, device: str, raw: str) -> None:
        if not self.tracing.on:
            self._start(model, token, device, raw)
            return
        try:
            cmd = json.loads(raw)
            parent = str(cmd.get("trace", ""))
        except ValueError:
            cmd, parent = None, ""
        span = self.tracing.start(
            "load command",
            parent=parent,
            attributes={
                "residency.model": model,
                "residency.host": self.host,
                "residency.device": device,
            },
        )
        try:
            # The model process's load span is this one's child: the command it is given (not
            # ``raw``, which stays the taken list's item) carries this span's context.
            if isinstance(cmd, dict):
                cmd["trace"] = tracing.traceparent(span)
                raw = json.dumps(cmd)
            warm = self._start(model, token, device, raw)
            span.set_attribute("residency.warm", warm)
        finally:
            span.end()

    def _start(self, model: str, token: str, device: str, raw: str) -> bool:
        """Start ``model``'s process (a warm standby's when there is one: True)."""
        # The child is on the reported list before it can commit its load (see heartbeat).
        warm = self.standbys.pop(device, None)
        if warm is not None and warm.proc.poll() is None:
            with self._lock:
                self.children[model] = Child(model, token, device, warm.proc)
            self.r.rpush(keys.standby(self.host, warm.token), raw)
            log.info("%s goes to the warm process %d on %s", model, warm.proc.pid, device)
            return True
        proc = self._spawn(device, "--command", raw)
        with self._lock:
            self.children[model] = Child(model, token, device, proc)
        log.info("spawned %s (pid %d) on %s", model, proc.pid, device)
        return False

    def _spawn(self, device: str, *args: str) -> subprocess.Popen[bytes]:
        """A model process pinned to ``device`` (one GPU visible, or the device's CPU cores)."""
        cores = devices.cpu_affinity(device)
        env = devices.child_env(device, dict(os.environ))
        # The model process reads the live [cache] settings as this agent does, and saves its
        # slots into this host's folder.
        env.update(self.box.child_environ())
        # Traced as this agent is (the collector, its headers, the sampler), as its own service.
        env.update(tracing.child_environ(os.environ))
        env[CACHE_DIR_ENV] = str(self.cache_dir)
        env["RESIDENCY_REDIS_URL"] = self.box.redis_url or ""
        preexec = procs.die_with_parent()

        def _preexec() -> None:
            preexec()
            if cores:
                os.sched_setaffinity(0, cores)

        return subprocess.Popen(
            [sys.executable, "-m", "workers.model_process", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=_preexec,
        )

    def replenish_standbys(self, loading: bool, busy_devices: set[str]) -> None:
        """Start a warm process for each device that lacks one — but not while a load runs,
        nor on a device whose models are generating: the standby's start-up (importing
        llama.cpp, initializing its backend) takes a core, and on a small machine it would slow
        the load it is meant to speed up, or the tokens of the model just loaded."""
        for device, c in list(self.standbys.items()):
            if c.proc.poll() is not None:
                del self.standbys[device]
        if not self.use_standby or loading:
            return
        for device in self.devices:
            if device not in self.standbys and device not in busy_devices:
                ident = uuid.uuid4().hex
                proc = self._spawn(device, "--standby", keys.standby(self.host, ident))
                self.standbys[device] = Child("", ident, device, proc)

    def watch_children(self) -> None:
        names = list(self.children)
        pipe = self.r.pipeline(transaction=False)
        pipe.get(keys.config_generation())
        for n in names:
            pipe.hmget(keys.model(n), ["state", "token"])
            pipe.llen(keys.processing(n))
            pipe.get(keys.progress(n))
        res = pipe.execute()
        stall_s = self.stall_s(int(res[0] or 0))
        rows = [res[1 + 3 * i : 4 + 3 * i] for i in range(len(names))]
        busy_devices = {
            self.children[n].device for n, (_, busy, _) in zip(names, rows, strict=True) if busy
        }
        self.replenish_standbys(
            any(s == ModelState.LOADING.value for (s, _), _, _ in rows), busy_devices
        )
        for n, ((state, token), busy, progress) in zip(names, rows, strict=True):
            c = self.children[n]
            code = c.proc.poll()
            if code is not None:
                # Released before it is forgotten: should Redis fail in between, the next watch
                # sees the exit again and retries (a forgotten child would strand its state).
                crashed = code != 0 and not c.stop_requested
                self._release(n, c.token, procs.exit_reason(code), crashed=crashed, fail=c.stalled)
                with self._lock:
                    del self.children[n]
                raw = self.deferred.pop(n, None)
                if raw is not None:
                    self.handle(raw)
                continue
            if token == c.token and state in (s.value for s in OCCUPYING):
                if stalled(c, bool(busy), progress, stall_s, time.monotonic()):
                    log.error(
                        "%s (pid %d) busy with no progress for %gs; killing it",
                        n,
                        c.proc.pid,
                        stall_s,
                    )
                    c.stalled = model_stalled(n, stall_s)
                    c.stop_sent_at = c.stop_sent_at or time.monotonic()
                    c.proc.kill()
                continue
            if token == c.token and state == ModelState.UNLOADED.value:
                # It committed its own unload and is exiting: give it time to do so.
                c.disowned_at = c.disowned_at or time.monotonic()
                if time.monotonic() - c.disowned_at < EXIT_GRACE_S:
                    continue
            if not c.stop_requested:
                log.warning("%s (pid %d) no longer owns its state; stopping it", n, c.proc.pid)
            self._request_stop(c)

    def stall_s(self, config_generation: int) -> float:
        """``worker.stall_s`` now: re-read when an admin change (the config generation) or the
        config file changed since it was last read; the last good value on a bad config."""
        source = (config_generation, _file_stamp(self.box.config_path))
        if source != self._stall_source:
            self._stall_source = source
            try:
                self._stall_s = ConfigStore(self.box, self.r).load()[0].worker.stall_s
            except ValueError as e:
                log.error("settings unreadable (%s); keeping stall_s=%g", e, self._stall_s)
        return self._stall_s

    def _request_stop(self, c: Child) -> None:
        """SIGTERM now, SIGKILL once the grace has passed (called again on each watch); never
        waits."""
        if not c.stop_sent_at:
            c.stop_sent_at = time.monotonic()
            c.proc.terminate()
        elif time.monotonic() - c.stop_sent_at > STOP_GRACE_S:
            c.proc.kill()

    def _release(
        self,
        model: str,
        token: str,
        reason: str,
        *,
        crashed: bool = False,
        fail: ApiError | None = None,
    ) -> None:
        """A process of ``model`` (load ``token``) is gone: free its state if it still held it
        and hand its in-flight requests back (``fail``: answer them with this error instead —
        the stall watchdog killed it)."""
        if fail is not None:
            reason = f"{reason}: {fail.message}"
        state, cur = cast(list[str | None], self.r.hmget(keys.model(model), ["state", "token"]))
        if cur != token or state is None:
            return  # someone else already took over
        if state in (ModelState.UNLOADED.value, ModelState.FAILED.value):
            # It committed its unload (nothing in flight then), or an earlier release moved
            # the state and failed before handing the work back: finish that.
            if self.r.llen(keys.processing(model)):
                work.hand_back(
                    self.r, self.scripts, model, reason, crashed=crashed, token=token, fail=fail
                )
            return
        dst = ModelState.FAILED if state == ModelState.LOADING.value else ModelState.UNLOADED
        ok, _ = self.scripts.transition(
            model,
            dst,
            token=token,
            fields={"error": reason, "pid": None, "host": None, "device": None},
        )
        if not ok:
            return
        if dst is ModelState.FAILED:
            # Before the hand-back's "gone" event: a pass that sees "gone" first could start a
            # new load whose queue the failure would then answer.
            self.r.rpush(
                keys.events(),
                json.dumps(
                    Event(EventType.LOAD_FAILED, model, {"token": token, "error": reason}).to_dict()
                ),
            )
        work.hand_back(self.r, self.scripts, model, reason, crashed=crashed, token=token, fail=fail)

    def shutdown(self) -> None:
        """Stop every model process (SIGTERM to all at once, SIGKILL after the grace period)
        and hand their work back, then deregister the host. Commands not yet carried out stay
        on the taken list for the next agent on this host."""
        for c in self.standbys.values():
            if c.proc.poll() is None:
                c.proc.terminate()
        children = list(self.children.values())
        for c in children:
            if c.proc.poll() is None:
                c.stop_sent_at = c.stop_sent_at or time.monotonic()
                c.proc.terminate()
        for c in [*self.standbys.values(), *children]:
            code = procs.terminate(c.proc, STOP_GRACE_S)
            if not c.model:
                continue
            try:
                self._release(c.model, c.token, f"stopped with {code}")
            except redis.RedisError as e:
                log.error("could not release %s: %s", c.model, e)
        self.standbys.clear()
        with self._lock:
            self.children.clear()
        with contextlib.suppress(redis.RedisError):
            self.r.delete(keys.worker(self.host))
        log.info("agent stopped")


def stalled(c: Child, busy: bool, progress: str | None, stall_s: float, now: float) -> bool:
    """Whether ``c`` has been busy with no new progress value for ``stall_s`` (0: never), at
    ``now`` (this agent's monotonic clock). Measured from when the agent first saw the current
    value while busy, so a request just taken after a long idle time is not mistaken for a
    stall, and the clocks of other processes never matter. Updates ``c``'s record of it."""
    if c.stalled is not None or c.stop_requested:
        return False
    if not busy:
        c.progress, c.progress_seen_at = None, 0.0
        return False
    # A value that expired (None) is not progress.
    if not c.progress_seen_at or (progress is not None and progress != c.progress):
        c.progress, c.progress_seen_at = progress, now
        return False
    return stall_s > 0 and now - c.progress_seen_at >= stall_s


def _file_stamp(path: os.PathLike[str] | str | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def main(box: Box, stop: threading.Event) -> None:
    Agent(box, box.redis(), stop=stop).run()
