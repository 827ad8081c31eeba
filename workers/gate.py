"""The bounds of a generation, checked on every generated token, and the thread that feeds
them.

A model process gives each request a ``Gate``; the runtime calls its ``step`` once per
generated token (streamed or not). ``step`` counts the token and raises ``Stopped`` when the
client went away (its cancel flag), the request's deadline passed, or — for a non-stream
request — the process is stopping. The engine thread calls its ``progress`` after every step
the request's slot took part in — a chunk of its prompt as much as a token — so a prompt that
takes longer to prefill than ``worker.stall_s`` is progress, not a stall. Neither costs a
Redis round trip: the ``Watcher`` thread reads the cancel flags of the running requests every
``POLL_S`` and sets their Events, and it writes the progress key (``keys.progress``) that the
agent's stall watchdog reads.
"""

from __future__ import annotations

import enum
import logging
import threading
import time

import redis

from residency import keys
from residency.loops import REDIS_DOWN

log = logging.getLogger("residency.model")

POLL_S = 0.05  # how often the watcher reads the current request's cancel flag
# At most this often a progress write while tokens advance. It rides in the pipeline of a
# cancel-flag read, so it costs no extra round trip; well under the smallest useful stall_s.
PROGRESS_EVERY_S = 0.25


class Reason(enum.StrEnum):
    CANCELLED = "cancelled"  # its client went away
    DEADLINE = "deadline"  # server.request_deadline_s passed
    SHUTDOWN = "shutdown"  # the process is stopping (non-stream only: the agent requeues it)


class Stopped(Exception):
    """Raised from ``Gate.step`` (inside the runtime's token loop) to end a generation."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class Gate:
    """One request's stop conditions. ``deadline`` is wall-clock time like the request's
    ``submitted`` (0: none); ``stop``, when given, ends the generation once set."""

    def __init__(
        self, request_id: str, deadline: float = 0.0, stop: threading.Event | None = None
    ) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.stop = stop
        self.cancelled = threading.Event()
        self.steps = 0
        self.engine_steps = 0  # engine steps its slot took part in (written by that thread)
        self.chunks_sent = 0  # a stream's chunks written so far (counted when it is cancelled)

    def expired(self) -> bool:
        return bool(self.deadline) and time.time() >= self.deadline

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Stopped(Reason.CANCELLED)
        if self.expired():
            raise Stopped(Reason.DEADLINE)
        if self.stop is not None and self.stop.is_set():
            raise Stopped(Reason.SHUTDOWN)

    def step(self) -> None:
        """One generated token (or, for the hold fault, one wait): progress, then the checks."""
        self.steps += 1
        self.check()

    def progress(self) -> None:
        """One engine step of its slot (a prompt chunk or a token): progress only. Called on
        the engine thread, so it does nothing else."""
        self.engine_steps += 1

    @property
    def moves(self) -> int:
        """Everything that counts as progress so far."""
        return self.steps + self.engine_steps


class Watcher:
    """The model process's watcher thread. While requests run it reads their cancel flags
    every POLL_S (one pipelined round trip for all of them) and, when a request is new or
    tokens advanced, writes the progress key — at most every PROGRESS_EVERY_S. Idle, it sends
    nothing."""

    def __init__(self, r: redis.Redis, model: str) -> None:
        self.r = r
        self.model = model
        self._gates: set[Gate] = set()
        self._lock = threading.Lock()
        self._any = threading.Event()  # set while a gate is watched: idle, the thread sleeps
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watcher", daemon=True)
        self._down = False

    def add(self, gate: Gate) -> None:
        with self._lock:
            self._gates.add(gate)
            self._any.set()

    def remove(self, gate: Gate) -> None:
        with self._lock:
            self._gates.discard(gate)
            if not self._gates:
                self._any.clear()

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        self._any.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        written: dict[Gate, int] = {}  # moves of each gate when progress was last written
        written_at = 0.0
        while not self._done.wait(POLL_S):
            with self._lock:
                gates = list(self._gates)
            if not gates:
                written.clear()
                self._any.wait()  # no wake-ups while the process is idle
                continue
            now = time.monotonic()
            new = any(g not in written for g in gates)
            moved = any(written.get(g) != g.moves for g in gates)
            due = new or (moved and now - written_at >= PROGRESS_EVERY_S)
            try:
                pipe = self.r.pipeline(transaction=False)
                for g in gates:
                    pipe.exists(keys.cancel(g.request_id))
                if due:
                    pipe.set(keys.progress(self.model), repr(time.time()), ex=keys.PROGRESS_TTL_S)
                flags = pipe.execute()
            except REDIS_DOWN as e:
                if not self._down:
                    log.warning("%s: watcher cannot reach Redis (%s)", self.model, e)
                self._down = True
                continue
            self._down = False
            for g, cancelled in zip(gates, flags, strict=False):
                if cancelled:
                    g.cancelled.set()
            if due:
                written = {g: g.moves for g in gates}
                written_at = now
