"""Fault injection for drills and tests (``[debug] fault_injection = true`` only).

``FaultyRuntime`` wraps the real runtime behind the same interface and reads the faults hash
that ``POST /admin/faults`` writes: a load delay, a one-shot load failure, and a hold that keeps
a model busy before its first token, and a per-chunk delay (so a test can make "busy" or "slow"
deterministic instead of racing a fast model)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import redis

from residency import keys
from residency.settings import ModelSpec
from workers.runtime import Runtime

POLL_S = 0.05
HOLD_LIMIT_S = 600.0


class InjectedLoadFailure(RuntimeError):
    pass


class FaultyRuntime:
    def __init__(self, inner: Runtime, r: redis.Redis, model: str, stop: threading.Event) -> None:
        self.inner = inner
        self.r = r
        self.model = model
        self.stop = stop

    def load(self, spec: ModelSpec, device: str) -> None:
        # The delay is re-read while waiting, so a drill can end a slow load early by lowering
        # it; the wait wakes at once on shutdown (a slow load never holds up teardown).
        started = time.monotonic()
        key = f"load_delay_s:{self.model}"
        while not self.stop.is_set():
            delay = float(cast(str, self.r.hget(keys.faults(), key)) or 0)
            left = delay - (time.monotonic() - started)
            if left <= 0:
                break
            self.stop.wait(min(left, POLL_S))
        if self.stop.is_set():
            raise InjectedLoadFailure(f"load of {self.model} stopped by shutdown")
        # HDEL is atomic: exactly one load consumes a one-shot failure.
        if self.r.hget(keys.faults(), "fail_next_load") == self.model and self.r.hdel(
            keys.faults(), "fail_next_load"
        ):
            raise InjectedLoadFailure(f"injected load failure for {self.model}")
        self.inner.load(spec, device)

    def _hold(self) -> None:
        waited = 0.0
        while (
            waited < HOLD_LIMIT_S
            and not self.stop.is_set()
            and self.r.hexists(keys.faults(), f"hold:{self.model}")
        ):
            self.stop.wait(POLL_S)
            waited += POLL_S

    def _slowed(self, result: Any) -> Any:
        """Delay every streamed chunk by ``token_delay_s:<model>`` (a slow model on demand)."""
        raw = cast(str | None, self.r.hget(keys.faults(), f"token_delay_s:{self.model}"))
        delay = float(raw or 0)
        if delay <= 0 or isinstance(result, dict):
            return result

        def gen() -> Iterator[dict[str, Any]]:
            try:
                for chunk in result:
                    if self.stop.wait(delay):
                        return
                    yield chunk
            finally:
                result.close()

        return gen()

    def chat(self, params: dict[str, Any], stream: bool) -> Any:
        self._hold()
        return self._slowed(self.inner.chat(params, stream))

    def completion(self, params: dict[str, Any], stream: bool) -> Any:
        self._hold()
        return self._slowed(self.inner.completion(params, stream))

    def embed(self, inputs: list[str]) -> dict[str, Any]:
        self._hold()
        return self.inner.embed(inputs)

    def close(self) -> None:
        self.inner.close()
