"""Chat answers translated to the Responses API: a whole chat completion to a Response object
(``from_chat``) and a chat stream to Responses events (``Events``). Pure: no Flask, no Redis.

A chat answer's text becomes one ``message`` output item with one ``output_text`` part, and
each tool call a ``function_call`` item (its ``call_id`` is the chat call's id, which the client
sends back in a ``function_call_output``). The model's reasoning (chat's ``reasoning_content``)
comes first, as a ``reasoning`` item with one ``reasoning_text`` part (its text whole: nothing
here summarizes), and its tokens are the usage's ``reasoning_tokens``. An answer cut by its
token limit (chat ``finish_reason`` ``length``) is ``incomplete`` with reason
``max_output_tokens``, and so is its last output item. A stream yields the same items, built
from the chunks as they come, and its last event carries the same Response a whole answer
would have been.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Meta:
    """What names one response: its id, when it was created (Unix seconds) and the model."""

    id: str
    created_at: int
    model: str


def usage(chat_usage: Any) -> dict[str, Any] | None:
    """A chat ``usage`` object in the Responses form."""
    if not isinstance(chat_usage, dict):
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": prompt,
        # cache_write_tokens: the official client's model requires it; llama.cpp's prompt
        # cache is not written on request, so none are counted as writes.
        "input_tokens_details": {
            "cached_tokens": int(details.get("cached_tokens") or 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens(chat_usage)},
        "total_tokens": prompt + completion,
    }


def reasoning_tokens(chat_usage: Mapping[str, Any]) -> int:
    """The reasoning tokens a chat usage reports (0 when it says nothing of them)."""
    details = chat_usage.get("completion_tokens_details")
    n = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def response_object(
    meta: Meta,
    echo: Mapping[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    out: dict[str, Any] = {
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "model": meta.model,
        "output": output,
        # OpenAI's schema types these as an object and a string, never null: a response
        # still in progress (or that failed before its usage was known), and a request
        # that named no user, leave them out.
        **({} if usage is None else {"usage": usage}),
        **{k: v for k, v in echo.items() if v is not None or k not in _NOT_NULLABLE},
    }
    return out


#: Fields the request repeats in the answer that OpenAI's Response has no null for.
_NOT_NULLABLE = frozenset({"user"})


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [_reasoning_part(text)],
        "status": status,
    }


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str) -> dict[str, Any]:
    # No logprobs are asked for in the Responses API here, but the part requires the list.
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _status(finish_reason: Any) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _mark_last(output: list[dict[str, Any]], status: str) -> None:
    if output and status == "incomplete":
        output[-1]["status"] = "incomplete"


def from_chat(chat: Mapping[str, Any], echo: Mapping[str, Any], meta: Meta) -> dict[str, Any]:
    """The Response object for a whole chat completion."""
    choices = chat.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    text = message.get("content")
    calls = message.get("tool_calls") or []
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        output.append(reasoning_item(new_id("rs"), reasoning, "completed"))
    if isinstance(text, str) and (text or not calls):
        output.append(message_item(new_id("msg"), text, "completed"))
    elif not calls:
        output.append(message_item(new_id("msg"), "", "completed"))
    for tc in calls:
        fn = tc.get("function") or {}
        call_id = tc.get("id") or new_id("call")
        output.append(
            call_item(
                new_id("fc"), call_id, fn.get("name", ""), fn.get("arguments", ""), "completed"
            )
        )
    status = _status(choice.get("finish_reason"))
    _mark_last(output, status)
    out = response_object(meta, echo, status=status, output=output, usage=usage(chat.get("usage")))
    return with_timings(out, chat.get("timings"))


def with_timings(response: dict[str, Any], timings: Any) -> dict[str, Any]:
    """The model process's ``timings`` of the request (queue, prompt and decode time, as
    llama-server names them), beside the usage: not OpenAI's, and ignored by its clients."""
    if isinstance(timings, dict):
        response["timings"] = timings
    return response


@dataclass
class _Item:
    """An output item being streamed: a message or a reasoning item (``text``), or a function
    call (its arguments in ``text``)."""

    item: dict[str, Any]
    index: int
    text: list[str] = field(default_factory=list)
    call_index: int | None = None  # the chat tool call's index, for a function call

    @property
    def kind(self) -> str:
        return str(self.item["type"])


class Events:
    """Responses stream events from chat chunks: ``start`` (created, in_progress), ``feed``
    for each chunk, then ``finish`` (the items' done events and completed or incomplete) or
    ``fail`` (error and failed). Each event carries its ``sequence_number``."""

    def __init__(self, meta: Meta, echo: Mapping[str, Any]) -> None:
        self.meta = meta
        self.echo = echo
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the items done so far
        self.open: _Item | None = None
        self.finish_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.ended = False
        self.answered = False  # a message or a function call was opened

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        out = response_object(
            self.meta,
            self.echo,
            status=status,
            output=[dict(o) for o in self.output],
            usage=self.usage if status != "in_progress" else None,
            error=error,
        )
        return with_timings(out, self.timings)

    def start(self) -> list[dict[str, Any]]:
        r = self._response("in_progress")
        return [
            self._event("response.created", response=r),
            self._event("response.in_progress", response=r),
        ]

    # --- items -----------------------------------------------------------------------------

    def _index(self) -> int:
        return len(self.output)

    def _open_message(self) -> list[dict[str, Any]]:
        it = _Item(message_item(new_id("msg"), "", "in_progress"), self._index())
        it.item["content"] = []
        self.open = it
        self.answered = True
        ids = {"item_id": it.item["id"], "output_index": it.index}
        return [
            self._event("response.output_item.added", output_index=it.index, item=dict(it.item)),
            self._event("response.content_part.added", **ids, content_index=0, part=_text_part("")),
        ]

    def _open_call(self, index: int, call_id: str, name: str) -> list[dict[str, Any]]:
        it = _Item(call_item(new_id("fc"), call_id, name, "", "in_progress"), self._index())
        it.call_index = index
        self.open = it
        self.answered = True
        return [
            self._event("response.output_item.added", output_index=it.index, item=dict(it.item))
        ]

    def _open_reasoning(self) -> list[dict[str, Any]]:
        it = _Item(reasoning_item(new_id("rs"), "", "in_progress"), self._index())
        it.item["content"] = []
        self.open = it
        ids = {"item_id": it.item["id"], "output_index": it.index}
        part = _reasoning_part("")
        return [
            self._event("response.output_item.added", output_index=it.index, item=dict(it.item)),
            self._event("response.content_part.added", **ids, content_index=0, part=part),
        ]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        it, self.open = self.open, None
        if it is None:
            return []
        ids = {"item_id": it.item["id"], "output_index": it.index}
        events = []
        if it.kind == "reasoning":
            text = "".join(it.text)
            part = _reasoning_part(text)
            events += [
                self._event("response.reasoning_text.done", **ids, content_index=0, text=text),
                self._event("response.content_part.done", **ids, content_index=0, part=part),
            ]
            done = reasoning_item(it.item["id"], text, status)
        elif it.kind == "message":
            text = "".join(it.text)
            events += [
                self._event(
                    "response.output_text.done", **ids, content_index=0, text=text, logprobs=[]
                ),
                self._event(
                    "response.content_part.done", **ids, content_index=0, part=_text_part(text)
                ),
            ]
            done = message_item(it.item["id"], text, status)
        else:
            args = "".join(it.text)
            i = it.item
            events.append(
                self._event(
                    "response.function_call_arguments.done", **ids, name=i["name"], arguments=args
                )
            )
            done = call_item(i["id"], i["call_id"], i["name"], args, status)
        self.output.append(done)
        events.append(self._event("response.output_item.done", output_index=it.index, item=done))
        return events

    def _reasoning(self, delta: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open.kind != "reasoning":
            events += self._close() + self._open_reasoning()
        assert self.open is not None
        self.open.text.append(delta)
        ids = {"item_id": self.open.item["id"], "output_index": self.open.index}
        events.append(
            self._event("response.reasoning_text.delta", **ids, content_index=0, delta=delta)
        )
        return events

    def _text(self, delta: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open.kind != "message":
            events += self._close() + self._open_message()
        assert self.open is not None
        self.open.text.append(delta)
        ids = {"item_id": self.open.item["id"], "output_index": self.open.index}
        events.append(
            self._event(
                "response.output_text.delta", **ids, content_index=0, delta=delta, logprobs=[]
            )
        )
        return events

    def _call(self, tc: Mapping[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = tc.get("index", 0)
        fn = tc.get("function") or {}
        if self.open is None or self.open.call_index != index:
            call_id = tc.get("id") or new_id("call")
            events += self._close() + self._open_call(index, call_id, fn.get("name") or "")
        assert self.open is not None
        args = fn.get("arguments")
        if args:
            self.open.text.append(args)
            ids = {"item_id": self.open.item["id"], "output_index": self.open.index}
            events.append(self._event("response.function_call_arguments.delta", **ids, delta=args))
        return events

    # --- the stream --------------------------------------------------------------------------

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat chunk."""
        if isinstance(chunk.get("usage"), dict):
            self.usage = usage(chunk["usage"])
        if isinstance(chunk.get("timings"), dict):
            self.timings = dict(chunk["timings"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content")
            if isinstance(thought, str) and thought:
                events += self._reasoning(thought)
            text = delta.get("content")
            if isinstance(text, str) and text:
                events += self._text(text)
            for tc in delta.get("tool_calls") or []:
                events += self._call(tc)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The chat stream ended: close the open item and end with the whole response."""
        if self.ended:
            return []
        self.ended = True
        status = _status(self.finish_reason)
        events: list[dict[str, Any]] = []
        if not self.answered:
            # No text and no call (perhaps only reasoning): an empty message, as a whole answer.
            events += self._close() + self._open_message()
        events += self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=self._response(status)))
        return events

    def fail(self, error: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The stream broke with ``error`` (an OpenAI error object): an ``error`` event, then
        ``response.failed`` with what was done so far."""
        if self.ended:
            return []
        self.ended = True
        self.open = None
        code = error.get("code") or error.get("type") or "server_error"
        message = str(error.get("message", "error"))
        # A Response's error code is one of OpenAI's few; the error event keeps ours.
        kind = _FAILED_CODES.get(str(error.get("type")), "server_error")
        return [
            self._event("error", code=code, message=message, param=error.get("param")),
            self._event(
                "response.failed",
                response=self._response("failed", {"code": kind, "message": message}),
            ),
        ]


_FAILED_CODES = {
    "rate_limit_error": "rate_limit_exceeded",
    "invalid_request_error": "invalid_prompt",
}
