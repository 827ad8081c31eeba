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
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import redis
from rq import Queue, Retry, SimpleWorker, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.timeouts import TimerDeathPenalty
from rq.worker import WorkerStatus

from residency import keys
from residency.loops import run_until_stopped
from residency.messages import Event, EventType

log = logging.getLogger("residency.coordinator")

#: Seconds between attempts; the last one repeats.
BACKOFF_S = (1, 2, 4, 8, 16, 30)
#: Attempts before rq gives the job up; the next pass that still finds the pool blocked
#: defers again with a fresh job.
MAX_ATTEMPTS = 100
TICK_S = 0.25
PENDING = (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.STARTED, JobStatus.DEFERRED)


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
    """A client for rq on the same server as ``r``: rq stores pickled bytes, so it needs a
    connection that does not decode replies (residency's clients do)."""
    pool = r.connection_pool
    kwargs = {**pool.connection_kwargs, "decode_responses": False}
    return redis.Redis(connection_pool=redis.ConnectionPool(pool.connection_class, **kwargs))


def queue(r: redis.Redis) -> Queue:
    """The retry queue; ``r`` must be a :func:`connection` client."""
    return Queue(keys.RETRY_QUEUE, connection=r)


def _job(r: redis.Redis) -> Job | None:
    try:
        return Job.fetch(keys.SHRINK_JOB_ID, connection=r)
    except NoSuchJobError:
        return None


def defer(r: redis.Redis, blocked: dict[str, int]) -> bool:
    """Make sure a deferred-shrink job is pending; True when this call created it."""
    job = _job(r)
    if job is not None and job.get_status(refresh=True) in PENDING:
        return False
    if job is not None:
        job.delete()  # a finished or given-up attempt of an earlier deferral
    queue(r).enqueue_in(
        timedelta(seconds=BACKOFF_S[0]),
        deferred_shrink,
        job_id=keys.SHRINK_JOB_ID,
        retry=Retry(max=MAX_ATTEMPTS, interval=list(BACKOFF_S)),
        description=f"deferred shrink {blocked}",
        failure_ttl=3600,
        result_ttl=600,
    )
    log.info("shrink deferred (%s over the limit, all busy or pinned): retry job queued", blocked)
    return True


def settle(r: redis.Redis) -> bool:
    """The pools are within their limits: drop the pending job. True when there was one."""
    job = _job(r)
    if job is None:
        return False
    pending = job.get_status(refresh=True) in PENDING
    job.delete()
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
            _ThreadWorker([q], connection=r).work(burst=True, with_scheduler=True)

    run_until_stopped(stop, tick, log, "retry worker")
