"""The model process's spans of one request, written once it is answered (pure but for the
tracer): its time in its slot, in the trace web started (``Request.trace``), with children for
its wait in the queue, its prefill and its decode — from the ``Timings`` it was served with, so
the spans cost nothing while it generates. A request queued before this process's load was
committed waited for that load: its span links to the load's span."""

from __future__ import annotations

from opentelemetry import trace

from residency import tracing
from residency.messages import Request
from workers.timings import Timings


def record(
    tr: tracing.Tracing,
    req: Request,
    timed: Timings,
    usage: list[int],
    *,
    model: str,
    slots: int,
    end: float,
    load: trace.SpanContext | None = None,
    ready_at: float = 0.0,
    failed: bool = False,
) -> None:
    """``usage``: (prompt, completion, cached) tokens; ``load``: the span of the load that made
    this process ready at ``ready_at`` (epoch seconds); ``failed``: it was not answered in full."""
    prompt, completion, cached = usage if usage else (0, 0, 0)
    waited = load is not None and req.submitted < ready_at
    span = tr.start(
        "request",
        parent=req.trace,
        kind=trace.SpanKind.CONSUMER,
        start_time=timed.taken,
        links=[load] if waited and load is not None else (),
        attributes={
            "residency.model": model,
            "residency.user": req.user or "anon",
            "residency.request_id": req.id,
            "residency.kind": req.kind.value,
            "residency.stream": req.stream,
            "residency.slots": slots,
            "residency.waited_for_load": waited,
            "residency.prompt_tokens": prompt,
            "residency.cached_tokens": cached,
            "residency.completion_tokens": completion,
        },
    )
    if failed:  # answered with an error, or its client cancelled it
        span.set_status(trace.StatusCode.ERROR)
    # Web's clock stamped ``submitted``: another host's skew must not give a negative wait.
    submitted = min(req.submitted, timed.taken)
    # The children carry only their own figures: the model and user are their parent's.
    tr.start("queue wait", parent=span, start_time=submitted).end(_ns(timed.taken))
    first = timed.first if timed.first is not None else end
    tr.start(
        "prefill",
        parent=span,
        start_time=timed.taken,
        attributes={
            "residency.prompt_tokens": prompt,
            "residency.cached_tokens": cached,
        },
    ).end(_ns(first))
    if timed.first is not None:
        tr.start(
            "decode",
            parent=span,
            start_time=first,
            attributes={"residency.completion_tokens": completion},
        ).end(_ns(end))
    span.end(_ns(end))


def _ns(t: float) -> int:
    return int(t * 1e9)
