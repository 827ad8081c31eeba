"""Deferred shrinks, retried with backoff on an rq queue.

When a pool is above its limit and every resident that could go is busy (or pinned), the
enforcement pass cannot finish. Two things bring it back: the busy -> idle event (sent by
``finish.lua`` while the idle watch is set), which re-runs the pass the moment a resident goes
idle, and this retry job, which re-runs it on a backoff schedule (1, 2, 4 … 30 s) in case the
edge is missed (a model process that died mid-request, a host that went away). The job is kept
in Redis by rq, so a deferred shrink survives a coordinator restart.

The job only asks: it pushes a ``retry`` event to the coordinator's inbox (the leader applies
every effect, fenced by its lease) and fails while the last published record still shows a pool
blocked, which makes rq schedule the next attempt. The leader deletes the job once a pass finds
every pool within its limit.

The rq worker runs in a thread of the coordinator process, in burst mode, only when a job is
queued or due (rq's scheduler, in burst mode, only moves jobs that are already due).

Jobs are stored as JSON (rq's ``JSONSerializer``) and name their function by import path: rq's
default, pickle, would run whatever code a job planted in Redis says when the worker loads it.
A job that is not JSON is never loaded: it fails, and is dropped from the queue.

The leader's writes here (queueing and dropping the job) commit in one MULTI under a WATCH of
the leader lease, only while its token still holds it (``_fenced``): a deposed leader neither
defers nor settles.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import redis
from redis.client import Pipeline
from rq import Queue, Retry, SimpleWorker, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty
from rq.worker import WorkerStatus

from residency import keys
from residency.loops import run_until_stopped
from residency.lua import NotLeader
from residency.messages import Event, EventType
from residency.redis_conn import pool_like

log = logging.getLogger("residency.coordinator")

#: Seconds between attempts; the last one repeats.
BACKOFF_S = (1, 2, 4, 8, 16, 30)
#: Attempts before rq gives the job up; the next pass that still finds the pool blocked
#: defers again with a fresh job.
MAX_ATTEMPTS = 100
TICK_S = 0.25
PENDING = (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.STARTED, JobStatus.DEFERRED)
#: The job's function, by import path (a JSON job names it; nothing is pickled).
JOB_FUNC = "coordinator.retry.deferred_shrink"
#: Attempts at a fenced write that our own lease renewal (a write to the watched key) aborted.
FENCE_ATTEMPTS = 5


class ShrinkStillDeferred(RuntimeError):
    """Raised by the job so rq retries it after the next backoff interval."""


def blocked_in(record: dict[str, Any]) -> dict[str, int]:
    enforcement = record.get("enforcement") or {}
    return dict(enforcement.get("blocked") or {})


def deferred_shrink() -> str:
    """The rq job: wake the leader for another pass; fail (→ retry with backoff) while the last
    published record still shows a pool over its limit."""
    job = get_current_job()
    assert job is not None
    r = job.connection
    raw = r.hget(keys.health(), "record")
    blocked = blocked_in(json.loads(raw)) if raw else {}
    if not blocked:
        return "converged"
    event = Event(EventType.RETRY, data={"attempt": job.retries_left}).to_dict()
    r.rpush(keys.events(), json.dumps(event))
    raise ShrinkStillDeferred(f"still above the limit: {blocked}")


def connection(r: redis.Redis) -> redis.Redis:
    """A client for rq on the same server as ``r``: rq stores compressed bytes (its job data is
    zlib'd JSON here), so it needs a connection that does not decode replies (residency's
    clients do)."""
    return redis.Redis(connection_pool=pool_like(r, decode_responses=False))


def queue(r: redis.Redis) -> Queue:
    """The retry queue; ``r`` must be a :func:`connection` client."""
    return Queue(keys.RETRY_QUEUE, connection=r, serializer=JSONSerializer)


def _job(r: redis.Redis) -> Job | None:
    try:
        return Job.fetch(keys.SHRINK_JOB_ID, connection=r, serializer=JSONSerializer)
    except NoSuchJobError:
        return None


def _fenced(r: redis.Redis, lease: str, write: Callable[[Pipeline], object]) -> None:
    """Commit the writes ``write`` queues on a pipeline in one MULTI, only while ``lease`` holds
    the leader lease: WATCH the lease, check its token, queue, EXEC. A change of the lease in
    between (another leader, or our own renewal touching the key) aborts the EXEC; an abort is
    retried after a fresh check. Raises NotLeader when the lease is not ours."""
    token = lease.encode()
    for _ in range(FENCE_ATTEMPTS):
        with r.pipeline() as pipe:
            try:
                pipe.watch(keys.leader())
                if pipe.get(keys.leader()) != token:
                    raise NotLeader("retry queue write refused: the lease is not ours")
                pipe.multi()
                write(pipe)
                pipe.execute()
                return
            except redis.WatchError:
                continue
    raise redis.WatchError(f"the leader lease kept changing for {FENCE_ATTEMPTS} attempts")


def defer(r: redis.Redis, blocked: dict[str, int], *, lease: str) -> bool:
    """Make sure a deferred-shrink job is pending; True when this call created it. Fenced by
    the leader's ``lease``."""
    job = _job(r)
    if job is not None and job.get_status(refresh=True) in PENDING:
        return False

    def write(pipe: Pipeline) -> None:
        if job is not None:
            job.delete(pipeline=pipe)  # a finished or given-up attempt of an earlier deferral
        queue(r).enqueue_in(
            timedelta(seconds=BACKOFF_S[0]),
            JOB_FUNC,
            job_id=keys.SHRINK_JOB_ID,
            retry=Retry(max=MAX_ATTEMPTS, interval=list(BACKOFF_S)),
            description=f"deferred shrink {blocked}",
            failure_ttl=3600,
            result_ttl=600,
            pipeline=pipe,
        )

    _fenced(r, lease, write)
    log.info("shrink deferred (%s over the limit, all busy or pinned): retry job queued", blocked)
    return True


def settle(r: redis.Redis, *, lease: str) -> bool:
    """The pools are within their limits: drop the pending job. True when there was one.
    Fenced by the leader's ``lease``."""
    job = _job(r)
    if job is None:
        return False
    pending = job.get_status(refresh=True) in PENDING
    _fenced(r, lease, lambda pipe: job.delete(pipeline=pipe))
    return pending


def pending(r: redis.Redis) -> bool:
    job = _job(r)
    return job is not None and job.get_status(refresh=True) in PENDING


class _ThreadWorker(SimpleWorker):
    """An rq SimpleWorker that can run in a thread: no signal handlers (the coordinator owns
    shutdown), a timer instead of SIGALRM for job timeouts, rq's log setup left alone."""

    death_penalty_class = TimerDeathPenalty

    def _install_signal_handlers(self) -> None:
        pass

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        self.register_birth()
        self.set_state(WorkerStatus.STARTED)

    def subscribe(self) -> None:
        pass

    def procline(self, message: str) -> None:
        pass


def _has_work(q: Queue) -> bool:
    if q.count:
        return True
    return bool(q.scheduled_job_registry.get_jobs_to_schedule(int(time.time())))


def run_worker(r: redis.Redis, stop: threading.Event) -> None:
    """Run due retry jobs until ``stop``: each tick, a burst worker if anything is due."""
    q = queue(r)
    for name in ("rq.worker", "rq.job", "rq.scheduler", "rq.queue"):
        # rq narrates every burst at INFO; residency logs what a job means instead.
        logging.getLogger(name).setLevel(logging.WARNING)

    def tick() -> None:
        if not stop.wait(TICK_S) and _has_work(q):
            _ThreadWorker([q], connection=r, serializer=JSONSerializer).work(
                burst=True, with_scheduler=True
            )

    run_until_stopped(stop, tick, log, "retry worker")
