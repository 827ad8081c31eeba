"""Carrying a trace's context: the traceparent in the queued request and the load command, and
tracing off by default."""

from __future__ import annotations

import json

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from residency import tracing
from residency.messages import Kind, Request
from workers import request_spans
from workers.timings import Timings


def on() -> tuple[tracing.Tracing, InMemorySpanExporter]:
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    return tracing.Tracing(provider.get_tracer("test"), provider), mem


def test_off_without_an_endpoint() -> None:
    made = tracing.exporters_made
    assert tracing.setup("web", {"OTEL_SERVICE_NAME": "x"}) is tracing.OFF
    assert not tracing.OFF.on
    assert isinstance(tracing.OFF.tracer, trace.NoOpTracer)
    # The no-op tracer's spans carry no context: nothing goes into a request.
    assert tracing.traceparent(tracing.OFF.start("x")) == ""
    assert tracing.exporters_made == made
    assert tracing.enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing.enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})


def test_a_traceparent_carries_the_span_and_a_child_joins_its_trace() -> None:
    tr, mem = on()
    parent = tr.start("submit")
    tp = tracing.traceparent(parent)
    assert tp.startswith("00-") and len(tp) == 55
    sc = tracing.span_context(tp)
    assert sc is not None
    assert (sc.trace_id, sc.span_id) == (
        parent.get_span_context().trace_id,
        parent.get_span_context().span_id,
    )
    child = tr.start("request", parent=tp)
    child.end()
    parent.end()
    (got_child, got_parent) = mem.get_finished_spans()
    assert got_child.context.trace_id == got_parent.context.trace_id
    assert got_child.parent is not None and got_child.parent.span_id == got_parent.context.span_id


def test_an_empty_or_bad_traceparent_starts_a_new_trace_not_the_current_one() -> None:
    tr, mem = on()
    outer = tr.start("unrelated loop work")
    with trace.use_span(outer, end_on_exit=True):
        for bad in ("", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "00-" + "a" * 200):
            tr.start("load decision", parent=bad).end()
    spans = [s for s in mem.get_finished_spans() if s.name == "load decision"]
    assert len(spans) == 4
    assert all(s.parent is None for s in spans)
    assert tracing.extract({"traceparent": "00-" + "a" * 200}) is None
    assert tracing.extract({}) is None


def test_the_request_carries_its_trace_and_old_messages_read_without_one() -> None:
    req = Request(
        "id1", Kind.CHAT, "a", {}, False, 1.0, trace="00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    )
    assert Request.loads(req.dumps()).trace == req.trace
    old = json.loads(req.dumps())
    del old["trace"]
    assert Request.loads(json.dumps(old)).trace == ""
    # The Lua scripts read a request's id from the start of its JSON.
    assert req.dumps().startswith('{"id":"id1"')


def test_only_otel_variables_go_to_a_child() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_BSP_SCHEDULE_DELAY": "5",
        "HOME": "/h",
    }
    assert tracing.child_environ(env) == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_BSP_SCHEDULE_DELAY": "5",
    }


def test_request_spans_link_the_load_only_for_a_request_queued_before_it() -> None:
    tr, mem = on()
    load = tr.start("load")
    load.end()
    lc = load.get_span_context()
    for name, submitted in (("waited", 5.0), ("after", 20.0)):
        submit = tr.start("submit")
        req = Request(
            name, Kind.CHAT, "a", {}, False, submitted, user="u1", trace=tracing.traceparent(submit)
        )
        timed = Timings(submitted, taken=submitted + 1)
        timed.first = submitted + 2
        request_spans.record(
            tr, req, timed, [7, 3, 2], model="a", slots=2, end=submitted + 3, load=lc, ready_at=10.0
        )
        submit.end()
    spans = mem.get_finished_spans()
    reqs = {s.attributes["residency.request_id"]: s for s in spans if s.name == "request"}
    assert [lk.context.span_id for lk in reqs["waited"].links] == [lc.span_id]
    assert list(reqs["after"].links) == []
    r = reqs["waited"]
    assert r.attributes["residency.user"] == "u1"
    assert (
        r.attributes["residency.prompt_tokens"],
        r.attributes["residency.completion_tokens"],
    ) == (7, 3)
    assert r.attributes["residency.cached_tokens"] == 2
    kids = sorted(
        s.name for s in spans if s.parent is not None and s.parent.span_id == r.context.span_id
    )
    assert kids == ["decode", "prefill", "queue wait"]
