"""The OpenAI Responses API, ``POST /v1/responses`` (stateless), served on the chat pipeline.

A request is translated to a chat completions body (``web.responses_request``) and goes the
way a chat request goes: validated, resolved to a model or routed by a policy, admitted against
the in-flight cap and the caller's quotas, queued with fair turns (or forwarded to a remote
model's ``/chat/completions``), its usage counted. The chat answer is translated back
(``web.responses_output``): a whole Response object, or a stream of Responses events.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from flask import Blueprint, Response, g, jsonify, request

from residency.errors import ApiError
from residency.messages import Kind
from web import bus, validation
from web.body import read_json
from web.openai_api import (
    SSE_HEADERS,
    UNKNOWN_LABEL,
    Target,
    _admitted,
    _headers,
    abandon_on_exit,
    dispatch,
)
from web.responses_output import Events, Meta, from_chat, new_id
from web.responses_request import to_chat

bp = Blueprint("responses", __name__, url_prefix="/v1")


@bp.after_request
def _count(resp: Response) -> Response:
    if request.method == "POST":
        bus.REQUESTS.labels(g.get("model_label", UNKNOWN_LABEL), str(resp.status_code)).inc()
    return resp


@bp.post("/responses")
def create_response() -> Any:
    return _admitted(_create)


def _create() -> Any:
    body = read_json()
    tr = to_chat(body)
    v = validation.validate_chat(tr.chat)
    d = dispatch(Kind.CHAT, "/chat/completions", v, tr.chat)
    t = d.target
    meta = Meta(new_id("resp"), int(time.time()), t.entry.name)
    if d.batches is not None:
        assert d.abandon is not None
        return _stream(meta, tr.echo, d.batches, d.abandon, t)
    assert d.result is not None
    return jsonify(from_chat(d.result, tr.echo, meta)), 200, _headers(t)


def _sse(ev: Mapping[str, Any]) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n"


def _stream(
    meta: Meta,
    echo: Mapping[str, Any],
    batches: Iterator[bus.Batch],
    on_abandon: Callable[[], None],
    t: Target,
) -> Response:
    # As chat streams do: the first batch is pulled before answering, so that an error before
    # any output (queue full, load failed, timeout) reaches the client as an HTTP status; a
    # later one comes as an ``error`` event and ``response.failed``. Each batch of chat chunks
    # goes out in one write.
    first = next(batches, None)
    tr = Events(meta, echo)

    def render(b: bus.Batch) -> str:
        out = []
        for c in b.chunks:
            if c is bus.KEEPALIVE:
                # A comment line: clients ignore it, proxies with idle timeouts see traffic.
                out.append(": keep-alive\n\n")
            else:
                out += map(_sse, tr.feed(c))
        if b.last:
            out += map(_sse, tr.finish())
        return "".join(out)

    def events() -> Iterator[str]:
        head = "".join(map(_sse, tr.start()))
        try:
            yield head + (render(first) if first is not None else "")
            for b in batches:
                yield render(b)
            end = tr.finish()  # a remote's stream ends without a last batch
        except ApiError as e:
            end = tr.fail(e.envelope()["error"])
        if end:
            yield "".join(map(_sse, end))

    body = abandon_on_exit(events(), batches, on_abandon)
    return Response(body, mimetype="text/event-stream", headers=_headers(t, SSE_HEADERS))
