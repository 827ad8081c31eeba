"""Fault injection for drills and tests (``[debug] fault_injection = true`` only).

``FaultyRuntime`` wraps the real runtime behind the same interface and reads the faults hash
that ``POST /admin/faults`` writes: a load delay (reported as the load's progress, in steps),
a one-shot load failure, a hold that keeps a
model busy before its first token (like a long prompt: it counts as progress and honours
cancel, deadline and stop), a per-token delay (so a test can make "busy" or "slow"
deterministic instead of racing a fast model), and a hang: a generation that blocks with no
progress and honours nothing (for the stall watchdog) until the fault is cleared.

``FaultyBackend`` sits in front of the engine's real backend (same interface): a delay added to
every engine step (``step_delay_s``: a prefill that takes many slow chunks, like a long prompt
on a slow machine) and a one-shot ``engine_crash`` that makes the engine thread raise at the
first step of the next request (a bug in the engine: the process must not live on without it).
Both are read when a request starts, like the faults above.

``FaultyBackend`` also scripts a generation's text (``script_text:<model>``, a list of texts):
each chat or completion request the model starts takes the next text off the list and its
generation produces exactly that text's tokens, then an end-of-generation token. Only the
sampled token is forced: the prompt is rendered and prefilled, each token is decoded, and the
tokens go through the engine's output path as any others, so stop strings, tool-call parsing,
streaming, usage and finish reasons all run for real (a request's ``max_tokens`` still ends it
with ``length``). A request with a grammar checks each scripted token against it; a token the
grammar refuses ends the script there, and the rest is the model's own (the grammar wins, as
it does over any sampler).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol, cast

import redis

from residency import keys
from residency.lua import Scripts
from residency.settings import ModelSpec
from workers.completion import CacheUse, OnUsage
from workers.engine import Backend, Sampler, Sampling, SlotImage
from workers.load_progress import OnLoadProgress
from workers.runtime import OnStep, Runtime
from workers.slot_cache import SlotCache

log = logging.getLogger("residency.model")

POLL_S = 0.05
HOLD_LIMIT_S = 600.0


#: A slowed load reports its delay as this share of its progress, in ``DELAY_STEPS`` even
#: steps (a test sees several distinct steps, whatever the poll timing), the real load after.
DELAY_SHARE = 0.5
DELAY_STEPS = 10


def delay_progress(elapsed: float, delay: float) -> float:
    """The progress reported ``elapsed`` seconds into an injected load delay of ``delay``."""
    step = min(DELAY_STEPS - 1, int(DELAY_STEPS * elapsed / delay))
    return DELAY_SHARE * step / DELAY_STEPS


class InjectedLoadFailure(RuntimeError):
    pass


class InjectedEngineCrash(RuntimeError):
    pass


class StepFaults:
    """The step faults of one model, read by ``FaultyRuntime`` when a request starts (as its
    other faults are) and applied by the ``FaultyBackend`` it wraps the engine's backend in."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.delay = 0.0
        self.crash = False
        # The scripted text of the request the calling thread serves: the engine builds a
        # job's sampler on the thread that submits it, which is the request's own.
        self._script = threading.local()

    def wrap(self, inner: Backend) -> Backend:
        return FaultyBackend(inner, self)

    def script(self, text: str | None) -> None:
        """The text the calling thread's next generation produces (None: its own)."""
        self._script.text = text

    def take_script(self) -> str | None:
        text: str | None = getattr(self._script, "text", None)
        self._script.text = None
        return text


class Spells(Protocol):
    """What scripting a text needs of the real backend (``workers.runtime.LlamaBackend``)."""

    def tokenize(self, text: str) -> list[int]: ...
    def end_token(self) -> int: ...


class Scripted:
    """A request's real sampler, and the tokens it is made to produce (first first)."""

    def __init__(self, inner: Sampler, tokens: list[int]) -> None:
        self.inner = inner
        self.tokens = tokens
        self.given = 0

    def next(self) -> int:
        self.given += 1
        return self.tokens.pop(0)

    def close(self) -> None:
        self.inner.close()


def _real(sampler: Sampler) -> Sampler:
    return sampler.inner if isinstance(sampler, Scripted) else sampler


class FaultyBackend:
    """The engine's real backend, each ``decode`` (one engine step) slowed or made to raise,
    and a scripted request's sampled tokens forced (see the module's docstring)."""

    def __init__(self, inner: Backend, faults: StepFaults) -> None:
        self.inner = inner
        self.n_vocab = inner.n_vocab
        self.faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self) -> int:
        f = self.faults
        if f.crash:
            f.crash = False
            raise InjectedEngineCrash("injected engine crash")
        if f.delay > 0:
            f.stop.wait(f.delay)
        return self.inner.decode()

    def sampler(self, sampling: Sampling) -> Sampler:
        real = self.inner.sampler(sampling)
        text = self.faults.take_script()
        if text is None:
            return real
        spells = cast(Spells, self.inner)
        return Scripted(real, [*spells.tokenize(text), spells.end_token()])

    def sample(self, sampler: Sampler, idx: int) -> int:
        if isinstance(sampler, Scripted) and sampler.tokens:
            token = sampler.next()
            # Accepted into the real chain, as its own draw would be (penalties see it).
            self.inner.accept(sampler.inner, token)
            return token
        return self.inner.sample(_real(sampler), idx)

    def draw(self, sampler: Sampler, idx: int, grammar: bool) -> int | None:
        if isinstance(sampler, Scripted) and sampler.tokens:
            if not grammar:
                return sampler.tokens[0]  # the engine checks it against the grammar next
            # The engine applies the grammar only when it refused the scripted token.
            log.warning(
                "the request's grammar refused its scripted text after %d tokens; the rest is "
                "the model's own",
                sampler.given,
            )
            sampler.tokens.clear()
        return self.inner.draw(_real(sampler), idx, grammar)

    def allows(self, sampler: Sampler, token: int) -> bool:
        return self.inner.allows(_real(sampler), token)

    def accept(self, sampler: Sampler, token: int) -> None:
        if isinstance(sampler, Scripted) and sampler.tokens and sampler.tokens[0] == token:
            sampler.next()
        self.inner.accept(_real(sampler), token)


class FaultyRuntime:
    def __init__(
        self,
        inner: Runtime,
        r: redis.Redis,
        model: str,
        stop: threading.Event,
        steps: StepFaults | None = None,
    ) -> None:
        self.inner = inner
        self.r = r
        self.model = model
        self.stop = stop
        self.steps = steps  # the step faults of inner's engine backend, if it has one
        self.scripts = Scripts(r)

    @property
    def parallel(self) -> int:
        return self.inner.parallel

    def load(self, spec: ModelSpec, device: str, on_progress: OnLoadProgress | None = None) -> None:
        # The delay is re-read while waiting, so a drill can end a slow load early by lowering
        # it; the wait wakes at once on shutdown (a slow load never holds up teardown).
        started = time.monotonic()
        key = f"load_delay_s:{self.model}"
        delayed = False
        while not self.stop.is_set():
            delay = float(cast(str, self.r.hget(keys.faults(), key)) or 0)
            elapsed = time.monotonic() - started
            left = delay - elapsed
            if left <= 0:
                break
            delayed = True
            if on_progress is not None:
                on_progress(delay_progress(elapsed, delay))
            self.stop.wait(min(left, POLL_S))
        if self.stop.is_set():
            raise InjectedLoadFailure(f"load of {self.model} stopped by shutdown")
        # HDEL is atomic: exactly one load consumes a one-shot failure.
        if self.r.hget(keys.faults(), "fail_next_load") == self.model and self.r.hdel(
            keys.faults(), "fail_next_load"
        ):
            raise InjectedLoadFailure(f"injected load failure for {self.model}")
        if delayed and on_progress is not None:
            # The real load is the second half of a delayed one (progress never goes back).
            report = on_progress
            self.inner.load(spec, device, lambda f: report(DELAY_SHARE + (1 - DELAY_SHARE) * f))
        else:
            self.inner.load(spec, device, on_progress)

    def _hold(self, on_step: OnStep | None) -> None:
        # Each wait is a step: a held model is busy but alive (a long prompt), and a cancel or
        # deadline ends the hold as it would a generation.
        waited = 0.0
        while (
            waited < HOLD_LIMIT_S
            and not self.stop.is_set()
            and self.r.hexists(keys.faults(), f"hold:{self.model}")
        ):
            self.stop.wait(POLL_S)
            waited += POLL_S
            if on_step is not None:
                on_step()

    def _hang(self) -> None:
        """A real hang: no steps, deaf to stop, cancel and deadline, until the fault is
        cleared (or HOLD_LIMIT_S); only SIGKILL ends it sooner."""
        started = time.monotonic()
        while time.monotonic() - started < HOLD_LIMIT_S and self.r.hexists(
            keys.faults(), f"hang:{self.model}"
        ):
            time.sleep(POLL_S)

    def _read_steps(self) -> None:
        if self.steps is None:
            return
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(keys.faults(), f"step_delay_s:{self.model}")
        # HDEL is atomic: exactly one request's step raises.
        pipe.hdel(keys.faults(), f"engine_crash:{self.model}")
        delay, crash = pipe.execute()
        self.steps.delay = float(cast(str | None, delay) or 0)
        if crash:
            self.steps.crash = True

    def _take_script(self) -> None:
        """Hand the engine the scripted text of the generation this thread starts, taken off
        ``script_text:<model>`` (one text per request, in order), or None: set at every
        request's start, so nothing one request was given is left for the next."""
        if self.steps is None:
            return
        self.steps.script(self.scripts.pop_script(f"script_text:{self.model}"))

    def _slowed(self, on_step: OnStep | None) -> OnStep | None:
        """Delay every generated token by ``token_delay_s:<model>`` (a slow model on demand),
        streamed or not."""
        raw = cast(str | None, self.r.hget(keys.faults(), f"token_delay_s:{self.model}"))
        delay = float(raw or 0)
        if delay <= 0:
            return on_step

        def step() -> None:
            self.stop.wait(delay)
            if on_step is not None:
                on_step()

        return step

    def chat(
        self,
        params: dict[str, Any],
        stream: bool,
        on_step: OnStep | None = None,
        on_usage: OnUsage | None = None,
        *,
        on_progress: OnStep | None = None,
        cache: CacheUse | None = None,
    ) -> Any:
        self._hang()
        self._hold(on_step)
        self._read_steps()
        self._take_script()
        return self.inner.chat(
            params, stream, self._slowed(on_step), on_usage, on_progress=on_progress, cache=cache
        )

    def completion(
        self,
        params: dict[str, Any],
        stream: bool,
        on_step: OnStep | None = None,
        on_usage: OnUsage | None = None,
        *,
        on_progress: OnStep | None = None,
        cache: CacheUse | None = None,
    ) -> Any:
        self._hang()
        self._hold(on_step)
        self._read_steps()
        self._take_script()
        return self.inner.completion(
            params, stream, self._slowed(on_step), on_usage, on_progress=on_progress, cache=cache
        )

    def embed(self, inputs: list[str]) -> dict[str, Any]:
        self._hold(None)
        return self.inner.embed(inputs)

    def rerank(self, query: str, documents: list[str]) -> dict[str, Any]:
        self._hold(None)
        return self.inner.rerank(query, documents)

    def count_tokens(self, params: dict[str, Any]) -> dict[str, Any]:
        self._hold(None)
        return self.inner.count_tokens(params)

    @property
    def state_format(self) -> str:
        return self.inner.state_format

    def attach_cache(self, cache: SlotCache | None) -> None:
        self.inner.attach_cache(cache)

    def prefix_counts(self) -> dict[str, int]:
        return self.inner.prefix_counts()

    def slot_images(self, min_tokens: int, timeout: float) -> list[SlotImage]:
        return self.inner.slot_images(min_tokens, timeout)

    def failure(self) -> BaseException | None:
        return self.inner.failure()

    def close(self) -> None:
        self.inner.close()
