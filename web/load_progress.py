"""What a streaming request sees while its model loads: the load's progress, read from Redis
(``keys.load_progress``, written by the model process) while the request waits for its first
reply message.

Only a request that was resolved, scope-checked, admitted and queued for a model watches that
model (``web.pipeline.submit``), so the progress reveals a load only to those waiting for it. A
progress is shown only while the model's state is ``loading`` under the token the progress was
written for (one left by an earlier load never shows), and only when its whole percent grew:
a stream sees it in increasing order.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, cast

import redis

from residency import keys
from residency.states import ModelState

#: How often a request waiting for a loading model reads its progress; a model that is not
#: loading is looked at once per ``IDLE_POLL_S`` (the longest a queue read blocks anyway).
POLL_S = 0.25
IDLE_POLL_S = 1.0


@dataclass(frozen=True)
class Loading:
    """One step of a load a stream waits for: its model and how far it came (0-100)."""

    model: str
    percent: int


def parse(state: Any, token: Any, raw: Any) -> float | None:
    """The fraction a load came to, from the model's ``state`` and ``token`` and the raw
    progress value; None unless the model is loading under the progress's token."""
    if state != ModelState.LOADING or not raw or not token:
        return None
    try:
        data = json.loads(raw)
        fraction = float(data["fraction"])
    except (ValueError, TypeError, KeyError):
        return None
    if data.get("token") != token:
        return None
    return min(max(fraction, 0.0), 1.0)


class Watch:
    """The load progress one waiting request reads (``poll`` before each wait for a reply)."""

    def __init__(self, r: redis.Redis, model: str) -> None:
        self.r = r
        self.model = model
        self.loading = False  # the model was loading at the last read
        # A request answered at once (its model ready, a free slot) never reads it.
        self._next = time.monotonic() + POLL_S
        self._shown = -1

    def wait_s(self) -> float:
        """How long the request may wait for its reply before the next ``poll``."""
        return POLL_S if self.loading else IDLE_POLL_S

    def poll(self) -> Loading | None:
        """A new step of the load to show, if one is due and the load went further."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.wait_s() * 0.9
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.hmget(keys.model(self.model), ["state", "token"])
            pipe.get(keys.load_progress(self.model))
            (state, token), raw = cast(tuple[list[Any], Any], pipe.execute())
        except redis.RedisError:
            return None  # the wait for the reply reports Redis being down
        self.loading = state == ModelState.LOADING
        fraction = parse(state, token, raw)
        if fraction is None:
            return None
        percent = int(fraction * 100)
        if percent <= self._shown:
            return None
        self._shown = percent
        return Loading(self.model, percent)
