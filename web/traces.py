"""Web's spans: one server span per HTTP request, and the submit span whose context the queued
request carries (``Request.trace``) to the model process.

Nothing is registered when tracing is off (``residency.tracing``): the app then runs exactly
the hooks it ran without it. A client's own ``traceparent`` header is not followed: a caller
must not choose what the box samples, nor hang its spans in another caller's trace; each
request's trace starts here.
"""

from __future__ import annotations

from typing import Any

from flask import Flask, Response, g, has_app_context, request
from opentelemetry import context as otel_context
from opentelemetry import trace

from residency import tracing

#: This process's web tracing (``tracing.OFF`` until ``install`` finds it on).
TRACING: tracing.Tracing = tracing.OFF


def install(app: Flask) -> None:
    global TRACING
    TRACING = tracing.setup("web")
    if not TRACING.on:
        return
    # First of the before-request hooks: the span covers the guard and authentication too.
    app.before_request_funcs.setdefault(None, []).insert(0, _begin)
    app.after_request(_status)
    app.teardown_request(_detach)


def _begin() -> None:
    rule = request.url_rule.rule if request.url_rule is not None else ""
    span = TRACING.start(
        f"{request.method} {rule or 'unmatched'}",
        parent="",  # a new trace (see the module's docstring)
        kind=trace.SpanKind.SERVER,
        attributes={"http.request.method": request.method, "http.route": rule or None},
    )
    g.trace_span = span
    g.trace_token = otel_context.attach(trace.set_span_in_context(span))


def _status(resp: Response) -> Response:
    span = g.get("trace_span")
    if span is None:
        return resp
    span.set_attribute("http.response.status_code", resp.status_code)
    if resp.status_code >= 500:
        span.set_status(trace.StatusCode.ERROR)
    # The model and user are known once the pipeline resolved them (not for every route).
    for attr, name in (("residency.model", "trace_model"), ("residency.user", "trace_user")):
        value = g.get(name)
        if value:
            span.set_attribute(attr, value)
    # A stream's span lasts until its body is sent (or its client left).
    resp.call_on_close(span.end)
    g.trace_span = None
    return resp


def _detach(_exc: BaseException | None) -> None:
    token = g.pop("trace_token", None)
    if token is not None:
        otel_context.detach(token)
    span = g.pop("trace_span", None)
    if span is not None:  # no response was made (an unhandled error): end it here
        span.end()


def submit_span(model: str, user: str) -> Any:
    """The submit span (None when off); its context goes with the request."""
    if not TRACING.on:
        return None
    if has_app_context():
        g.trace_model, g.trace_user = model, user
    return TRACING.start("submit", attributes={"residency.model": model, "residency.user": user})
