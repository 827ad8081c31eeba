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

from flask import Blueprint, Response, jsonify

from residency.errors import ApiError
from residency.messages import Kind
from web import bus, stream, validation
from web.body import read_json
from web.load_progress import Loading
from web.pipeline import Target, admitted, count_request, dispatch, headers, ignore
from web.responses_output import Events, Meta, from_chat, new_id
from web.responses_request import to_chat

bp = Blueprint("responses", __name__, url_prefix="/v1")


bp.after_request(count_request)


@bp.post("/responses")
def create_response() -> Any:
    return admitted(_create)


def _create() -> Any:
    body = read_json()
    tr = to_chat(body)
    ignore(tr.ignored)
    v = validation.validate_chat(tr.chat)
    d = dispatch(Kind.CHAT, "/chat/completions", v, tr.chat)
    t = d.target
    meta = Meta(new_id("resp"), int(time.time()), t.entry.name)
    if d.batches is not None:
        assert d.abandon is not None
        return _stream(meta, tr.echo, d.batches, d.abandon, t)
    assert d.result is not None
    return jsonify(from_chat(d.result, tr.echo, meta)), 200, headers(t)


def _sse(ev: Mapping[str, Any]) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n"


class _Events:
    """The Responses stream (``responses_output.Events``) as a ``stream.Dialect``: the
    response's opening events first; an error after that is an ``error`` event and
    ``response.failed``."""

    def __init__(self, meta: Meta, echo: Mapping[str, Any]) -> None:
        self._events = Events(meta, echo)

    def start(self) -> str:
        return "".join(map(_sse, self._events.start()))

    def chunk(self, chunk: Mapping[str, Any]) -> str:
        return "".join(map(_sse, self._events.feed(chunk)))

    def keepalive(self) -> str:
        return stream.KEEPALIVE

    def loading(self, step: Loading) -> str:
        return stream.loading_comment(step)

    def end(self) -> str:
        return "".join(map(_sse, self._events.finish()))

    def fail(self, error: ApiError) -> str:
        return "".join(map(_sse, self._events.fail(error.envelope()["error"])))


def _stream(
    meta: Meta,
    echo: Mapping[str, Any],
    batches: Iterator[bus.Batch],
    on_abandon: Callable[[], None],
    t: Target,
) -> Response:
    return stream.response(batches, _Events(meta, echo), on_abandon, headers(t))
