"""Traces against real parts: a real OTLP/HTTP receiver (protobuf, decoded with the collector's
own message), the web app on a real socket, the coordinator and agent running, and the model
process a real subprocess that the agent spawned with the ``OTEL_*`` variables.

A request that waits for a load gives one connected trace: web's server and submit spans, the
coordinator's load decision, the agent's load command and the model process's load, and the
model process's request span with its queue wait, prefill and decode; every request that waited
for the load links to the load's span. Assertions are on ids, links, names and attributes,
never on times.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from residency import keys, tracing
from tests.conftest import Pool
from tests.integration.test_bounded_work import http_server
from tests.integration.test_pool import ADMIN

MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass
class Got:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    links: list[str]  # linked span ids
    attrs: dict[str, Any]


class Receiver:
    """``POST /v1/traces`` as an OTel collector takes it: the spans it was sent."""

    def __init__(self) -> None:
        self.spans: list[Got] = []
        self.posts = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = self.path == "/v1/traces"
                if ok:
                    outer.take(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, req: ExportTraceServiceRequest) -> None:
        got: list[Got] = []
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Got(
                            service=str(res.get("service.name")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            links=[lk.span_id.hex() for lk in s.links],
                            attrs={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.posts += 1
            self.spans.extend(got)

    def named(self, service: str, name: str) -> list[Got]:
        with self.lock:
            return [s for s in self.spans if s.service == service and s.name == name]

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join(10)


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rcv = Receiver()
    yield rcv
    rcv.close()


@pytest.fixture
def traced(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> Receiver:
    """Tracing on for every role this test starts (and, through the agent, its model
    processes): spans batched for 50 ms rather than the default 5 s."""
    for k in [*tracing.ENDPOINT_VARS, "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    return receiver


def post(port: int, model: str, out: list[requests.Response]) -> threading.Thread:
    def go() -> None:
        out.append(
            requests.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": model, "messages": MESSAGES, "max_tokens": 3},
                timeout=120,
            )
        )

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_a_request_that_waits_for_a_load_is_one_connected_trace(
    start_pool: Callable[..., Pool], traced: Receiver
) -> None:
    pool = start_pool(debug={"fault_injection": True})
    rcv = traced
    with http_server(pool) as port:
        admin = f"http://127.0.0.1:{port}/admin/faults"
        # The load is held until both requests are queued: both wait for it, one caused it.
        resp = requests.post(admin, json={"load_delay_s": {"a": 600}}, headers=ADMIN, timeout=30)
        assert resp.status_code == 200, resp.text
        replies: list[requests.Response] = []
        first = post(port, "a", replies)
        pool.wait_for(
            lambda: (
                pool.r.hget(keys.model("a"), "state") == "loading"
                and pool.r.llen(keys.queue("a")) == 1
            ),
            what="the first request queued, its load started",
        )
        second = post(port, "a", replies)
        pool.wait_for(lambda: pool.r.llen(keys.queue("a")) == 2, what="the second queued")
        resp = requests.post(admin, json={"load_delay_s": {"a": 0}}, headers=ADMIN, timeout=30)
        assert resp.status_code == 200, resp.text
        first.join(120)
        second.join(120)
        assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]

        pool.wait_for(
            lambda: (
                len(rcv.named("residency-model", "decode")) == 2
                and len(rcv.named("residency-web", "POST /v1/chat/completions")) == 2
                and len(rcv.named("residency-model", "load")) == 1
            ),
            what="every span exported",
        )

    servers = rcv.named("residency-web", "POST /v1/chat/completions")
    submits = rcv.named("residency-web", "submit")
    decision = rcv.named("residency-coordinator", "load decision")
    command = rcv.named("residency-agent", "load command")
    load = rcv.named("residency-model", "load")
    requests_ = rcv.named("residency-model", "request")
    assert len(submits) == 2 and len(decision) == 1 and len(command) == 1
    assert len(requests_) == 2

    by_id = {s.span_id: s for s in rcv.spans}
    # Web: a server span per request, its submit a child; the model process's request span a
    # child of the submit (the context travelled in the queued request).
    for srv in servers:
        assert srv.parent == ""  # a new trace per request
        assert srv.attrs["http.route"] == "/v1/chat/completions"
        assert srv.attrs["http.response.status_code"] == 200
        assert srv.attrs["residency.model"] == "a"
        assert srv.attrs["residency.user"] == "anon"
        (sub,) = [s for s in submits if s.parent == srv.span_id]
        assert sub.trace_id == srv.trace_id
        (req,) = [s for s in requests_ if s.parent == sub.span_id]
        assert req.trace_id == srv.trace_id
        assert req.attrs["residency.model"] == "a"
        assert req.attrs["residency.completion_tokens"] == 3
        assert req.attrs["residency.prompt_tokens"] > 0
        assert "residency.cached_tokens" in req.attrs
        assert req.attrs["residency.waited_for_load"] is True
        # Both waited for the one load: both link to its span.
        assert req.links == [load[0].span_id]
        kids = sorted(s.name for s in rcv.spans if s.parent == req.span_id)
        assert kids == ["decode", "prefill", "queue wait"]
        (prefill,) = [s for s in rcv.spans if s.parent == req.span_id and s.name == "prefill"]
        assert prefill.attrs["residency.prompt_tokens"] == req.attrs["residency.prompt_tokens"]

    # The load: the coordinator's decision in the trace of the request it was started for (the
    # first), the agent's command its child, the model process's load the command's child.
    cause = min(servers, key=lambda s: 0 if s.trace_id == decision[0].trace_id else 1)
    assert decision[0].trace_id == cause.trace_id
    assert by_id[decision[0].parent].name == "submit"
    assert by_id[decision[0].parent].trace_id == cause.trace_id
    assert decision[0].attrs["residency.model"] == "a"
    assert command[0].parent == decision[0].span_id
    assert command[0].trace_id == cause.trace_id
    assert load[0].parent == command[0].span_id
    assert load[0].trace_id == cause.trace_id
    assert load[0].attrs["residency.model"] == "a"
    other = [s for s in servers if s is not cause]
    assert len(other) == 1 and other[0].trace_id != cause.trace_id


def test_tracing_off_makes_no_exporter_and_sends_nothing(
    start_pool: Callable[..., Pool], receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The receiver is there, but nothing names it as the endpoint: tracing stays off.
    for k in tracing.ENDPOINT_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "box")  # alone, it turns nothing on
    made = tracing.exporters_made
    pool = start_pool()
    assert pool.coordinator.effects.tracing is tracing.OFF
    assert pool.agent.tracing is tracing.OFF
    assert isinstance(tracing.OFF.tracer, trace.NoOpTracer)
    with http_server(pool) as port:
        replies: list[requests.Response] = []
        post(port, "a", replies).join(120)
        assert [r.status_code for r in replies] == [200]
    assert tracing.exporters_made == made
    assert rcv_empty(receiver)


def rcv_empty(rcv: Receiver) -> bool:
    with rcv.lock:
        return rcv.posts == 0 and not rcv.spans
