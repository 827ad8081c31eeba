"""How far a model's load has come, published for the requests that wait for it.

llama.cpp reports a load's progress through a callback that runs in the loading thread, inside
the C loader: it only notes the fraction (``Reporter.note``; no Redis call, nothing that can
block or raise there). A thread of the model process publishes the newest fraction noted, at
most every ``PUBLISH_S`` and only when it changed, in ``keys.load_progress`` under the load's
token; web reads it for the streams that wait (``web.load_progress``).

llama-cpp-python's ``Llama`` takes no progress callback: ``with_progress`` makes a subclass
whose model parameters get one as ``Llama.__init__`` creates them, before the model is read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from residency import keys

log = logging.getLogger(__name__)

#: The most often a load's progress is written (a load reports per tensor: thousands).
PUBLISH_S = 0.2

#: Called with the fraction of the load done (0.0 to 1.0), in the loading thread.
OnLoadProgress = Callable[[float], None]


class Reporter:
    """Publishes one load's progress while it runs (``start`` ... ``stop``)."""

    def __init__(self, r: redis.Redis, model: str, token: str) -> None:
        self.r = r
        self.model = model
        self.token = token
        self._fraction = 0.0
        self._published = -1.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def note(self, fraction: float) -> None:
        """The load is ``fraction`` done (never goes back: a fraction lower than one noted
        before is ignored). Only stores a float: safe in llama.cpp's callback."""
        if fraction > self._fraction:
            self._fraction = min(fraction, 1.0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="load-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_S):
            self._publish()

    def _publish(self) -> None:
        fraction = self._fraction
        if fraction <= self._published:
            return
        value = json.dumps({"token": self.token, "fraction": round(fraction, 4)})
        try:
            self.r.set(keys.load_progress(self.model), value, ex=keys.LOAD_PROGRESS_TTL_S)
            self._published = fraction
        except redis.RedisError:
            # Progress is a courtesy to waiting clients: a Redis hiccup never fails a load.
            log.debug("%s: could not publish the load's progress", self.model)

    def stop(self) -> None:
        """The load ended (either way): nothing more is published, and what was is deleted."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.r.delete(keys.load_progress(self.model))
        except redis.RedisError:
            log.debug("%s: could not delete the load's progress (it expires)", self.model)


def with_progress(cls: type[Any], on_progress: OnLoadProgress | None) -> type[Any]:
    """``cls`` (a ``llama_cpp.Llama``), or a subclass of it that reports its model's load to
    ``on_progress``."""
    if on_progress is None:
        return cls
    import llama_cpp

    def report(fraction: float, _user_data: Any) -> bool:
        # An exception cannot cross back into C.
        with contextlib.suppress(Exception):
            on_progress(float(fraction))
        return True  # go on loading

    # Kept alive with the class: llama.cpp calls it for as long as the load runs.
    callback = llama_cpp.llama_progress_callback(report)

    def _get(self: Any) -> Any:
        return self.__dict__["model_params"]

    def _set(self: Any, params: Any) -> None:
        # ``Llama.__init__`` assigns its model parameters once, then sets their other fields
        # and reads the model with them.
        params.progress_callback = callback
        self.__dict__["model_params"] = params

    return type(
        cls.__name__,
        (cls,),
        {"model_params": property(_get, _set), "_progress_callback": callback},
    )
