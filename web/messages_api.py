"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request is translated (``web.anthropic``) into a chat completions request and goes
the same way as one (``pipeline.dispatch`` inside ``pipeline.admitted``: resolution,
scopes, quotas, the in-flight cap, queues, policies, limits); its answer is translated back.
Errors on these paths use Anthropic's envelope, ``{"type": "error", "error": {...}}``.

count_tokens asks the model process for the tokens of the prompt the same request would give
the model (``Kind.TOKENIZE``: its chat template rendered with the messages and tools, then
tokenized; nothing is generated). It needs a model process: a model that is not loaded is
loaded for it, as for any request (a key that may not load gets 409).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import redis
from flask import Blueprint, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from residency.errors import ApiError
from residency.messages import REPORT_PARAM, Kind
from web import anthropic, bus, pipeline, stream, validation
from web.body import read_json, too_large
from web.load_progress import Loading
from web.responses import error_response  # Anthropic's envelope on these paths

log = logging.getLogger(__name__)

bp = Blueprint("anthropic", __name__, url_prefix="/v1")

PATH = "/chat/completions"  # where a remote model gets the translated request


@bp.errorhandler(ApiError)
def _api(e: ApiError) -> Response:
    return error_response(e)


@bp.errorhandler(RequestEntityTooLarge)
def _too_large(e: RequestEntityTooLarge) -> Response:
    return error_response(too_large(g.get("body_limit") or request.max_content_length or 0))


@bp.errorhandler(HTTPException)
def _http(e: HTTPException) -> Response:
    return error_response(ApiError(e.code or 500, e.description or e.name))


@bp.errorhandler(redis.ConnectionError)
@bp.errorhandler(redis.TimeoutError)
def _storage(e: redis.RedisError) -> Response:
    log.warning("Redis unavailable on %s %s: %s", request.method, request.path, e)
    return error_response(bus.storage_unavailable(e))


@bp.errorhandler(Exception)
def _internal(e: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(ApiError(500, "internal server error", type="server_error"))


bp.after_request(pipeline.count_request)


def _validated(
    body: dict[str, Any], *, count: bool = False
) -> tuple[dict[str, Any], validation.Validated]:
    """The chat completions body ``body`` stands for (what a remote upstream gets), and its
    validation (errors name the Messages fields)."""
    ignored: list[str] = []
    chat = anthropic.to_chat(body, count=count, ignored=ignored)
    pipeline.ignore(ignored)
    try:
        return chat, validation.validate_chat(chat)
    except ApiError as e:
        raise anthropic.renamed(e) from None


@bp.post("/messages")
def messages() -> Any:
    return pipeline.admitted(_messages)


def _messages() -> Any:
    body = read_json()
    chat, v = _validated(body)
    # The stop string that ended the answer and, in a stream, the prompt's tokens up front.
    v.params[REPORT_PARAM] = True
    d = pipeline.dispatch(Kind.CHAT, PATH, v, chat)
    model = v.model
    headers = pipeline.headers(d.target)
    if d.batches is not None:
        return _stream(d.batches, model, d.abandon, headers, d.target.show_loading)
    assert d.result is not None
    return jsonify(anthropic.to_message(d.result, model)), 200, headers


@bp.post("/messages/count_tokens")
def count_tokens() -> Any:
    return pipeline.admitted(_count_tokens)


def _count_tokens() -> Any:
    body = read_json()
    chat, v = _validated(body, count=True)
    d = pipeline.dispatch(Kind.CHAT, PATH, v, chat, submit_as=Kind.TOKENIZE)
    assert d.result is not None
    return jsonify({"input_tokens": int(d.result["input_tokens"])})


class _Events:
    """Anthropic's stream (``anthropic.StreamEvents``) as a ``stream.Dialect``: an error after
    the stream started is an ``error`` event, and the message ends there."""

    def __init__(self, model: str, show_loading: bool = False) -> None:
        self._events = anthropic.StreamEvents(model)
        self._show_loading = show_loading

    def start(self) -> str:
        return ""

    def chunk(self, chunk: Any) -> str:
        return "".join(map(anthropic.sse, self._events.feed(chunk)))

    def keepalive(self) -> str:
        if not self._events.started:
            return stream.KEEPALIVE  # message_start comes first, with the prompt's tokens
        return "".join(map(anthropic.sse, self._events.ping()))

    def loading(self, step: Loading) -> str:
        # The comment, a thinking delta with ``show_loading`` (it starts the message: nothing
        # comes before ``message_start`` but pings), and a ping, which Anthropic's clients
        # take at any point.
        out = stream.loading_comment(step)
        if self._show_loading:
            out += "".join(
                map(anthropic.sse, self._events.thought(stream.loading_text(step) + "\n"))
            )
        return out + "".join(map(anthropic.sse, self._events.ping()))

    def end(self) -> str:
        return "".join(map(anthropic.sse, self._events.end()))

    def fail(self, error: ApiError) -> str:
        return anthropic.sse(anthropic.error_body(error))


def _stream(
    batches: Iterator[bus.Batch],
    model: str,
    on_abandon: Callable[[], None] | None,
    headers: dict[str, str],
    show_loading: bool = False,
) -> Response:
    """Anthropic's events for a chat stream (see ``web.stream``)."""
    return stream.response(batches, _Events(model, show_loading), on_abandon, headers)
