"""OpenTelemetry traces: one trace per request, across web, the coordinator, the agent and the
model process.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set:
then ``setup`` returns ``OFF``, whose ``on`` is False, no SDK is imported and every call site
costs one attribute test. On, each role gets its own provider (``service.name`` =
``residency-<role>``, or ``$OTEL_SERVICE_NAME-<role>``), a batch processor and the OTLP/HTTP
exporter, both configured by the standard ``OTEL_*`` variables (sampler, batch delay,
headers...); the provider flushes at exit. Providers are per role rather than the global one
so that roles sharing a process (the tests run the coordinator and an agent as threads) still
report as themselves.

The context travels as a W3C ``traceparent`` string: in the queued request
(``Request.trace``), in the coordinator's load command, and from the agent to the model process
in the command it hands over.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
#: A traceparent is 55 characters; anything much longer is not one (read from Redis, where only
#: the box writes it, but bounded all the same before it is parsed).
MAX_TRACEPARENT = 128
_PROPAGATOR = TraceContextTextMapPropagator()

Span = trace.Span
SpanKind = trace.SpanKind


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return any(env.get(k) for k in ENDPOINT_VARS)


def child_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``OTEL_*`` variables a process this one starts must see to trace as it does (the
    model process's environment is otherwise an allow-list)."""
    return {k: v for k, v in environ.items() if k.startswith("OTEL_")}


class Tracing:
    """One role's tracer. ``on`` is False for ``OFF``: call sites test it before doing anything
    that costs (reading a traceparent from Redis, building attributes)."""

    def __init__(self, tracer: trace.Tracer, provider: TracerProvider | None = None) -> None:
        self.tracer = tracer
        self.provider = provider
        self.on = provider is not None

    def start(
        self,
        name: str,
        *,
        parent: str | Span | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[trace.SpanContext] = (),
        start_time: float | None = None,
    ) -> Span:
        """A span, child of ``parent`` (a traceparent string, a span, or None: the current
        context), linked to ``links``; ``start_time`` in epoch seconds (now when None)."""
        ctx = _context(parent)
        return self.tracer.start_span(
            name,
            context=ctx,
            kind=kind,
            attributes=_clean(attributes),
            links=[trace.Link(c) for c in links if c.is_valid],
            start_time=None if start_time is None else int(start_time * 1e9),
        )

    def flush(self) -> None:
        if self.provider is not None:
            self.provider.force_flush()


OFF = Tracing(trace.NoOpTracer())
_roles: dict[tuple[str, frozenset[tuple[str, str]]], Tracing] = {}
_lock = threading.Lock()
#: How many exporters this process made (the tests check that none is made while off).
exporters_made = 0


def setup(role: str, environ: Mapping[str, str] | None = None) -> Tracing:
    """The role's tracing: ``OFF`` unless an OTLP endpoint is set. One provider per role and
    ``OTEL_*`` environment in a process (a role started twice, as the tests do, shares it)."""
    env = os.environ if environ is None else environ
    if not enabled(env):
        return OFF
    key = (role, frozenset((k, v) for k, v in env.items() if k.startswith("OTEL_")))
    with _lock:
        got = _roles.get(key)
        if got is None:
            got = _roles[key] = _make(role, env)
        return got


def _make(role: str, env: Mapping[str, str]) -> Tracing:
    global exporters_made
    # Imported only when on: the SDK and the exporter (protobuf, requests) cost start-up time
    # and memory in every process otherwise.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = f"{env.get('OTEL_SERVICE_NAME') or 'residency'}-{role}"
    # The sampler (OTEL_TRACES_SAMPLER[_ARG]), the batch delay and queue (OTEL_BSP_*), the
    # endpoint, headers and timeout (OTEL_EXPORTER_OTLP_*) come from the environment.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    exporters_made += 1
    return Tracing(provider.get_tracer("residency"), provider)


def shutdown() -> None:
    """Flush and stop every provider of this process (also done at exit)."""
    with _lock:
        roles = list(_roles.values())
        _roles.clear()
    for t in roles:
        if t.provider is not None:
            t.provider.shutdown()


# -- carrying the context ---------------------------------------------------------------------


def inject(span: Span | None, carrier: dict[str, str] | None = None) -> dict[str, str]:
    """``carrier`` (a new dict when None) with the W3C ``traceparent`` of ``span`` (nothing when
    the span is None or not recording a valid context)."""
    out = {} if carrier is None else carrier
    if span is not None and span.get_span_context().is_valid:
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
    return out


def traceparent(span: Span | None) -> str:
    """``span``'s context as one ``traceparent`` string ("" when none): the propagator's format,
    written directly (on every traced request's path, at half the propagator's cost)."""
    if span is None:
        return ""
    sc = span.get_span_context()
    if not sc.is_valid:
        return ""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"


def extract(carrier: Mapping[str, str]) -> trace.SpanContext | None:
    """The span context a carrier's ``traceparent`` names (None when absent or malformed)."""
    raw = carrier.get("traceparent", "")
    if not isinstance(raw, str) or not raw or len(raw) > MAX_TRACEPARENT:
        return None
    sc = trace.get_current_span(_PROPAGATOR.extract({"traceparent": raw})).get_span_context()
    return sc if sc.is_valid else None


def span_context(tp: str) -> trace.SpanContext | None:
    """The span context of one ``traceparent`` string (None when empty or malformed)."""
    return extract({"traceparent": tp}) if tp else None


def _context(parent: str | Span | None) -> Context | None:
    if parent is None:
        return None  # the current context
    if isinstance(parent, str):
        sc = span_context(parent)
        # A new root when there is no valid parent: never the current context's span, which
        # in a role's loop is unrelated work.
        return trace.set_span_in_context(
            trace.NonRecordingSpan(sc) if sc is not None else trace.INVALID_SPAN
        )
    return trace.set_span_in_context(parent)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Attributes without the None values the SDK would warn about."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}
