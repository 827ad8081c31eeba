"""The worker agent: one per host. Registers the host, heartbeats, spawns one model process per
load command, and reports every process that exits or stops owning its model.

It never decides residency; it only carries out load commands and watches its children. A
child whose model state is no longer its own (reaped, load timed out) is stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import cast

import redis

from residency import keys, procs, work
from residency.box import Box
from residency.loops import Waker, run_until_stopped
from residency.lua import Scripts
from residency.messages import Event, EventType
from residency.states import OCCUPYING, ModelState
from workers import devices

log = logging.getLogger("residency.agent")

HEARTBEAT_S = 2.0
COMMAND_WAIT_S = 0.5
STOP_GRACE_S = 10.0
EXIT_GRACE_S = 5.0  # a process that committed its unload gets this long to exit by itself


@dataclass
class Child:
    model: str
    token: str
    device: str
    proc: subprocess.Popen[bytes]
    stop_sent_at: float = 0.0
    disowned_at: float = 0.0


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
        self.host = host or box.environ.get("RESIDENCY_HOST") or socket.gethostname()
        self.devices = device_list or devices.discover(dict(box.environ))
        self.stop = stop or threading.Event()
        self.waker: Waker | None = None  # set by run(): a stop unblocks the command read
        self.children: dict[str, Child] = {}
        # One warm process per device, already started and with llama.cpp imported, takes the
        # next load on that device: a load then costs the model's own load time only.
        self.use_standby = box.base_settings().worker.standby_process
        self.standbys: dict[str, Child] = {}
        self._last_beat = 0.0

    # -- registration -----------------------------------------------------------------------

    def heartbeat(self) -> None:
        now = time.time()
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            keys.worker(self.host),
            mapping={
                "devices": json.dumps(self.devices),
                "memory_total": devices.memory_total(),
                "memory": json.dumps(devices.memory_used(self.devices, self._pressure())),
                "pid": os.getpid(),
                "last_heartbeat": now,
            },
        )
        pipe.expire(keys.worker(self.host), keys.WORKER_TTL_S)
        pipe.sadd(keys.workers(), self.host)
        pipe.execute()
        self._last_beat = now

    def _pressure(self) -> float | None:
        """The ``memory_pressure`` fault (written only when fault injection is enabled)."""
        raw = cast(str | None, self.r.hget(keys.faults(), "memory_pressure"))
        return float(raw) if raw else None

    def reconcile_on_start(self) -> None:
        """Models this host held before the agent restarted have lost their processes (they die
        with their parent): give their work back and free their slots."""
        for k in self.r.scan_iter(match=keys.model_pattern(), count=1000):
            name = str(k).removeprefix(keys.model(""))
            h = cast(dict[str, str], self.r.hgetall(k))
            if h.get("host") == self.host and ModelState(h.get("state", "unloaded")) in OCCUPYING:
                self._release(name, h.get("token", ""), "agent restarted")

    # -- loop -------------------------------------------------------------------------------

    def run(self) -> None:
        log.info("agent on %s with devices %s", self.host, self.devices)
        self.heartbeat()
        self.reconcile_on_start()
        self.r.rpush(
            keys.events(), json.dumps(Event(EventType.WORKER, "", {"host": self.host}).to_dict())
        )
        self.waker = Waker(self.r, self.stop)
        try:
            run_until_stopped(self.stop, self.iteration, log, "agent loop")
        finally:
            self.shutdown()
            self.waker.close()

    def iteration(self) -> None:
        if time.time() - self._last_beat >= HEARTBEAT_S:
            self.heartbeat()
        with self.waker.reading() if self.waker else contextlib.nullcontext(self.r) as blocking:
            item = blocking.blpop([keys.agent_commands(self.host)], timeout=COMMAND_WAIT_S)
        if item is not None:
            self.handle(str(item[1]))
        self.watch_children()

    def handle(self, raw: str) -> None:
        try:
            cmd = json.loads(raw)
        except ValueError:
            log.error("dropping malformed command %r", raw)
            return
        if cmd.get("op") != "load":
            log.error("unknown command %r", cmd.get("op"))
            return
        model, token, device = cmd["model"], cmd["token"], cmd["device"]
        old = self.children.get(model)
        if old is not None and old.proc.poll() is None:
            # An older process of this model still runs (its state was taken from it): stop it
            # before the new one starts, so one model never has two processes.
            self._stop_child(old)
        warm = self.standbys.pop(device, None)
        if warm is not None and warm.proc.poll() is None:
            self.r.rpush(keys.standby(self.host, warm.token), raw)
            proc = warm.proc
            log.info("%s goes to the warm process %d on %s", model, proc.pid, device)
        else:
            proc = self._spawn(device, "--command", raw)
            log.info("spawned %s (pid %d) on %s", model, proc.pid, device)
        self.children[model] = Child(model, token, device, proc)

    def _spawn(self, device: str, *args: str) -> subprocess.Popen[bytes]:
        """A model process pinned to ``device`` (one GPU visible, or the device's CPU cores)."""
        cores = devices.cpu_affinity(device)
        env = devices.child_env(device, dict(os.environ))
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

    def replenish_standbys(self, loading: bool) -> None:
        """Start a warm process for each device that lacks one — but not while a load runs: on
        a small machine the standby's start-up would slow the load it is meant to speed up."""
        for device, c in list(self.standbys.items()):
            if c.proc.poll() is not None:
                del self.standbys[device]
        if not self.use_standby or loading:
            return
        for device in self.devices:
            if device not in self.standbys:
                ident = uuid.uuid4().hex
                proc = self._spawn(device, "--standby", keys.standby(self.host, ident))
                self.standbys[device] = Child("", ident, device, proc)

    def watch_children(self) -> None:
        names = list(self.children)
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hmget(keys.model(n), ["state", "token"])
        states = pipe.execute() if names else []
        self.replenish_standbys(any(s == ModelState.LOADING.value for s, _ in states))
        for n, (state, token) in zip(names, states, strict=True):
            c = self.children[n]
            code = c.proc.poll()
            if code is not None:
                del self.children[n]
                self._release(n, c.token, f"process exited with {code}")
                continue
            if token == c.token and state in (s.value for s in OCCUPYING):
                continue
            if token == c.token and state == ModelState.UNLOADED.value:
                # It committed its own unload and is exiting: give it time to do so.
                c.disowned_at = c.disowned_at or time.monotonic()
                if time.monotonic() - c.disowned_at < EXIT_GRACE_S:
                    continue
            if not c.stop_sent_at:
                log.warning("%s (pid %d) no longer owns its state; stopping it", n, c.proc.pid)
                c.stop_sent_at = time.monotonic()
                c.proc.terminate()
            elif time.monotonic() - c.stop_sent_at > STOP_GRACE_S:
                c.proc.kill()

    def _release(self, model: str, token: str, reason: str) -> None:
        """A process of ``model`` (load ``token``) is gone: free its state if it still held it
        and hand its in-flight requests back."""
        state, cur = cast(list[str | None], self.r.hmget(keys.model(model), ["state", "token"]))
        if cur != token or state in (None, ModelState.UNLOADED.value, ModelState.FAILED.value):
            return  # committed its unload, or someone else already took over
        dst = ModelState.FAILED if state == ModelState.LOADING.value else ModelState.UNLOADED
        ok, _ = self.scripts.transition(
            model,
            dst,
            token=token,
            fields={"error": reason, "pid": None, "host": None, "device": None},
        )
        if ok:
            work.hand_back(self.r, self.scripts, model, reason)
            if dst is ModelState.FAILED:
                self.r.rpush(
                    keys.events(),
                    json.dumps(Event(EventType.LOAD_FAILED, model, {"error": reason}).to_dict()),
                )

    def _stop_child(self, c: Child) -> None:
        code = procs.terminate(c.proc, STOP_GRACE_S)
        self._release(c.model, c.token, f"stopped with {code}")

    def shutdown(self) -> None:
        """Stop every model process (SIGTERM, then SIGKILL after the grace period) and hand
        their work back, then deregister the host."""
        for c in self.standbys.values():
            procs.terminate(c.proc, STOP_GRACE_S)
        self.standbys.clear()
        children = list(self.children.values())
        for c in children:
            if c.proc.poll() is None:
                c.proc.terminate()
        for c in children:
            try:
                self._stop_child(c)
            except redis.RedisError as e:
                log.error("could not release %s: %s", c.model, e)
        self.children.clear()
        with contextlib.suppress(redis.RedisError):
            self.r.delete(keys.worker(self.host))
        log.info("agent stopped")


def main(box: Box, stop: threading.Event) -> None:
    Agent(box, box.redis(), stop=stop).run()
