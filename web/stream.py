"""The one stream renderer every API shares: a generation's batches of chat (or completion)
chunks out as server-sent events, in whichever dialect the API speaks.

What is the same for every dialect lives here: the first batch is pulled before answering, so
that an error before any output (queue full, load failed, timeout) reaches the client as a
proper HTTP status — unless the wait outlasts the keep-alive interval: then the stream has
started, and an error after that comes as the dialect's error event. Each batch goes out in one
write (one HTTP chunk), the end of the stream with the last one. A stream that does not end
normally (its client left, or it failed) stops its generation (``abandon_on_exit``).

What differs is a ``Dialect``: the events it sends first, for a chunk, for a keep-alive, at the
end and for an error; and how it shows a waiting client its model's load (``ShowsLoading``:
``loading_text`` is what every dialect says of it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from typing import Any, Protocol

from flask import Response

from residency.errors import ApiError
from web import bus
from web.load_progress import Loading
from web.pipeline import SSE_HEADERS, abandon_on_exit

#: A comment line: clients ignore it, proxies with idle timeouts see traffic.
KEEPALIVE = ": keep-alive\n\n"


class Dialect(Protocol):
    """How one API writes a stream. ``end`` is called once, when the generation ended (its
    last batch, or a remote's stream that ended without one); ``fail`` instead of it, for an
    error after the stream started."""

    def start(self) -> str: ...

    def chunk(self, chunk: Mapping[str, Any]) -> str: ...

    def keepalive(self) -> str: ...

    def end(self) -> str: ...

    def fail(self, error: ApiError) -> str: ...


class ShowsLoading(Protocol):
    """A dialect that shows its waiting client the load of its model (``loading``); any other
    gets a keep-alive for each step instead."""

    def loading(self, step: Loading) -> str: ...


def loading_text(step: Loading) -> str:
    """What a client is told of a load it waits for: ``loading MODEL 40%``."""
    return f"loading {step.model} {step.percent}%"


def loading_comment(step: Loading) -> str:
    """A load's step as an SSE comment line (clients ignore it; a person reading the stream,
    or a client that shows comments, sees it)."""
    return f": {loading_text(step)}\n\n"


def loading_event(step: Loading, dialect: Dialect) -> str:
    """A load's step in ``dialect``: what its ``loading`` writes, or a keep-alive."""
    show = getattr(dialect, "loading", None)
    return str(show(step)) if show is not None else dialect.keepalive()


def _rendered(c: Any, dialect: Dialect) -> str:
    if c is bus.KEEPALIVE:
        return dialect.keepalive()
    if isinstance(c, Loading):
        return loading_event(c, dialect)
    return dialect.chunk(c)


def render(batch: bus.Batch, dialect: Dialect) -> str:
    """A batch's chunks (not its end: ``response`` ends the stream once)."""
    return "".join(_rendered(c, dialect) for c in batch.chunks)


def response(
    batches: Iterator[bus.Batch],
    dialect: Dialect,
    on_abandon: Callable[[], None] | None,
    headers: Mapping[str, str],
) -> Response:
    """The streamed answer for ``batches`` in ``dialect``."""
    first = next(batches, None)

    def events() -> Iterator[str]:
        out = dialect.start()  # goes out with the first batch
        ended = False
        try:
            for b in [] if first is None else chain([first], batches):
                out += render(b, dialect)
                if b.last:
                    out += dialect.end()
                    ended = True
                yield out
                out = ""
            if not ended:
                out += dialect.end()
        except ApiError as e:
            out += dialect.fail(e)
        if out:
            yield out

    body = abandon_on_exit(events(), batches, on_abandon)
    return Response(body, mimetype="text/event-stream", headers={**SSE_HEADERS, **headers})
