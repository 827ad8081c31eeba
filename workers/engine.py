"""The batched engine: up to N requests of one model decoded together (continuous batching).

One thread owns the llama.cpp context. Each step it builds one batch: the last sampled token of
every generating slot, then as many prompt tokens of prefilling slots as the batch has room for
(a long prompt is prefilled in chunks, so the other streams keep getting a token per step),
calls ``llama_decode`` once, and samples a token for every slot whose logits it asked for, each
with its own sampler chain (penalties, temperature…, seed). A request submitted while others
run joins the batch at the next step.

A request with a grammar (a JSON schema, a forced tool call) is sampled in llama.cpp's own
order (``common_sampler_sample``): the chain draws from the whole vocabulary without the
grammar, the grammar checks that one token, and only when it refuses is the grammar applied to
the whole vocabulary and the chain drawn again. The check skips the grammar's work per
vocabulary token, most of its cost on a large vocabulary. An ambiguous grammar's cost is in
its many parse stacks instead, paid by a check as by an application: so the grammar work of
each request is timed on this thread (its CPU time), and a request past
``grammar_budget_s`` of it ends with ``GrammarBudgetExceeded`` (its client's error) while the
others go on: whatever a schema costs, it costs its own request.

Requests arrive as ``Job``s from the threads that serve them; tokens go back on each job's own
queue. Turning tokens into text (stop strings, UTF-8) is the serving thread's work
(``workers.completion``), so this thread does nothing but decode and sample.

It drives llama-cpp-python's low-level pieces (``LlamaBatch``, ``llama_decode``,
``LlamaSampler`` chains, per-sequence KV memory) through a ``Backend``, which
``workers.runtime`` implements: that module (and ``workers.projector``, its images) stays the
only one that imports ``llama_cpp``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast

import numpy as np

from workers.decode_threads import Chooser
from workers.slots import (
    Action,
    Asker,
    Cached,
    Held,
    Plan,
    SlotState,
    check_transition,
    plan,
    reusable,
)

log = logging.getLogger("residency.model")
T = TypeVar("T")


@dataclass(frozen=True)
class Sampling:
    """One request's sampler chain, with llama-cpp-python's ``create_completion`` defaults and
    argument names (``temperature``, not ``temp``)."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: Any = None  # a llama_cpp.LlamaGrammar


class Sampler(Protocol):
    def close(self) -> None: ...


class Backend(Protocol):
    """One llama.cpp context of ``n_slots`` sequences, as the engine thread uses it.

    A sampler holds a request's chain and, apart from it, its grammar (``Sampling.grammar``).
    ``sample`` draws from the chain and accepts the token (a request without a grammar);
    with a grammar the engine calls ``draw``, ``allows`` and ``accept`` in llama.cpp's order.
    """

    n_vocab: int

    def sampler(self, sampling: Sampling) -> Sampler: ...
    def add(self, token: int, pos: int, seq: int, logits: bool) -> None: ...
    def decode(self) -> int: ...  # the batch added since the last decode; 0 when it worked
    def sample(self, sampler: Sampler, idx: int) -> int: ...
    # The chain's token for batch index idx, after the grammar applied to the whole vocabulary
    # when ``grammar`` (None: the grammar refused every token the chain could draw); accepts
    # nothing.
    def draw(self, sampler: Sampler, idx: int, grammar: bool) -> int | None: ...
    def allows(self, sampler: Sampler, token: int) -> bool: ...  # the grammar, on one token
    def accept(self, sampler: Sampler, token: int) -> None: ...  # into the grammar and chain
    def logits(self, idx: int) -> np.ndarray: ...  # of the last decode's batch index idx
    def is_eog(self, token: int) -> bool: ...
    def seq_rm(self, seq: int, p0: int) -> bool: ...  # drop positions p0.. (-1: all)
    def seq_pos_min(self, seq: int) -> int: ...
    def state_get(self, seq: int) -> bytes: ...  # the sequence's KV state, serialized
    def state_set(self, seq: int, data: bytes) -> bool: ...  # into seq (replacing it)
    # All of ``src``'s memory into ``dst`` (replacing it); False: this memory cannot.
    def seq_cp(self, src: int, dst: int) -> bool: ...
    # An image's embeddings (a ``Media.image``) into ``seq`` from ``pos``, as their own decode;
    # 0 when it worked. Only a model loaded with a vision projector has images to decode.
    def decode_image(self, image: Any, pos: int, seq: int) -> int: ...
    def close(self) -> None: ...


class Threaded(Protocol):
    """A backend whose decode thread count can change between steps (``workers.decode_threads``)."""

    def set_threads(self, threads: int) -> None: ...


@dataclass(frozen=True)
class Token:
    id: int
    logprob: float | None = None  # with logprobs asked for: log-softmax of the raw logits
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens there, best first


@dataclass(frozen=True)
class Media:
    """An image's span of a prompt: ``n_tokens`` positions from its offset, each holding the
    same negative id in the prompt's tokens, and what the backend decodes (its embeddings)."""

    n_tokens: int
    image: Any


@dataclass(frozen=True)
class End:
    reason: str  # "stop": an end-of-generation token; "length": max_tokens or the context


@dataclass
class Restore:
    """A saved slot state offered to a job (read and checked before it is submitted): the
    tokens it holds and whose they were, its bytes, and ``done`` — told on the engine thread
    how it went ("restored", "unused": a live slot held more, "refused": llama.cpp refused the
    state), how many prompt tokens it saved, and how long llama.cpp took."""

    tokens: list[int]
    owner: str
    shareable: int
    data: bytes
    done: Callable[[str, int, float], None] = lambda outcome, tokens, seconds: None


@dataclass(frozen=True)
class SlotImage:
    """A free slot's memory as saved at a drain: its tokens, whose request filled it, how many
    of them that request marked shareable, and the KV state."""

    tokens: list[int]
    owner: str
    shareable: int
    data: bytes


class _Task(Generic[T]):
    """A call run on the engine thread between two steps (the context is its alone)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as e:  # handed to the caller (logged: it may have stopped waiting)
            log.warning("a call on the engine thread failed: %r", e)
            self.error = e
        finally:
            self.done.set()


class GrammarBudgetExceeded(RuntimeError):
    """A request's grammar took more of the engine thread than ``grammar_budget_s``."""

    def __init__(self, spent_s: float, budget_s: float, tokens: int) -> None:
        super().__init__(
            f"the grammar took {spent_s:.2f}s of sampling work after {tokens} tokens, past the "
            f"{budget_s:g}s a request may use"
        )
        self.spent_s = spent_s
        self.budget_s = budget_s
        self.tokens = tokens


class Job:
    """One request on its way through the engine. ``n_probs`` is None without logprobs, else
    how many alternatives to report per token. ``stop_token`` may end the generation at a
    token (a chat format's own stop token) before it is handed out: it is given that token
    only (not the context: the check runs on every token of every slot). ``asker`` says whose
    cached prefixes it may reuse (``workers.slots.reusable``). ``on_progress`` is called on
    the engine thread after every step its slot took part in — a prompt chunk or a token — so
    a long prefill counts as progress for the stall watchdog; it must only note the step."""

    def __init__(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        n_probs: int | None = None,
        stop_token: Callable[[int], bool] | None = None,
        *,
        asker: Asker | None = None,
        on_progress: Callable[[], None] | None = None,
        restore: Restore | None = None,
        media: dict[int, Media] | None = None,
    ) -> None:
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        self.media = media or {}  # images by their offset in ``prompt``
        for at, m in self.media.items():
            # The prompt's last token is text: its logits give the first generated token.
            if at < 0 or m.n_tokens < 1 or at + m.n_tokens > len(prompt) - 1:
                raise ValueError("an image must lie inside the prompt, before its last token")
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.n_probs = n_probs
        self.stop_token = stop_token
        self.asker = asker or Asker()
        self.on_progress = on_progress
        self.cached = 0  # prompt tokens reused from its slot's memory (set when it gets one)
        # A saved state it may start from (dropped once it has a slot), and the engine step it
        # first waited at for its own slot (and which slot that was).
        self.restore = restore
        self.wait_since: int | None = None
        self.waited_for = -1
        self.sampler: Any = None  # built by Engine.submit
        # Its grammar's work on the engine thread: seconds, and how often the grammar was
        # applied to the whole vocabulary (the sampled token refused).
        self.grammar_s = 0.0
        self.grammar_applied = 0
        self._out: queue.SimpleQueue[Token | End | BaseException] = queue.SimpleQueue()
        self._cancelled = threading.Event()

    def whole_images(self, keep: int) -> int:
        """``keep`` moved back to the start of an image it would cut: an image's positions are
        decoded together, so a reused prefix ends before one or after it."""
        for at, m in self.media.items():
            if at < keep < at + m.n_tokens:
                return at
        return keep

    def next_image(self, at: int) -> int:
        """Where the first image at or after prompt offset ``at`` starts (the prompt's length
        without one)."""
        return min((k for k in self.media if k >= at), default=len(self.prompt))

    def saved(self) -> Cached | None:
        r = self.restore
        return None if r is None else Cached(-1, r.tokens, 0.0, r.owner, r.shareable)

    def cancel(self) -> None:
        """The consumer is gone or has seen enough (a stop string): the slot is freed at the
        next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def next(self) -> Token | End:
        """The next token, or the end; raises what failed the job."""
        item = self._out.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def put(self, item: Token | End | BaseException) -> None:
        self._out.put(item)


@dataclass
class Slot:
    seq: int
    state: SlotState = SlotState.FREE
    cached: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds
    job: Job | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to decode
    last: int = -1  # the sampled token not decoded yet
    generated: int = 0
    used: float = 0.0  # when its last request ended (monotonic)
    admitted: int = 0  # arrival order, for fair prefill
    # Whose request filled its memory, and how many of its first tokens that request marked
    # shareable with other users (its system part, under ``[cache] scope = shared_system``).
    owner: str = ""
    shareable: int = 0

    def move(self, new: SlotState) -> None:
        check_transition(self.state, new)
        self.state = new


class EngineClosed(RuntimeError):
    pass


class EngineDied(EngineClosed):
    """The engine thread stopped on an error: nothing this process holds can decode again
    (the model process exits so that its model is reloaded)."""


class Engine:
    """Runs ``backend``'s context of ``n_slots`` sequences of ``n_ctx_slot`` tokens each;
    ``n_batch`` bounds the tokens of one step; ``grammar_budget_s`` the grammar work of one
    request (0: unbounded); ``threads``, when given, picks each step's decode thread count
    (the backend is then ``Threaded``), timed with ``clock``."""

    def __init__(
        self,
        backend: Backend,
        n_slots: int,
        n_ctx_slot: int,
        n_batch: int,
        grammar_budget_s: float = 0.0,
        threads: Chooser | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._b = backend
        self.threads = threads
        self._clock = clock
        self._threads_now = 0  # the count the backend was last set to (0: never set here)
        self.grammar_budget_s = grammar_budget_s
        self.n_vocab = backend.n_vocab
        # The sliding window of the model's SWA layers (0: none), for ``_trim``.
        self.n_swa = int(getattr(backend, "n_swa", 0))
        self.n_ctx_slot = n_ctx_slot
        # Every generating slot needs a place in each step's batch, beside prompt chunks.
        self.n_batch = max(n_batch, n_slots)
        self.slots = [Slot(i) for i in range(n_slots)]
        self._inbox: queue.SimpleQueue[Job | _Task[Any] | None] = queue.SimpleQueue()
        self._waiting: deque[Job] = deque()
        self._arrivals = 0
        self._closed = threading.Event()
        self.prefilled = 0  # prompt tokens decoded (cached ones excluded), for tests and stats
        self.steps = 0
        # How requests found their prefixes beyond their slot (for tests and stats): restored
        # from a saved state, copied from a busy slot, and those that waited for their own
        # slot, by how the wait ended ("own", "copied", "cold").
        self.restored = 0
        self.copied = 0
        # Images decoded into a slot (their positions count in ``prefilled`` too).
        self.images_decoded = 0
        self.waits: dict[str, int] = {"own": 0, "copied": 0, "cold": 0}
        self._copied_into: set[int] = set()  # slots whose copy is pending until the next decode
        self.error: BaseException | None = None  # what stopped the engine thread, if anything
        # Orders a submit's check and put against the thread's death: a job is either refused
        # or in the inbox before the dying thread fails what the inbox holds.
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # -- the serving threads' side ----------------------------------------------------------

    def submit(self, job: Job) -> Job:
        if self.error is not None:
            raise EngineDied(f"the engine stopped: {self.error!r}")
        if self._closed.is_set():
            raise EngineClosed("the engine is closed")
        if len(job.prompt) >= self.n_ctx_slot:
            # The message llama-cpp-python uses, which the runtime maps to a client's 400.
            raise ValueError(
                f"Requested tokens ({len(job.prompt)}) exceed context window of {self.n_ctx_slot}"
            )
        job.sampler = self._b.sampler(job.sampling)
        with self._submit_lock:
            if self.error is not None:
                job.sampler.close()
                raise EngineDied(f"the engine stopped: {self.error!r}")
            self._inbox.put(job)
        return job

    def busy(self) -> int:
        return sum(1 for s in self.slots if s.state is not SlotState.FREE)

    def call(self, fn: Callable[[], T], timeout: float) -> T:
        """``fn()`` run on the engine thread between two steps; ``TimeoutError`` past
        ``timeout`` seconds (it may still run later: ``fn`` must stay harmless then)."""
        task: _Task[T] = _Task(fn)
        with self._submit_lock:
            if self.error is not None or self._closed.is_set():
                raise EngineClosed("the engine is closed")
            self._inbox.put(task)
        if not task.done.wait(timeout):
            raise TimeoutError(f"the engine thread did not get to it within {timeout:g}s")
        if task.error is not None:
            raise task.error
        return cast(T, task.result)

    def images(self, min_tokens: int) -> list[SlotImage]:
        """The free slots holding at least ``min_tokens`` tokens, with their KV state (engine
        thread only: through ``call``). A busy slot is mid-request and not taken."""
        out: list[SlotImage] = []
        for s in self.slots:
            if s.state is SlotState.FREE and len(s.cached) >= min_tokens:
                data = self._b.state_get(s.seq)
                if data:
                    out.append(SlotImage(list(s.cached), s.owner, s.shareable, data))
        return out

    def held_prefix(self, prompt: list[int], asker: Asker) -> int:
        """The most of ``prompt`` a live slot (free or busy) holds that ``asker`` may reuse.
        Read from another thread without a lock: a hint (whether a saved state is worth
        reading), never a decision — ``_admit`` decides on the engine thread."""
        best = 0
        for s in self.slots:
            c = Cached(s.seq, list(s.cached), 0.0, s.owner, s.shareable)
            best = max(best, reusable(c, prompt, asker))
        return best

    def can_copy(self) -> bool:
        return bool(getattr(self._b, "copies", False))

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)
        self._fail_all(EngineClosed("the model process is stopping"))  # late arrivals
        self._b.close()

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                self._take_arrivals()
                self._drop_cancelled()
                self._admit()
                if any(s.state is not SlotState.FREE for s in self.slots):
                    self._step()
        except Exception as e:  # a bug here must not leave serving threads waiting forever
            log.exception("the engine stopped")
            with self._submit_lock:
                self.error = e
                self._closed.set()
            self._fail_all(EngineDied(f"the engine stopped: {e!r}"))
            return
        self._fail_all(EngineClosed("the model process is stopping"))

    def _take_arrivals(self) -> None:
        idle = all(s.state is SlotState.FREE for s in self.slots) and not self._waiting
        try:
            # Idle, the thread sleeps until a job (or close) arrives: no polling.
            item = self._inbox.get() if idle else self._inbox.get_nowait()
            while True:
                if isinstance(item, _Task):
                    item.run()
                elif item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _drop_cancelled(self) -> None:
        for s in self.slots:
            if s.job is not None and s.job.cancelled:
                self._finish(s, None)
        self._waiting = deque(j for j in self._waiting if not j.cancelled)

    def _admit(self) -> None:
        """Give waiting jobs free slots, in arrival order (``workers.slots.plan`` says how); a
        job that waits for its conversation's own slot lets the ones behind it go first."""
        waiting, self._waiting = self._waiting, deque()
        can_copy = self.can_copy()
        while waiting:
            free = [
                Cached(s.seq, s.cached, s.used, s.owner, s.shareable)
                for s in self.slots
                if s.state is SlotState.FREE
            ]
            if not free:
                break
            job = waiting.popleft()
            held = [
                Held(
                    s.seq,
                    s.cached,
                    s.owner,
                    s.shareable,
                    len(s.job.prompt),
                    s.job.max_tokens - s.generated,
                    s.job.cancelled,
                )
                for s in self.slots
                if s.job is not None and s.seq not in self._copied_into
            ]
            waited = 0 if job.wait_since is None else self.steps - job.wait_since
            p = plan(free, held, job.prompt, job.asker, job.saved(), waited, can_copy)
            if p.action is Action.WAIT:
                if job.wait_since is None:
                    job.wait_since = self.steps
                job.waited_for = p.source
                self._waiting.append(job)
                continue
            self._place(job, p)
        self._waiting.extend(waiting)

    def _place(self, job: Job, p: Plan) -> None:
        slot = self.slots[p.slot]
        keep = job.whole_images(p.keep)
        if p.action is Action.RESTORE:
            keep = self._restore(slot, job, keep)
        elif p.action is Action.COPY:
            keep = self._copy(self.slots[p.source], slot, keep)
        else:
            keep = self._trim(slot, keep)
        if job.restore is not None and p.action is not Action.RESTORE:
            job.restore.done("unused", 0, 0.0)
        job.restore = None  # its bytes are not kept past admission
        if job.wait_since is not None:
            own = p.action is Action.TAKE and p.slot == job.waited_for and keep > 0
            self.waits["own" if own else "copied" if p.action is Action.COPY else "cold"] += 1
        slot.owner = job.asker.owner
        slot.shareable = min(job.asker.shareable, len(job.prompt))
        slot.job = job
        slot.pending = job.prompt[keep:]
        slot.generated = 0
        self._arrivals += 1
        slot.admitted = self._arrivals
        job.cached = keep
        slot.move(SlotState.PREFILL)

    def _restore(self, slot: Slot, job: Job, keep: int) -> int:
        """Put the job's saved state into ``slot`` and keep ``keep`` of its tokens; the tokens
        kept (0: llama.cpp refused the state, and the slot starts empty)."""
        r = job.restore
        assert r is not None
        t0 = time.perf_counter()
        ok = self._b.state_set(slot.seq, r.data)
        seconds = time.perf_counter() - t0
        if ok:
            slot.cached = list(r.tokens)
            keep = self._trim(slot, keep)
            self.restored += 1
        else:
            log.warning("llama.cpp refused a saved slot state; the prompt is prefilled")
            slot.cached = []
            keep = self._trim(slot, 0)  # empties whatever the refusal left of the sequence
        r.done("refused" if not ok else "restored" if keep else "unused", keep, seconds)
        return keep

    def _copy(self, src: Slot, dst: Slot, keep: int) -> int:
        """Copy ``src``'s memory into ``dst`` and keep ``keep`` of its tokens there."""
        self._b.seq_rm(dst.seq, -1)
        if not self._b.seq_cp(src.seq, dst.seq):
            dst.cached = []
            return 0
        # The copy lands at the next decode; no copy is made from this slot before then.
        self._copied_into.add(dst.seq)
        dst.cached = list(src.cached)
        keep = self._trim(dst, keep)
        if keep:
            self.copied += 1
        return keep

    def _trim(self, slot: Slot, keep: int) -> int:
        """Drop the slot's cached tokens past ``keep``; the tokens actually kept (0 when this
        memory cannot drop part of a sequence, or lacks some of the positions the next token
        attends to). A sliding-window layer attends to the last ``n_swa`` positions only, and
        a saved state holds only those of its sequence's end (llama.cpp writes no masked cell):
        such a state serves a prompt that goes on from its end, as llama-server checks it."""
        if keep < len(slot.cached) and not self._b.seq_rm(slot.seq, keep):
            keep = 0
        if keep > 0 and self._b.seq_pos_min(slot.seq) > max(0, keep - self.n_swa):
            keep = 0
        if keep == 0:
            self._b.seq_rm(slot.seq, -1)
        del slot.cached[keep:]
        return keep

    def _step(self) -> None:
        n = 0
        sample: list[tuple[Slot, int]] = []
        in_batch: list[Slot] = []

        def put(slot: Slot, token: int, logits: bool) -> None:
            nonlocal n
            self._b.add(token, len(slot.cached), slot.seq, logits)
            slot.cached.append(token)
            n += 1

        for s in self.slots:
            if s.state is SlotState.GENERATE:
                put(s, s.last, True)
                sample.append((s, n - 1))
                in_batch.append(s)
        prefilling = sorted(
            (s for s in self.slots if s.state is SlotState.PREFILL), key=lambda s: s.admitted
        )
        imaged = False  # one image per step: its decode is a whole batch's work of its own
        for s in prefilling:
            room = self.n_batch - n
            if room <= 0:
                break
            job = s.job
            assert job is not None
            at = len(job.prompt) - len(s.pending)
            if at in job.media:
                if imaged:
                    continue  # its turn comes at the next step; text behind it waits too
                imaged = True
                if not self._image(s, job.media[at]):
                    continue
                at = len(job.prompt) - len(s.pending)
            # Text up to the next image: that one is decoded on its own at a later step.
            take = min(room, job.next_image(at) - at)
            chunk, s.pending = s.pending[:take], s.pending[take:]
            for i, t in enumerate(chunk):
                # Logits only for a prompt's last token: its first generated token comes next.
                put(s, t, not s.pending and i == len(chunk) - 1)
            self.prefilled += len(chunk)
            in_batch.append(s)
            if not s.pending:
                sample.append((s, n - 1))
        if n == 0:  # only an image this step (another one right behind it)
            self.steps += 1
            return
        rc = self._decode(n)
        self.steps += 1
        self._copied_into.clear()  # the decode applied them
        if rc != 0:
            err = RuntimeError(f"llama_decode failed ({rc})")
            for s in in_batch:
                self._trim(s, 0)
                self._finish(s, err)
            return
        for s in in_batch:
            if s.job is not None and s.job.on_progress is not None:
                s.job.on_progress()
        for s, idx in sample:
            self._sampled(s, idx)

    def _image(self, s: Slot, m: Media) -> bool:
        """Decode the image that starts the slot's pending prompt into its sequence, before
        this step's batch (so the batch's text behind it follows it); False when llama.cpp
        refused it (the request ends with the error, its memory emptied)."""
        rc = self._b.decode_image(m.image, len(s.cached), s.seq)
        if rc != 0:
            self._trim(s, 0)
            self._finish(s, RuntimeError(f"llama.cpp could not decode an image ({rc})"))
            return False
        s.cached.extend(s.pending[: m.n_tokens])
        s.pending = s.pending[m.n_tokens :]
        self.prefilled += m.n_tokens
        self.images_decoded += 1
        if s.job is not None and s.job.on_progress is not None:
            s.job.on_progress()
        return True

    def _decode(self, n_tokens: int) -> int:
        chooser = self.threads
        if chooser is None:
            return self._b.decode()
        threads = chooser.choose(n_tokens)
        switched = threads != self._threads_now
        if switched:
            cast(Threaded, self._b).set_threads(threads)
            self._threads_now = threads
        t0 = self._clock()
        rc = self._b.decode()
        chooser.observe(n_tokens, threads, self._clock() - t0, switched)
        return rc

    def _sampled(self, s: Slot, idx: int) -> None:
        job = s.job
        assert job is not None
        if job.sampling.grammar is None:
            token = self._b.sample(job.sampler, idx)
        else:
            chosen = self._constrained(job, idx)
            if chosen is None:
                self._finish(s, RuntimeError("the grammar admits no token the sampler can draw"))
                return
            budget = self.grammar_budget_s
            if budget > 0 and job.grammar_s > budget:
                self._finish(s, GrammarBudgetExceeded(job.grammar_s, budget, s.generated))
                return
            token = chosen
        if s.state is SlotState.PREFILL:
            s.move(SlotState.GENERATE)
        if self._b.is_eog(token) or (job.stop_token is not None and job.stop_token(token)):
            self._finish(s, End("stop"))
            return
        job.put(self._token(idx, token, job.n_probs))
        s.generated += 1
        s.last = token
        if s.generated >= job.max_tokens or len(s.cached) + 1 >= self.n_ctx_slot:
            self._finish(s, End("length"))

    def _constrained(self, job: Job, idx: int) -> int | None:
        """The token of a request with a grammar (see the module's docstring), accepted into
        its grammar and chain; the grammar's part is added to ``job.grammar_s``. None: the
        grammar left no token the chain could draw (accepting one it refuses would abort
        llama.cpp, and with it every request of the process)."""
        b, sampler = self._b, job.sampler
        token = b.draw(sampler, idx, False)
        # The engine thread's CPU time: what the grammar took from the other slots, and not
        # what the OS gave other processes meanwhile (a loaded box ends no request for that).
        t0 = time.thread_time()
        try:
            if token is None or not b.allows(sampler, token):
                job.grammar_applied += 1
                token = b.draw(sampler, idx, True)
                if token is None:
                    return None
            b.accept(sampler, token)
        finally:
            job.grammar_s += time.thread_time() - t0
        return token

    def _token(self, idx: int, token: int, n_probs: int | None) -> Token:
        # The raw logits' log-softmax: logprobs say what the model made of the token, whether
        # or not the grammar had to be applied to choose it.
        if n_probs is None:
            return Token(token)
        logits = self._b.logits(idx).astype(np.float64)
        peak = float(logits.max())
        lse = peak + math.log(float(np.exp(logits - peak).sum()))
        top: tuple[tuple[int, float], ...] = ()
        if n_probs > 0:
            k = min(n_probs, self.n_vocab)
            ids = np.argpartition(-logits, k - 1)[:k]
            ids = ids[np.argsort(-logits[ids])]
            top = tuple((int(i), float(logits[i]) - lse) for i in ids)
        return Token(token, float(logits[token]) - lse, top)

    def _finish(self, s: Slot, outcome: End | BaseException | None) -> None:
        """End the slot's request (None: its consumer cancelled it); its memory stays cached."""
        job = s.job
        if job is not None:
            if outcome is not None:
                job.put(outcome)
            job.sampler.close()
        s.job = None
        s.pending = []
        s.used = time.monotonic()
        s.move(SlotState.FREE)

    def _fail_all(self, e: BaseException) -> None:
        for s in self.slots:
            if s.job is not None:
                self._finish(s, e)
        while self._waiting:
            self._waiting.popleft().put(e)
        try:
            while True:
                item = self._inbox.get_nowait()
                if isinstance(item, _Task):
                    item.error = e
                    item.done.set()
                elif item is not None:
                    item.put(e)
        except queue.Empty:
            pass
