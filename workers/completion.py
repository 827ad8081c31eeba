"""A text completion through the batched engine, in llama-cpp-python's ``create_completion``
shape: its arguments in, its response (or stream of chunks) out.

This is the one place a request becomes a ``Job`` (prompt tokens, sampler chain, token budget)
and the engine's tokens become OpenAI text: stop strings, UTF-8, logprobs, usage. Its chat
formatters and tool handlers call ``create_completion`` on the model object
(``workers.runtime``), so chat requests come through here too, with the prompt already
rendered and tokenized.

It runs in the thread that serves the request; ``on_step`` (the request's gate) is called once
per generated token and may raise to end the generation.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from residency.errors import ApiError
from workers.engine import End, Engine, Job, Media, Sampling, Token
from workers.slots import Asker, common_prefix
from workers.textout import TextOut

OnStep = Callable[[], None]
#: Told the prompt, completion and cached prompt tokens of a generation when it ends (however
#: it ends).
OnUsage = Callable[[int, int, int], None]


@dataclass(frozen=True)
class CacheUse:
    """Whose request a generation serves, for the slots' prompt cache: its user, the
    ``[cache] scope`` it came under, and (a chat under ``shared_system``) the tokens of its
    system message(s) rendered alone. The part of the prompt they begin is what other users
    may share."""

    owner: str = ""
    scope: str = "user"
    system: Sequence[int] = ()

    def asker(self, prompt: Sequence[int]) -> Asker:
        return Asker(self.owner, common_prefix(self.system, prompt), self.scope)


class Report(threading.local):
    """What the latest generation of this thread knows beyond OpenAI's fields, for a caller
    that asked (the Anthropic API): its prompt's tokens, set when it is submitted (before its
    first chunk), and the stop string that ended it (None: it ended otherwise). Per thread: a
    request is served, chat handler included, in one thread."""

    prompt_tokens: int | None = None
    stop_sequence: str | None = None


REPORT = Report()


class Pieces:
    """Token id → its bytes (``piece``: the runtime's; special tokens render as nothing, as
    llama-cpp-python does), memoized: the vocabulary never changes. ``fim`` holds the
    fill-in-the-middle tokens (prefix, suffix, middle) of a model that has them."""

    def __init__(
        self, piece: Callable[[int], bytes], fim: tuple[int, int, int] | None = None
    ) -> None:
        self._piece = piece
        self.fim = fim
        self._memo: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        got = self._memo.get(token)
        if got is None:
            got = self._memo[token] = self._piece(token)
        return got

    def text(self, token: int) -> str:
        return self(token).decode("utf-8", errors="ignore")


class Completion:
    """One prepared request. Build it with ``prepare``, then ``answer()`` or ``chunks()``."""

    def __init__(
        self,
        job: Job,
        pieces: Pieces,
        *,
        prompt_text: str | None,
        stops: list[str],
        echo: bool,
        suffix: str | None,
        model: str,
        on_step: OnStep | None,
        on_usage: OnUsage | None = None,
    ) -> None:
        self.job = job
        self.on_usage = on_usage
        self.pieces = pieces
        self.prompt_text = prompt_text
        self.out = TextOut(stops)
        self.echo = echo
        self.suffix = suffix
        self.model = model
        self.on_step = on_step
        self.id = f"cmpl-{uuid.uuid4()}"
        self.created = int(time.time())
        self.tokens: list[Token] = []
        self.finish = "length"

    def _tokens(self) -> Iterator[Token]:
        """The job's tokens up to its end or a stop string; the job is cancelled (its slot
        freed at the next step) whenever the consumer leaves early, including by an
        exception from ``on_step``."""
        try:
            while True:
                item = self.job.next()
                if isinstance(item, End):
                    self.finish = item.reason
                    return
                if self.on_step is not None:
                    self.on_step()
                if self.out.add(self.pieces(item.id)):
                    self.finish = "stop"
                    REPORT.stop_sequence = self.out.matched
                    return
                self.tokens.append(item)
                yield item
        finally:
            self.job.cancel()
            if self.on_usage is not None:
                self.on_usage(len(self.job.prompt), len(self.tokens), self.job.cached)

    def _logprobs(self, toks: list[Token], offset: int) -> dict[str, Any] | None:
        if self.job.n_probs is None:
            return None
        out: dict[str, Any] = {
            "tokens": [],
            "text_offset": [],
            "token_logprobs": [],
            "top_logprobs": [],
        }
        for t in toks:
            s = self.pieces.text(t.id)
            top: dict[str, float | None] = {self.pieces.text(i): lp for i, lp in t.top}
            top[s] = t.logprob
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append(top)
            offset += len(s)
        return out

    def _usage(self) -> dict[str, Any]:
        n_prompt, n_out = len(self.job.prompt), len(self.tokens)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": self.job.cached},
        }

    def _chunk(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
        }

    def answer(self) -> dict[str, Any]:
        for _ in self._tokens():
            pass
        text = self.out.text
        if self.echo and self.prompt_text is not None:
            text = self.prompt_text + text
        if self.suffix is not None:
            text += self.suffix  # no fill-in-the-middle tokens: it follows the completion
        offset = 0 if self.echo else len(self.prompt_text or "")
        out = self._chunk(text, self._logprobs(self.tokens, offset), self.finish)
        out["usage"] = self._usage()
        return out

    def chunks(self) -> Iterator[dict[str, Any]]:
        pending: list[Token] = []
        offset = len(self.prompt_text or "")
        for t in self._tokens():
            pending.append(t)
            text = self.out.take()
            if text:
                yield self._chunk(text, self._logprobs(pending, offset), None)
                offset += len(text)
                pending = []
        rest = self.out.take(final=True)
        if rest or pending:
            yield self._chunk(rest, self._logprobs(pending, offset), None)
        yield self._chunk("", None, self.finish)


def _prompt_tokens(
    llm: Any, prompt: str | list[int], suffix: str | None, fim: tuple[int, int, int] | None
) -> tuple[list[int], bool]:
    """The prompt's tokens, and whether they hold the suffix (a fill-in-the-middle model)."""
    if isinstance(prompt, list):
        return list(prompt), False  # a chat format's rendering, tokenized by its handler
    tokens: list[int] = (
        llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True) if prompt else []
    )
    if not tokens:
        tokens = [llm.token_bos()]
    if suffix is not None and fim is not None:
        pre, suf, mid = fim
        body = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
        after = llm.tokenize(suffix.encode("utf-8"), add_bos=False, special=False)
        bos = [llm.token_bos()] if tokens[:1] == [llm.token_bos()] else []
        return [*bos, pre, *body, suf, *after, mid], True
    return tokens, False


def create(
    llm: Any,
    engine: Engine,
    pieces: Pieces,
    on_step: OnStep | None,
    *,
    on_usage: OnUsage | None = None,
    on_progress: Callable[[], None] | None = None,
    cache: CacheUse | None = None,
    media: dict[int, Media] | None = None,
    prompt: str | list[int],
    suffix: str | None = None,
    max_tokens: int | None = 16,
    logprobs: int | None = None,
    echo: bool = False,
    stop: str | list[str] | None = None,
    stream: bool = False,
    model: str | None = None,
    stopping_criteria: Any = None,
    logits_processor: Any = None,
    tfs_z: float = 1.0,
    logit_bias: dict[Any, float] | None = None,
    **sampling: Any,
) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """llama-cpp-python's ``create_completion`` arguments and defaults (``sampling``: the
    fields of ``Sampling``, which has its sampler defaults); the job is submitted before this
    returns (a stream's prefill starts before its first chunk is asked for). ``on_progress``:
    the job's (see ``Job``); ``cache``: whose cached prefixes it may reuse (None: nobody's
    but an anonymous caller's); ``media``: the prompt's images by offset, encoded."""
    del tfs_z  # accepted for compatibility; llama.cpp has no tail-free sampling any more
    if logits_processor is not None:
        raise ValueError("logits processors are not supported by the batched engine")
    if echo and logprobs is not None:
        raise ApiError(
            400,
            "'echo' with 'logprobs' is not supported (the prompt's tokens have no logprobs here)",
            param="echo",
            code="unsupported",
        )
    tokens, fim = _prompt_tokens(llm, prompt, suffix, pieces.fim)
    REPORT.prompt_tokens, REPORT.stop_sequence = len(tokens), None
    room = engine.n_ctx_slot - len(tokens)
    if max_tokens is None or max_tokens <= 0 or max_tokens > room:
        max_tokens = room
    stop_token = None
    if stopping_criteria is not None:
        # llama-cpp-python's chat formats make these from their stop token ids, and read only
        # the last token of ``input_ids``: they get that one, not a copy of the context per
        # token (one array, refilled).
        last = np.zeros(1, dtype=np.intc)
        no_logits = np.empty(0, dtype=np.single)

        def stop_token(token: int) -> bool:
            last[0] = token
            return bool(stopping_criteria(last, no_logits))

    chain = Sampling(
        logit_bias={int(k): float(v) for k, v in (logit_bias or {}).items()}, **sampling
    )
    asker = (cache or CacheUse()).asker(tokens)
    # A state saved before the model was last unloaded, read (and checked) here: the engine
    # thread only hands its bytes to llama.cpp.
    saved = getattr(llm, "slot_cache", None)
    restore = None
    if saved is not None:
        restore = saved.offer(tokens, asker, engine.held_prefix(tokens, asker))
    job = Job(
        tokens,
        max(max_tokens, 0),
        chain,
        logprobs,
        stop_token,
        asker=asker,
        on_progress=on_progress,
        restore=restore,
        media=media,
    )
    engine.submit(job)
    c = Completion(
        job,
        pieces,
        prompt_text=prompt if isinstance(prompt, str) else None,
        stops=[stop] if isinstance(stop, str) else list(stop or []),
        echo=echo and not stream,
        suffix=None if fim or stream else suffix,
        model=model or llm.model_path,
        on_step=on_step,
        on_usage=on_usage,
    )
    return c.chunks() if stream else c.answer()


def counted(
    llm: Any, prompt: str | list[int], model: str | None = None, into: list[int] | None = None
) -> dict[str, Any]:
    """A completion of nothing, in ``create``'s shape, whose usage counts ``prompt``'s tokens:
    what a chat handler gets back when the request only counts its prompt (``Kind.TOKENIZE``),
    or only renders it (``into`` then receives its tokens). Nothing is submitted to the
    engine."""
    tokens = _prompt_tokens(llm, prompt, None, None)[0]
    if into is not None:
        into.extend(tokens)
    n = len(tokens)
    return {
        "id": f"cmpl-{uuid.uuid4()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model or llm.model_path,
        "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n},
    }
