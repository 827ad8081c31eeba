"""Messages that travel over Redis: requests, replies, events and commands.

All are JSON. Requests are queued whole (bounded by ``server.max_request_bytes``) so a model
process needs nothing else to serve one. Reply streams carry ``t`` (kind) and ``d`` (JSON).
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any


class Kind(enum.StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    # Scores of (query, document) pairs by a rerank model: params {"query", "documents"}; the
    # reply is {"scores": [one per document, in order], "usage": {...}} (web shapes the answer).
    RERANK = "rerank"
    # A chat request's prompt rendered and tokenized, nothing generated: the reply is
    # {"input_tokens": N} (the Anthropic API's count_tokens).
    TOKENIZE = "tokenize"


#: A chat param only web sets (validation passes on no such field from a client), taken out by
#: the model process: the answer then also says what the Anthropic API reports and OpenAI's
#: shape has no field for: the stop string that ended it (``stop_sequence`` in the choice of a
#: whole answer, or of a stream's last chunk) and, in a stream's first chunk, ``prompt_tokens``.
REPORT_PARAM = "_report"


@dataclass(frozen=True)
class Request:
    id: str
    kind: Kind
    model: str
    params: dict[str, Any]
    stream: bool
    submitted: float
    # How many times a model process died (unasked) while running this request: a request is
    # retried once after such a crash, and refused after the second (it may be what kills it).
    attempts: int = 0
    # Wall-clock time (like ``submitted``) by which it must be finished; 0 = no deadline.
    deadline: float = 0.0
    # Who asked ("" when the box does not know: no key required and none given): its usage is
    # counted under that name, and fair queueing takes turns between names.
    user: str = ""
    # The id of the API key it came with ("" when none): its tokens count towards that key's
    # daily quota too.
    key: str = ""
    # ``[cache] scope`` when web submitted it (``residency.settings.CACHE_SCOPES``): whose
    # cached prompt prefixes it may reuse. Stamped per request, so a change applies to the
    # next request without a reload.
    cache_scope: str = "user"
    # The weight of the caller's key when web submitted it: its share of the model's turns, of
    # its queue and of the model process's slots. Older JSON has none: 1.
    weight: float = 1.0
    # The W3C ``traceparent`` of web's submit span when tracing is on ("" when off, and in
    # older JSON): the model process's spans for it join the request's trace.
    trace: str = ""
    # Set by web for a request a router policy routed: ``{"policy", "rule", "predicted":
    # {"wait", "queue", "load", "room", "prefill"}}`` (seconds; no ``predicted`` when nothing
    # was predicted, e.g. for a remote). The model process records the prediction against the
    # wait it measured (``keys.route_samples``). Older JSON has none: {}.
    route: dict[str, Any] = field(default_factory=dict)

    def dumps(self) -> str:
        # ``id`` is the first field, written first: the Lua scripts read a queued request's id
        # from the start of its JSON (``request_id`` in _fair.lua) rather than decode it whole.
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str | bytes) -> Request:
        d = json.loads(raw)
        return cls(
            id=d["id"],
            kind=Kind(d["kind"]),
            model=d["model"],
            params=d["params"],
            stream=bool(d["stream"]),
            submitted=float(d["submitted"]),
            attempts=int(d.get("attempts", 0)),
            deadline=float(d.get("deadline", 0.0)),
            user=str(d.get("user", "")),
            key=str(d.get("key", "")),
            cache_scope=str(d.get("cache_scope", "user")),
            weight=float(d.get("weight", 1.0)),
            trace=str(d.get("trace", "")),
            route=dict(d.get("route") or {}),
        )


def new_request_id() -> str:
    return uuid.uuid4().hex


class ReplyType(enum.StrEnum):
    CHUNK = "chunk"  # one streamed piece (an OpenAI *.chunk object)
    DONE = "done"  # the end; for non-stream requests the whole response object
    ERROR = "error"  # an ApiError.to_reply() object; ends the reply


class EventType(enum.StrEnum):
    DEMAND = "demand"  # a request is queued for a model that is not ready
    READY = "ready"  # a model process finished loading
    LOAD_FAILED = "load_failed"
    IDLE = "idle"  # a model went from busy to idle
    UNLOADED = "unloaded"  # a model process committed its unload
    RESCUED = "rescued"  # a model process refused an unload because work arrived
    GONE = "gone"  # a model process died
    CONFIG = "config"  # settings, registry or pins changed
    WORKER = "worker"  # a worker agent registered
    RETRY = "retry"  # the deferred-shrink retry job asks for another pass


@dataclass(frozen=True)
class Event:
    type: EventType
    model: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type.value, "model": self.model, "data": self.data}

    @classmethod
    def loads(cls, raw: str | bytes) -> Event:
        d = json.loads(raw)
        return cls(EventType(d["type"]), d.get("model", ""), d.get("data") or {})
