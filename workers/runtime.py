"""The model runtime interface, and its llama.cpp implementation (with ``workers.projector``,
the only modules that import ``llama_cpp``). A model process talks to a ``Runtime`` only, so a
test that needs a controlled delay or failure wraps the real one (``workers.faults``) behind the
same interface."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import math
import random
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from residency.errors import ApiError
from residency.grammar_limits import MAX_SCHEMA_BYTES, unbounded
from residency.settings import ModelSpec
from workers import (
    answer_format,
    chat_handler,
    chat_tools,
    completion,
    devices,
    generic_tools,
    image_prompt,
    reasoning,
    rerank,
    system_fold,
    toolcalls,
)
from workers.completion import CacheUse, OnUsage, Pieces
from workers.decode_threads import Chooser
from workers.engine import Backend, Engine, GrammarBudgetExceeded, Media, Sampling, SlotImage
from workers.load_progress import OnLoadProgress, with_progress
from workers.projector import Image, ImageError, Projector
from workers.slot_cache import SlotCache

log = logging.getLogger(__name__)

#: Tokens the repetition penalties look back over (llama-cpp-python's default).
PENALTY_LAST_N = 64

#: Called by a runtime once per generated token, streamed or not; raising ends the generation
#: (the model process's ``workers.gate.Gate.step``: cancel, deadline, shutdown).
OnStep = Callable[[], None]


@dataclass(frozen=True)
class Hooks:
    """What one request's generations report to and carry: ``on_step`` per generated token
    (may raise to end it), ``on_usage`` at each generation's end, ``on_progress`` per engine
    step of its slot (prefill chunks included: the stall watchdog's progress), and ``cache``
    (whose cached prompt prefixes it may reuse), ``images``."""

    on_step: OnStep | None = None
    on_usage: OnUsage | None = None
    on_progress: OnStep | None = None
    cache: CacheUse | None = None
    # The request's images, when it has some: its chat handler's tokenize call cuts the
    # rendered prompt at their markers (``workers.image_prompt``).
    images: image_prompt.ImagePrompt[Image] | None = None


class Runtime(Protocol):
    @property
    def parallel(self) -> int:
        """Requests it serves at once (known after load); the model process runs that many."""
        ...

    def load(self, spec: ModelSpec, device: str, on_progress: OnLoadProgress | None = None) -> None:
        """Load the model; ``on_progress`` is told the fraction done as it goes (in the
        loading thread: it must only note it)."""
        ...

    def chat(
        self,
        params: dict[str, Any],
        stream: bool,
        on_step: OnStep | None = None,
        on_usage: OnUsage | None = None,
        *,
        on_progress: OnStep | None = None,
        cache: CacheUse | None = None,
    ) -> Iterator[dict[str, Any]] | dict[str, Any]: ...

    def completion(
        self,
        params: dict[str, Any],
        stream: bool,
        on_step: OnStep | None = None,
        on_usage: OnUsage | None = None,
        *,
        on_progress: OnStep | None = None,
        cache: CacheUse | None = None,
    ) -> Iterator[dict[str, Any]] | dict[str, Any]: ...

    def embed(self, inputs: list[str]) -> dict[str, Any]: ...

    def rerank(self, query: str, documents: list[str]) -> dict[str, Any]:
        """``{"scores": [one per document, in order], "usage": {...}}``."""
        ...

    def count_tokens(self, params: dict[str, Any]) -> dict[str, Any]: ...

    def failure(self) -> BaseException | None:
        """What stopped its engine thread (None: it runs, or it has none): a process whose
        engine died can serve nothing more and exits."""
        ...

    @property
    def state_format(self) -> str:
        """What writes its slot states (a saved state is restored only by the same)."""
        ...

    def prefix_counts(self) -> dict[str, int]:
        """Since load: prompt prefixes copied from a busy slot (``copies``) and requests that
        waited for their own slot, by how the wait ended (``wait_own``, ``wait_copied``,
        ``wait_cold``)."""
        ...

    def attach_cache(self, cache: SlotCache | None) -> None:
        """Saved slot states its prompts may start from (None: none)."""
        ...

    def slot_images(self, min_tokens: int, timeout: float) -> list[SlotImage]:
        """Its free slots' memory, for a save at the drain ([] without an engine);
        ``TimeoutError`` when the engine thread does not get to it within ``timeout``."""
        ...

    def close(self) -> None: ...


# How llama-cpp-python's high-level Llama refuses input that does not fit (a ValueError, which
# the model process would otherwise answer as a 500): a prompt of n_ctx tokens or more leaves
# no room for one generated token; an embedding input must fit in one batch.
_CONTEXT = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")
_BATCH = re.compile(r"Requested tokens \((\d+)\) exceed batch size of (\d+)")


def _client_error(e: ValueError, param: str) -> ApiError | None:
    """The 400 a client should get for llama.cpp's ValueError ``e``, or None when it is not
    about the request's input."""
    msg = str(e)
    if m := _CONTEXT.search(msg):
        return ApiError(
            400,
            f"This model's maximum context length is {m[2]} tokens, and the prompt is {m[1]} "
            "tokens (at least one token must be left to generate). Shorten the "
            f"{param}.",
            param=param,
            code="context_length_exceeded",
        )
    if m := _BATCH.search(msg):
        return ApiError(
            400,
            f"An input is {m[1]} tokens; this embedding model takes at most {m[2]} per input.",
            param=param,
            code="context_length_exceeded",
        )
    return None


def grammar_budget_error(e: GrammarBudgetExceeded, param: str | None) -> ApiError:
    """The client's error for a request whose grammar (from ``param``) used its budget: its
    own schema is the cause, and sending it again costs the same."""
    return ApiError(
        400,
        f"{e}: the JSON schema in '{param or 'grammar'}' is too costly to enforce on this "
        "model (see [worker] grammar_budget_s); simplify it (patterns with nested repeats "
        "are the usual cause)",
        param=param,
        code="grammar_budget_exceeded",
    )


@contextlib.contextmanager
def _client_errors(param: str, grammar_param: str | None = None) -> Iterator[None]:
    """llama.cpp's ValueErrors about the request's input, a chat template's refusal of its
    messages, and a grammar past its budget, raised as the client's 400."""
    try:
        yield
    except ValueError as e:
        err = _client_error(e, param) or _template_refusal(e)
        if err is None:
            raise
        raise err from None
    except GrammarBudgetExceeded as e:
        raise grammar_budget_error(e, grammar_param) from None


def _template_refusal(e: ValueError) -> ApiError | None:
    """The 400 for a chat template's own ``raise_exception`` (e.g. "Conversation roles must
    alternate"): llama-cpp-python's Jinja formatters raise it as a ValueError from a function
    of that name, so the innermost frame tells it from any other ValueError."""
    tb: TracebackType | None = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_code.co_name != "raise_exception":
        return None
    return ApiError(
        400,
        f"this model's chat template refused the messages: {e}",
        param="messages",
        code="invalid_messages",
    )


# The hooks of the request the calling thread serves: ``create_completion`` is reached through
# llama-cpp-python's chat handlers, which pass on no argument of ours.
_serving = threading.local()


@contextlib.contextmanager
def _hooked(hooks: Hooks) -> Iterator[None]:
    prev = getattr(_serving, "hooks", None)
    _serving.hooks = hooks
    try:
        yield
    finally:
        _serving.hooks = prev


def _guarded(
    chunks: Iterator[dict[str, Any]], param: str, hooks: Hooks, grammar_param: str | None
) -> Iterator[dict[str, Any]]:
    """A stream whose every step runs with the request's hooks in place: a chat handler may
    create its completions lazily, inside its stream (functionary does), and they must still
    get the per-token hook and count usage. Closing it closes the engine's (which cancels its
    job)."""
    it = iter(chunks)
    try:
        with _client_errors(param, grammar_param):
            while True:
                with _hooked(hooks):
                    try:
                        chunk = next(it)
                    except StopIteration:
                        return
                yield chunk
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            with _hooked(hooks):
                close()


#: A JSON string's character, as llama.cpp's own converter writes it: no raw control character
#: (JSON wants them escaped; llama-cpp-python's copy admits \x00-\x1F, and a model sampling
#: one makes the answer fail to parse).
STRICT_CHAR = (
    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
    r"[0-9a-fA-F])"
)
#: A pattern's "." inside a JSON string: not a line break (as the converter means it), nor a
#: quote, backslash or control character, which would end or break the string.
STRICT_DOT = r'[^"\\\x7F\x00-\x1F]'


@functools.lru_cache(maxsize=256)
def _converts(schema: str) -> bool:
    """Whether llama-cpp-python's converter takes the JSON schema ``schema``. Remembered: an
    agent sends the same tools on every request, which would otherwise cost the serving
    thread one conversion per tool per request before the union's own. Bounded: at most 256
    schemas of at most 64 KiB each; it holds a yes or no per schema, nothing of any answer."""
    from llama_cpp import llama_grammar

    _strict_strings()
    try:
        llama_grammar.json_schema_to_gbnf(schema)
    except Exception:  # the converter raises ValueError, AssertionError, KeyError...
        return False
    return True


@functools.cache
def _strict_strings() -> None:
    """Every grammar this process builds from a JSON schema — ours (``_grammar``) and those
    llama-cpp-python's chat handlers build for tools — goes through its converter's rule
    table: the string rules are set there, once."""
    from llama_cpp import llama_grammar

    llama_grammar.PRIMITIVE_RULES["char"] = llama_grammar.BuiltinRule(STRICT_CHAR, [])
    llama_grammar.DOT = STRICT_DOT


#: ``[models.X] flash_attn`` as llama.cpp's ``llama_flash_attn_type``.
FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}


@functools.cache
def _batched_llama() -> Any:
    """llama_cpp.Llama whose ``create_completion`` runs on the batched engine. Its chat handlers
    (formatters, tools, response_format grammars) call ``create_completion`` on the model
    object, so chat requests reach the engine through them unchanged."""
    import llama_cpp  # imported here: web and coordinator processes never need it

    _strict_strings()

    class BatchedLlama(llama_cpp.Llama):
        engine: Engine | None = None
        pieces: Pieces | None = None
        slot_cache: SlotCache | None = None  # saved slot states a prompt may start from
        projector: Projector | None = None  # a vision model's (``[models.X] mmproj``)

        def __init__(
            self, *args: Any, sequences: int = 1, flash_attn_type: int = -1, **kwargs: Any
        ) -> None:
            self._sequences = sequences
            self._flash_attn_type = flash_attn_type
            super().__init__(*args, **kwargs)

        # The constructor makes its context from these parameters right after it sets them:
        # every assignment gets ``sequences`` sequences, each with its own KV cells (not
        # unified, so one slot's long prompt never takes another's room), and n_ctx is their
        # total. One context, made once. Flash attention is the spec's: the constructor writes
        # on or off into the parameters after this assignment (it has no "auto", llama.cpp's
        # own default and llama-server's: decide per device), so every read puts the spec's
        # back, and the read that hands them to the context gets it.
        @property
        def context_params(self) -> Any:
            self._context_params.flash_attn_type = self._flash_attn_type
            return self._context_params

        @context_params.setter
        def context_params(self, params: Any) -> None:
            params.n_seq_max = self._sequences
            params.kv_unified = False
            self._context_params = params

        def create_completion(self, prompt: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            assert self.engine is not None and self.pieces is not None
            if getattr(_serving, "count_only", False):
                texts = getattr(_serving, "prompts", None)
                if texts is not None:  # a probe of the chat handler (LlamaRuntime._renders)
                    texts.append(prompt if isinstance(prompt, str) else self._text(prompt))
                into = getattr(_serving, "rendered", None)
                return completion.counted(self, prompt, kwargs.get("model"), into)
            hooks: Hooks = getattr(_serving, "hooks", None) or Hooks()
            media = None
            if hooks.images is not None and hooks.images.media:
                assert self.projector is not None
                # The encoder runs here, in the serving thread, beside the engine's steps. Each
                # image counts as progress: a real encoder on a CPU takes seconds an image, and
                # the stall watchdog must not take eight of them for a hang.
                for image in hooks.images.media.values():
                    self.projector.encode(image)
                    if hooks.on_progress is not None:
                        hooks.on_progress()
                media = {at: Media(im.n_tokens, im) for at, im in hooks.images.media.items()}
            return completion.create(
                self,
                self.engine,
                self.pieces,
                hooks.on_step,
                on_usage=hooks.on_usage,
                on_progress=hooks.on_progress,
                cache=hooks.cache,
                media=media,
                prompt=prompt,
                **kwargs,
            )

        def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
            hooks = getattr(_serving, "hooks", None)
            images = None if hooks is None else hooks.images
            if images is None or images.marker.encode("utf-8") not in text:
                return super().tokenize(text, add_bos, special)
            projector = self.projector
            if projector is None:
                raise RuntimeError("images for a model loaded without a vision projector")

            def plain(part: bytes, bos: bool) -> list[int]:
                return super(BatchedLlama, self).tokenize(part, bos, special) if part or bos else []

            def image(data: bytes, param: str) -> list[int | Image]:
                try:
                    return projector.tokenize(data)
                except ImageError as e:
                    msg = f"'{param}': {e}"
                    raise ApiError(400, msg, param=param, code="invalid_image") from None

            return image_prompt.tokenize(
                images, text, add_bos, plain, image, lambda i: i.n_tokens, lambda i: i.token
            )

        def _text(self, tokens: list[int]) -> str:
            return bytes(self.detokenize(tokens, special=True)).decode("utf-8", "replace")

    return BatchedLlama


class LlamaSampling:
    """One request's samplers: llama-cpp-python's chain, and the grammar apart from it (None
    without one), so that the engine can check a drawn token before applying the grammar to
    the whole vocabulary."""

    def __init__(self, chain: Any, grammar: Any) -> None:
        self.chain = chain
        self.grammar = grammar

    def close(self) -> None:
        import llama_cpp

        self.chain.close()
        if self.grammar is not None:
            llama_cpp.llama_sampler_free(self.grammar)
            self.grammar = None

    def __del__(self) -> None:
        # A job failed before the engine took it (a closing engine) is never closed by it.
        self.close()


class LlamaBackend:
    """The engine's view of one llama.cpp context (``workers.engine.Backend``): its batch,
    decode, samplers, logits and per-sequence memory."""

    def __init__(self, llm: Any, n_batch: int) -> None:
        import llama_cpp
        from llama_cpp import _internals

        self._lib = llama_cpp
        self._internals = _internals
        self._llm = llm
        self._ctx = llm._ctx
        self._mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
        self._vocab = llm._model.vocab
        self.n_vocab = int(llm.n_vocab())
        self.n_swa = int(llama_cpp.llama_model_n_swa(llm._model.model))
        self._batch = _internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)
        self._n = 0
        # The candidates ``draw`` and ``allows`` hand the samplers, reused (only the engine
        # thread samples): the whole vocabulary, and one token.
        td = llama_cpp.llama_token_data
        self._ids = np.arange(self.n_vocab, dtype=np.intc)
        self._all = (td * self.n_vocab)()
        self._all_np = np.ctypeslib.as_array(self._all)
        self._one = (td * 1)()
        self._arr = llama_cpp.llama_token_data_array()
        self._by_piece: dict[bytes, int] | None = None  # piece -> token, built when needed
        # A model loaded with a vision projector decodes images through it
        # (``workers.projector.Projector.decoder``).
        self.images: Callable[[Any, int, int], int] | None = None

    def sampler(self, sp: Sampling) -> LlamaSampling:
        """llama-cpp-python's own chain, in its order: bias, penalties, then greedy
        (temperature 0), mirostat, or top-k / typical / top-p / min-p / temperature / draw;
        the grammar is kept apart (``LlamaSampling``)."""
        grammar = None
        if sp.grammar is not None:
            grammar = self._lib.llama_sampler_init_grammar(
                self._vocab, sp.grammar._grammar.encode("utf-8"), sp.grammar._root.encode("utf-8")
            )
            if not grammar:
                raise ValueError("llama.cpp refused the request's grammar")
        s = self._internals.LlamaSampler()
        seed = sp.seed if sp.seed is not None else random.getrandbits(32)
        if sp.logit_bias:
            s.add_logit_bias(self.n_vocab, sp.logit_bias)
        s.add_penalties(
            n_vocab=self.n_vocab,
            penalty_last_n=PENALTY_LAST_N,
            penalty_repeat=sp.repeat_penalty,
            penalty_freq=sp.frequency_penalty,
            penalty_present=sp.presence_penalty,
        )
        if sp.temperature < 0:
            s.add_dist(seed)
        elif sp.temperature == 0:
            s.add_greedy()
        elif sp.mirostat_mode == 1:
            s.add_mirostat(self.n_vocab, seed, sp.mirostat_tau, sp.mirostat_eta, 100)
        elif sp.mirostat_mode == 2:
            s.add_mirostat_v2(seed, sp.mirostat_tau, sp.mirostat_eta)
        else:
            s.add_top_k(sp.top_k)
            s.add_typical(sp.typical_p, 1)
            s.add_top_p(sp.top_p, 1)
            s.add_min_p(sp.min_p, 1)
            s.add_temp(sp.temperature)
            s.add_dist(seed)
        return LlamaSampling(s, grammar)

    def add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        b, n = self._batch.batch, self._n
        b.token[n] = token
        b.pos[n] = pos
        b.n_seq_id[n] = 1
        b.seq_id[n][0] = seq
        b.logits[n] = logits
        self._n = n + 1

    def set_threads(self, threads: int) -> None:
        # Both counts: llama.cpp uses n_threads for a one-token batch, n_threads_batch else.
        self._lib.llama_set_n_threads(self._ctx.ctx, threads, threads)

    def decode(self) -> int:
        self._batch.batch.n_tokens, self._n = self._n, 0
        return int(self._lib.llama_decode(self._ctx.ctx, self._batch.batch))

    def sample(self, sampler: Any, idx: int) -> int:
        return int(sampler.chain.sample(self._ctx, idx))

    def _candidates(self, data: Any, size: int) -> Any:
        # Set whole each time: a sampler may move the data pointer, and sorts and cuts it.
        arr: Any = self._arr
        arr.data = ctypes.cast(data, ctypes.POINTER(self._lib.llama_token_data))
        arr.size = size
        arr.selected = -1
        arr.sorted = False
        return ctypes.byref(arr)

    def draw(self, sampler: Any, idx: int, grammar: bool) -> int | None:
        cand = self._all_np
        cand["id"] = self._ids
        cand["logit"] = self.logits(idx)
        cand["p"] = 0.0
        ref = self._candidates(self._all, self.n_vocab)
        if grammar and sampler.grammar is not None:
            self._lib.llama_sampler_apply(sampler.grammar, ref)
        self._lib.llama_sampler_apply(sampler.chain.sampler, ref)
        arr = self._arr
        if not 0 <= arr.selected < arr.size:
            raise RuntimeError("the sampler chain selected no token")
        chosen = arr.data[arr.selected]
        # What the grammar refused stays at -inf through the chain (it only shifts, scales
        # and cuts): checking it here saves a second pass of the grammar over its stacks.
        if grammar and chosen.logit == -math.inf:
            return None
        return int(chosen.id)

    def allows(self, sampler: Any, token: int) -> bool:
        if sampler.grammar is None:
            return True
        one: Any = self._one[0]
        one.id, one.logit, one.p = token, 1.0, 0.0
        self._lib.llama_sampler_apply(sampler.grammar, self._candidates(self._one, 1))
        return bool(math.isfinite(self._arr.data[0].logit))

    def accept(self, sampler: Any, token: int) -> None:
        if sampler.grammar is not None:
            self._lib.llama_sampler_accept(sampler.grammar, token)
        self._lib.llama_sampler_accept(sampler.chain.sampler, token)

    def logits(self, idx: int) -> np.ndarray:
        ptr = self._lib.llama_get_logits_ith(self._ctx.ctx, idx)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def seq_rm(self, seq: int, p0: int) -> bool:
        return bool(self._lib.llama_memory_seq_rm(self._mem, seq, p0, -1))

    def seq_pos_min(self, seq: int) -> int:
        return int(self._lib.llama_memory_seq_pos_min(self._mem, seq))

    def state_get(self, seq: int) -> bytes:
        ctx = self._ctx.ctx
        size = int(self._lib.llama_state_seq_get_size(ctx, seq))
        if size <= 0:
            return b""
        buf = (ctypes.c_uint8 * size)()
        n = int(self._lib.llama_state_seq_get_data(ctx, buf, size, seq))
        return bytes(memoryview(buf)[:n])

    def state_set(self, seq: int, data: bytes) -> bool:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(self._lib.llama_state_seq_set_data(self._ctx.ctx, buf, len(data), seq)) > 0

    #: Each slot has its own cells (not unified): llama.cpp copies one sequence into another
    #: only whole (the stream's buffer, at the next decode); the engine then drops what follows
    #: the shared prefix.
    copies = True

    def decode_image(self, image: Any, pos: int, seq: int) -> int:
        if self.images is None:
            raise RuntimeError("an image for a model loaded without a vision projector")
        return self.images(image, pos, seq)

    def seq_cp(self, src: int, dst: int) -> bool:
        self._lib.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        return True

    def tokenize(self, text: str) -> list[int]:
        """Tokens whose pieces spell exactly ``text``, with the special tokens it names (a
        scripted generation's text, ``workers.faults``); no BOS: it is a continuation. Reads
        the vocabulary only, so any thread may call it."""
        data = text.encode("utf-8")
        tokens = [int(t) for t in self._llm.tokenize(data, False, True)]
        spelled = b"".join(self._llm.detokenize([t], special=True) for t in tokens)
        first = self.piece(tokens[0]) if tokens else b""
        if spelled != b" " + data or not first.startswith(b" "):
            return tokens
        # A SentencePiece vocabulary puts a space before the text (its "▁" word prefix): the
        # first piece is spelled without it, so the generation is the text and nothing more.
        return self._spelled(first[1:]) + tokens[1:]

    def _spelled(self, data: bytes) -> list[int]:
        """``data`` as the tokens whose pieces are its bytes, longest piece first."""
        if self._by_piece is None:
            by_piece: dict[bytes, int] = {}
            for t in range(self.n_vocab):
                p = self.piece(t)
                if p:  # control tokens have no piece
                    by_piece.setdefault(p, t)
            self._by_piece = by_piece
        longest = max(map(len, self._by_piece))
        out: list[int] = []
        i = 0
        while i < len(data):
            for j in range(min(len(data), i + longest), i, -1):
                found = self._by_piece.get(data[i:j])
                if found is not None:
                    out.append(found)
                    i = j
                    break
            else:
                raise ValueError(f"this vocabulary cannot spell {data[i:]!r}")
        return out

    def end_token(self) -> int:
        """A token that ends a generation (``is_eog``): end of sequence, else end of turn."""
        lib, v = self._lib, self._vocab
        eos = int(lib.llama_vocab_eos(v))
        return eos if eos != lib.LLAMA_TOKEN_NULL else int(lib.llama_vocab_eot(v))

    def piece(self, token: int) -> bytes:
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, size, 0, False)
            if n >= 0:
                return buf.raw[:n]
            size = -n  # the piece needs this many bytes

    def fim(self) -> tuple[int, int, int] | None:
        lib, v = self._lib, self._vocab
        toks = (lib.llama_vocab_fim_pre(v), lib.llama_vocab_fim_suf(v), lib.llama_vocab_fim_mid(v))
        return toks if min(toks) >= 0 else None

    def close(self) -> None:
        self._batch.close()


def _grammar_param(plan: chat_tools.Plan) -> str | None:
    """The field of a chat request its grammar comes from (None: it has none)."""
    if plan.generic is not None:
        return plan.generic.param
    if plan.forced is not None:
        return plan.forced[0]
    if plan.schema is not None or plan.params.get("tools"):
        return "tools"  # tool_choice required, or a function-calling chat format's grammar
    rf = plan.params.get("response_format")
    return "response_format" if isinstance(rf, dict) else None


def _pair_format(llm: Any) -> rerank.PairFormat:
    """How the loaded reranker's pairs are laid out: its rerank template, or the tokens its
    vocabulary adds (llama.cpp's server reads the same)."""
    import llama_cpp

    raw = llama_cpp.llama_model_chat_template(llm._model.model, b"rerank")
    if raw:
        return rerank.PairFormat(template=raw.decode("utf-8"))
    vocab = llm._model.vocab
    eos = llama_cpp.llama_vocab_eos(vocab)
    if eos == llama_cpp.LLAMA_TOKEN_NULL:
        eos = llama_cpp.llama_vocab_sep(vocab)
    return rerank.PairFormat(
        bos=llama_cpp.llama_vocab_bos(vocab) if llama_cpp.llama_vocab_get_add_bos(vocab) else None,
        eos=eos if llama_cpp.llama_vocab_get_add_eos(vocab) else None,
        sep=llama_cpp.llama_vocab_sep(vocab) if llama_cpp.llama_vocab_get_add_sep(vocab) else None,
    )


def _templates(llm: Any) -> dict[str, str]:
    """The GGUF's chat templates under the handler names llama-cpp-python gives them."""
    meta: dict[str, str] = dict(getattr(llm, "metadata", {}) or {})
    out = {
        k.removeprefix("tokenizer."): v
        for k, v in meta.items()
        if k.startswith("tokenizer.chat_template.")
    }
    if "tokenizer.chat_template" in meta:
        out["chat_template.default"] = meta["tokenizer.chat_template"]
    return out


def _control_markers(
    llm: Any, piece: Callable[[int], bytes], markers: tuple[str, ...]
) -> dict[int, bytes]:
    """The ``markers`` that are one control token of the loaded vocabulary, which ``piece``
    renders as nothing (as llama-cpp-python renders control tokens), by token → their text."""
    out: dict[int, bytes] = {}
    for marker in markers:
        data = marker.encode("utf-8")
        tokens = [int(t) for t in llm.tokenize(data, add_bos=False, special=True)]
        if len(tokens) != 1 or piece(tokens[0]):
            continue  # plain text, or a token rendered as its text already
        if bytes(llm.detokenize(tokens, special=True)) == data:
            out[tokens[0]] = data
    return out


def _preserving(piece: Callable[[int], bytes], kept: dict[int, bytes]) -> Callable[[int], bytes]:
    """``piece``, with the tokens of ``kept`` rendered as their text."""

    def render(token: int) -> bytes:
        text = kept.get(token)
        return piece(token) if text is None else text

    return render


class LlamaRuntime:
    """``wrap`` wraps the engine's backend: a test that must decide when each step runs puts
    a gate in front of the real one (same interface)."""

    def __init__(
        self, wrap: Callable[[Backend], Backend] | None = None, grammar_budget_s: float = 0.0
    ) -> None:
        self._wrap = wrap
        # Engine thread seconds a request's grammar may take ([worker] grammar_budget_s).
        self._grammar_budget_s = grammar_budget_s
        self._llm: Any = None
        self._engine: Engine | None = None
        self._parallel = 1
        self._tools: str | None = None  # how the loaded model takes tools (chat_tools)
        # Where its answers' reasoning is and how their calls look, the template that renders
        # its prompts, and per reasoning_effort whether the prompt leaves an answer inside
        # reasoning (decided at load: ``_read_answers``).
        self._answer = answer_format.AnswerFormat()
        # Whether its template writes a call's JSON-string arguments as a string of JSON: its
        # history's arguments are then given as objects (``chat_tools.encodes_arguments``).
        self._object_arguments = False
        self._template: str | None = None
        self._inside: dict[str | None, bool] = {}
        # Which system messages its chat handler renders where they stand (probed at load).
        self._system = system_fold.ALL
        # How a rerank model's (query, document) pairs are laid out; None: not a rerank model.
        self._pairs: rerank.PairFormat | None = None

    @property
    def parallel(self) -> int:
        return self._parallel

    def load(self, spec: ModelSpec, device: str, on_progress: OnLoadProgress | None = None) -> None:
        if spec.path is None:
            raise ValueError("a remote model is never loaded")
        # Embedding and rerank models pool each sequence into one output: no engine, no
        # sampling. A request is one call: they run one at a time, on llama-cpp-python's own
        # batch.
        embedding = spec.type in ("embedding", "rerank")
        self._parallel = 1 if embedding else (spec.parallel or devices.default_parallel(device))
        import llama_cpp

        kind: dict[str, Any] = (
            {"embedding": True, "flash_attn": spec.flash_attn == "on"}
            if embedding
            else {
                "sequences": self.parallel,
                "n_ctx": spec.n_ctx * self.parallel,
                "flash_attn_type": FLASH_ATTN_TYPES[spec.flash_attn],
            }
        )
        if spec.type == "rerank":
            # Rank pooling attaches the reranker's classification head: one score per
            # sequence (what llama.cpp's server does with --reranking).
            kind["pooling_type"] = llama_cpp.LLAMA_POOLING_TYPE_RANK
        model_class = llama_cpp.Llama if embedding else _batched_llama()
        self._llm = with_progress(model_class, on_progress)(
            model_path=spec.path,
            # A CPU device never offloads, whatever the spec asks for a GPU host.
            n_gpu_layers=0 if devices.is_cpu(device) else spec.n_gpu_layers,
            # Unset: one thread per core this process may run on (llama-cpp-python's default
            # is half the machine's cores).
            n_threads=spec.n_threads or devices.default_threads(),
            n_threads_batch=spec.n_threads_batch or devices.default_threads(),
            n_batch=spec.n_batch,
            chat_format=spec.chat_format,
            verbose=False,
            **({"n_ctx": spec.n_ctx} | kind),
        )
        if spec.type == "rerank":
            self._pairs = _pair_format(self._llm)
        if not embedding:
            n_batch = max(spec.n_batch, self.parallel)
            backend = LlamaBackend(self._llm, n_batch)
            if spec.mmproj is not None:
                projector = Projector(
                    spec.mmproj,
                    self._llm,
                    spec.n_threads_batch or devices.default_threads(),
                    use_gpu=not devices.is_cpu(device) and spec.n_gpu_layers != 0,
                )
                self._llm.projector = projector
                backend.images = projector.decoder(self._llm._ctx.ctx, n_batch)
            engine_backend: Backend = self._wrap(backend) if self._wrap else backend
            # Unset thread counts: each step's is measured, all of them or one fewer
            # (``workers.decode_threads``); a count the config sets is used as it is.
            adaptive = spec.n_threads is None and spec.n_threads_batch is None
            self._engine = Engine(
                engine_backend,
                self.parallel,
                spec.n_ctx,
                n_batch,
                self._grammar_budget_s,
                threads=Chooser(devices.default_threads()) if adaptive else None,
            )
            self._llm.engine = self._engine
            self._llm.pieces = Pieces(backend.piece, backend.fim())
            # The handler is chosen before tools and system messages are asked about: both
            # depend on which template renders the prompt.
            self._choose_handler(spec)
            self._system = self._probe_system()
            self._tools = chat_tools.support(self._llm.chat_format, _templates(self._llm))
            probe = self._renders(chat_tools.PROBE_CALL) if self._tools else None
            self._object_arguments = chat_tools.encodes_arguments(probe)
            # After both: the answers' format depends on the template and on its tools.
            self._read_answers(spec, backend)

    def _choose_handler(self, spec: ModelSpec) -> None:
        """Serve with the GGUF's own template rather than a built-in format that
        ``chat_format`` names, when it has one (``workers.chat_handler``)."""
        from llama_cpp import llama_chat_format

        formats = llama_chat_format.LlamaChatCompletionHandlerRegistry()._chat_handlers
        chosen = chat_handler.preferred(spec.chat_format, _templates(self._llm), formats)
        if spec.chat_format is not None and chosen != spec.chat_format:
            log.info(
                "%s: chat_format '%s' is a built-in format; the GGUF's own chat template is "
                "used instead",
                spec.path,
                spec.chat_format,
            )
            self._llm.chat_format = chosen

    def _read_answers(self, spec: ModelSpec, backend: LlamaBackend) -> None:
        """How the loaded model's answers are read (``workers.answer_format``); for each
        ``reasoning_effort`` its template renders differently, whether the generation prompt
        leaves the answer inside a reasoning block; and the format's markers that are control
        tokens of its vocabulary rendered as text (llama-server's "preserved tokens"), or its
        readers would never see them."""
        template = _templates(self.llm).get(self.llm.chat_format or "")
        takes_tools = self._tools == chat_tools.TEMPLATE
        fmt = answer_format.decide(spec.reasoning, spec.tool_format, template, takes_tools)
        self._template, self._answer, self._inside = template, fmt, {}
        if fmt.reasoning.open:
            varies = bool(reasoning.template_kwargs("none", template))
            probe = [{"role": "user", "content": "probeuserone"}]
            for effort in (None, *reasoning.EFFORTS) if varies else (None,):
                prompt = self._renders(probe, reasoning.template_kwargs(effort, template))
                self._inside[effort] = prompt is not None and reasoning.ends_open(
                    prompt, fmt.reasoning
                )
        kept = _control_markers(self.llm, backend.piece, fmt.markers)
        if kept:
            self._llm.pieces = Pieces(_preserving(backend.piece, kept), backend.fim())
        if fmt.reasoning.splits or fmt.tools is not None:
            log.info(
                "%s: reasoning %s, tool calls %s, markers rendered as text %s",
                spec.path,
                "harmony" if fmt.reasoning.harmony else fmt.reasoning.markers or "none",
                fmt.tools or "none",
                sorted(v.decode("utf-8") for v in kept.values()) or "none",
            )

    def _chat_create(self, template_kwargs: dict[str, Any]) -> Callable[..., Any]:
        """``create_chat_completion``; with template variables to pass, its chat handler called
        as it calls it, plus those: it passes on no argument it does not name, while the Jinja
        handler renders its extra arguments into the template."""
        llm = self.llm
        if not template_kwargs:
            return llm.create_chat_completion
        import inspect

        from llama_cpp import llama_chat_format

        handler = (
            llm.chat_handler
            or llm._chat_handlers.get(llm.chat_format)
            or llama_chat_format.get_chat_completion_handler(llm.chat_format)
        )
        signature = inspect.signature(llm.create_chat_completion)

        def create(**params: Any) -> Any:
            bound = signature.bind(**params)  # its own TypeError for an unknown argument
            bound.apply_defaults()
            return handler(llama=llm, **bound.arguments, **template_kwargs)

        return create

    def _renders(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
    ) -> str | None:
        """The prompt text the loaded chat handler renders for ``messages`` (with the template
        variables ``template_kwargs``), generating nothing (None: it refused them)."""
        prompts: list[str] = []
        prev = getattr(_serving, "count_only", False), getattr(_serving, "prompts", None)
        _serving.count_only, _serving.prompts = True, prompts
        try:
            self._chat_create(template_kwargs or {})(messages=messages)
        except Exception:  # a template's raise_exception, or a handler that cannot render it
            return None
        finally:
            _serving.count_only, _serving.prompts = prev
        return "".join(prompts)

    def _probe_system(self) -> system_fold.SystemRoles:
        """Which system messages the loaded chat handler renders where they stand, by
        rendering a few probe conversations (``workers.system_fold``)."""
        s1, s2, s3, u1, a1, u2 = (
            f"probe{w}" for w in ("sysone", "systwo", "systhree", "userone", "answer", "usertwo")
        )
        sys1, sys2 = {"role": "system", "content": s1}, {"role": "system", "content": s2}
        user = {"role": "user", "content": u1}
        base = self._renders([user])
        if base is None:
            # Nothing can be learnt (a handler that needs more than the model has, e.g.
            # functionary-v2's Hugging Face tokenizer): it gets the messages as they are.
            log.warning(
                "%s: the chat handler refuses a plain user turn; messages are passed to it "
                "unchanged",
                self.llm.model_path,
            )
            return system_fold.ALL
        one = self._renders([sys1, user]) or ""
        two = self._renders([sys1, sys2, user]) or ""
        later = (
            self._renders(
                [
                    sys1,
                    user,
                    {"role": "assistant", "content": a1},
                    {"role": "system", "content": s3},
                    {"role": "user", "content": u2},
                ]
            )
            or ""
        )
        folded = self._renders([{"role": "user", "content": s1 + system_fold.SEPARATOR + u1}])
        roles = system_fold.SystemRoles(
            leading=s1 in one,
            several=s1 in two and s2 in two,
            later=s3 in later,
            # A handler that drops even a user turn's text (open-orca) can be given a system
            # text in none: such a message is refused.
            folds=u1 in base and folded is not None and s1 in folded,
        )
        if not roles.complete:
            log.info(
                "%s: system messages folded where the chat handler drops them: %s",
                self.llm.model_path,
                roles,
            )
        return roles

    @property
    def system_roles(self) -> system_fold.SystemRoles:
        """What the loaded chat handler renders of system messages."""
        return self._system

    def render(self, messages: list[dict[str, Any]]) -> str | None:
        """The prompt text a chat request with ``messages`` gives the model (system messages
        folded as ``chat`` folds them), generating nothing; None: the handler refused them."""
        return self._renders(system_fold.fold(messages, self._system))

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("no engine: not loaded, or an embedding model")
        return self._engine

    @staticmethod
    def warm_up() -> None:
        """Pay what every load pays before it knows its model — importing llama.cpp and
        initializing its backend — in a standby process, ahead of the load command."""
        import llama_cpp

        llama_cpp.llama_backend_init()

    @property
    def llm(self) -> Any:
        if self._llm is None:
            raise RuntimeError("runtime used before load")
        return self._llm

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
        params, images = self._with_images(params)
        if cache is not None and cache.scope == "shared_system":
            cache = CacheUse(cache.owner, cache.scope, self._system_tokens(params))
        params, template_kwargs, inside = self._reasoning_params(params)
        if self._object_arguments and isinstance(params.get("messages"), list):
            params = {**params, "messages": chat_tools.object_arguments(params["messages"])}
        plan = chat_tools.plan(params, self._tools, self.llm.chat_format, stream)
        params = self._grammars(plan)
        # After the plan: the generic tool format's instructions are a system message too,
        # which a handler that drops system messages must be given folded.
        if params.get("messages"):
            params = {**params, "messages": system_fold.fold(params["messages"], self._system)}
        create = self._chat_create(template_kwargs)
        hooks = Hooks(on_step, on_usage, on_progress, cache, images)
        out = self._call(create, params, stream, "messages", hooks, _grammar_param(plan))
        if plan.generic is not None:
            names = plan.generic.names
            if stream:
                return toolcalls.stream_with_calls(out, names, generic_tools.Reader)
            return toolcalls.answer_with_calls(out, names, generic_tools.Reader)
        reader_for, splits = self._reader_for(plan, params, inside)
        if reader_for is not None:
            return self._read(out, stream, plan.parse, reader_for, splits)
        return toolcalls.normalized_calls(out) if plan.normalize else out

    def _reasoning_params(
        self, params: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], bool]:
        """A chat request's arguments without ``reasoning_effort`` and with its earlier turns'
        reasoning as the template takes it (``workers.reasoning.history``); the template
        variables its effort sets; and whether its prompt leaves the answer inside a
        reasoning block."""
        params = dict(params)
        effort = params.pop("reasoning_effort", None)
        if isinstance(params.get("messages"), list):
            params["messages"] = reasoning.history(
                params["messages"], self._answer.reasoning, self._template
            )
        reasoning.TALLY.tokens = None  # counted by ``_read``'s stream, when it splits
        inside = self._inside.get(effort, self._inside.get(None, False))
        return params, reasoning.template_kwargs(effort, self._template), inside

    def _reader_for(
        self, plan: chat_tools.Plan, params: dict[str, Any], inside: bool
    ) -> tuple[toolcalls.ReaderFor | None, bool]:
        """The reader of the answer's text (None: it is the answer as it is), and whether it
        splits reasoning off. A grammar that makes the answer one JSON call (``tool_choice:
        "required"``) is read as one; a grammar leaves no room for reasoning, nor does a
        handler's forced call."""
        if plan.schema is not None:
            return toolcalls.ToolText, False
        rf = params.get("response_format")
        free = params.get("grammar") is None and (rf is None or rf.get("type") == "text")
        answer = self._answer if free else answer_format.AnswerFormat(tools=self._answer.tools)
        splits = answer.reasoning.splits
        if plan.parse:
            tools = params.get("tools") or []
            reader_for = answer.reader_for(plan.parse, tools, inside)
            return reader_for or toolcalls.ToolText, splits
        if plan.normalize or not free:
            return None, False
        return answer.reader_for(frozenset(), [], inside), splits

    def _read(
        self,
        out: Any,
        stream: bool,
        names: frozenset[str],
        reader_for: toolcalls.ReaderFor,
        splits: bool,
    ) -> Any:
        """The handler's answer read by ``reader_for``: its calls as ``tool_calls``, and where
        it ``splits`` reasoning off, its reasoning as ``reasoning_content``, counted
        (``_reasoning_tokens``) into the usage (a stream's by the model process, from
        ``reasoning.TALLY``)."""
        if stream:
            chunks = toolcalls.stream_with_calls(out, names, reader_for)
            return reasoning.tallied(chunks, self._reasoning_tokens) if splits else chunks
        resp = toolcalls.answer_with_calls(out, names, reader_for)
        if splits and isinstance(resp.get("usage"), dict):
            message = resp["choices"][0].get("message") or {}
            text = message.get("reasoning_content") or ""
            reasoning.usage_details(resp["usage"], self._reasoning_tokens(text))
        return resp

    def _reasoning_tokens(self, text: str) -> int:
        """The tokens of an answer's reasoning: its text as the model's tokenizer splits it
        (the markers around it are not counted)."""
        if not text:
            return 0
        return len(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def _with_images(
        self, params: dict[str, Any]
    ) -> tuple[dict[str, Any], image_prompt.ImagePrompt[Image] | None]:
        """A chat request's messages with its images made markers in their text, and the
        images (``workers.image_prompt``); None without any."""
        messages = params.get("messages")
        if not image_prompt.has_images(messages):
            return params, None
        if getattr(self.llm, "projector", None) is None:
            raise ApiError(
                400,
                "this model cannot read images (it has no vision projector)",
                param="messages",
                code="model_not_multimodal",
            )
        assert isinstance(messages, list)
        messages, images = image_prompt.prepare(messages)
        return {**params, "messages": messages}, images

    def _system_tokens(self, params: dict[str, Any]) -> list[int]:
        """The tokens of the request's leading system message(s) rendered alone by the model's
        chat handler (as a user turn holding only their text where the handler folds them,
        ``system_fold.shared_head``), without tools or anything else the request adds: the
        prompt's tokens that begin with these are its part other users may share. Empty when
        it has none, or the template will not render them alone."""
        system = system_fold.shared_head(params.get("messages") or [], self._system)
        if not system:
            return []
        rendered: list[int] = []
        prev = getattr(_serving, "count_only", False), getattr(_serving, "rendered", None)
        _serving.count_only, _serving.rendered = True, rendered
        try:
            self.llm.create_chat_completion(messages=system)
        except Exception:  # a template that needs a user turn: nothing is shared
            return []
        finally:
            _serving.count_only, _serving.rendered = prev
        return rendered

    def _grammars(self, plan: chat_tools.Plan) -> dict[str, Any]:
        """The request's arguments with each JSON schema it asks for compiled here, so that a
        schema the grammar cannot express is the client's 400, never a quiet fallback to any
        JSON (llama-cpp-python falls back) nor a grammar llama.cpp refuses at sampling time."""
        params = dict(plan.params)
        rf = params.get("response_format")
        if plan.generic is not None:
            params["grammar"] = self._generic_grammar(plan.generic)
        if plan.forced is not None:
            self._grammar(plan.forced[1], plan.forced[0])  # checked; the handler builds it
        if plan.schema is not None:
            params["grammar"] = self._grammar(plan.schema, "tools")
        elif isinstance(rf, dict) and rf.get("type") == "json_object":
            params.pop("response_format")
            params["grammar"] = self._grammar(rf.get("schema"), "response_format")
        return params

    def _generic_grammar(self, g: generic_tools.Generic) -> Any:
        """The generic format's grammar. A forced call's schemas were checked by web, and one
        it cannot enforce is the client's 400. With ``auto`` the grammar only shapes an answer
        the model may give: a tool whose parameters cannot be compiled, or tools too large to
        compile together, have their arguments held to any JSON object instead."""
        if g.mode != generic_tools.AUTO:
            return self._grammar(generic_tools.answer_schema(g), g.param)
        anything = generic_tools.answer_schema(g, ({"type": "object"},) * len(g.arguments))
        args = [unbounded(a, loosen=True) for a in g.arguments]
        # Measured before anything is converted: up to 128 tools of 64 KiB each would
        # otherwise cost this thread their conversions on every request.
        if len(json.dumps(generic_tools.answer_schema(g, tuple(args)))) > MAX_SCHEMA_BYTES:
            return self._grammar(anything, g.param)
        args = [a if _converts(json.dumps(a)) else {"type": "object"} for a in args]
        try:
            return self._grammar(generic_tools.answer_schema(g, tuple(args)), g.param)
        except ApiError:  # a schema the converter took and llama.cpp refuses
            return self._grammar(anything, g.param)

    def _grammar(self, schema: dict[str, Any] | None, param: str) -> Any:
        """The grammar of ``schema`` (None: any JSON), with its bounds past what a grammar
        holds dropped (``residency.grammar_limits.unbounded``)."""
        import llama_cpp
        from llama_cpp import llama_grammar

        _strict_strings()
        try:
            gbnf = (
                llama_grammar.JSON_GBNF
                if schema is None
                else llama_grammar.json_schema_to_gbnf(json.dumps(unbounded(schema)))
            )
        except Exception as e:  # the converter raises ValueError, AssertionError, KeyError...
            raise ApiError(
                400,
                f"the JSON schema in '{param}' cannot be enforced: {e}",
                param=param,
                code="unsupported_schema",
            ) from None
        made = llama_cpp.llama_sampler_init_grammar(
            self.llm._model.vocab, gbnf.encode("utf-8"), b"root"
        )
        if not made:
            raise ApiError(
                400,
                f"the JSON schema in '{param}' gives a grammar llama.cpp refuses",
                param=param,
                code="unsupported_schema",
            )
        llama_cpp.llama_sampler_free(made)
        return llama_grammar.LlamaGrammar.from_string(gbnf)

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
        create = self.llm.create_completion
        hooks = Hooks(on_step, on_usage, on_progress, cache)
        return self._call(create, params, stream, "prompt", hooks)

    def _call(
        self,
        create: Any,
        params: dict[str, Any],
        stream: bool,
        param: str,
        hooks: Hooks,
        grammar_param: str | None = None,
    ) -> Any:
        self._check_logit_bias(params)
        # Read by create_completion in this thread: at once for most handlers (a stream's job
        # is submitted before its first chunk), inside the stream for lazy ones (_guarded).
        with _client_errors(param, grammar_param), _hooked(hooks):
            out = create(**params, stream=stream)
        return _guarded(out, param, hooks, grammar_param) if stream else out

    def _check_logit_bias(self, params: dict[str, Any]) -> None:
        # llama.cpp indexes the logits with these ids: one past the vocabulary is an IndexError.
        n_vocab = self.llm.n_vocab()
        for k in params.get("logit_bias") or {}:
            if not 0 <= int(k) < n_vocab:
                raise ApiError(
                    400,
                    f"token id {k} in 'logit_bias' is not in this model's vocabulary "
                    f"(0 to {n_vocab - 1})",
                    param=f"logit_bias.{k}",
                    code="invalid_value",
                )

    def count_tokens(self, params: dict[str, Any]) -> dict[str, Any]:
        """``Kind.TOKENIZE``: the tokens of the prompt a chat request gives the model (its
        template rendered with its messages and tools, as ``chat`` renders it), counted
        without generating: the chat handler's completion call returns at once."""
        _serving.count_only = True
        try:
            out = self.chat(params, False)
        finally:
            _serving.count_only = False
        return {"input_tokens": int(out["usage"]["prompt_tokens"])}

    def failure(self) -> BaseException | None:
        return self._engine.error if self._engine is not None else None

    @property
    def state_format(self) -> str:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__}"

    def prefix_counts(self) -> dict[str, int]:
        e = self._engine
        if e is None:
            return {}
        return {"copies": e.copied, **{f"wait_{k}": v for k, v in e.waits.items()}}

    def attach_cache(self, cache: SlotCache | None) -> None:
        if self._engine is not None:
            if cache is not None:
                cache.n_swa = self._engine.n_swa
            self.llm.slot_cache = cache

    def slot_images(self, min_tokens: int, timeout: float) -> list[SlotImage]:
        engine = self._engine
        if engine is None:
            return []
        return engine.call(lambda: engine.images(min_tokens), timeout)

    def embed(self, inputs: list[str]) -> dict[str, Any]:
        with _client_errors("input"):
            return dict(self.llm.create_embedding(inputs))

    def rerank(self, query: str, documents: list[str]) -> dict[str, Any]:
        """Each (query, document) pair's score, read straight from the rank-pooled context:
        llama-cpp-python's ``embed`` would read n_embd floats where rank pooling leaves
        n_cls_out, and lays no pair out."""
        import llama_cpp

        llm, fmt = self.llm, self._pairs
        if fmt is None:
            # Without rank pooling there is no score to read (llama.cpp returns no pointer).
            raise ApiError(400, "this model is not a rerank model", param="model")
        ctx = llm._ctx.ctx

        def tokenize(text: str, special: bool) -> list[int]:
            return list(llm.tokenize(text.encode("utf-8"), add_bos=False, special=special))

        pairs = [rerank.pair_tokens(fmt, tokenize, query, d) for d in documents]
        lengths = [len(p) for p in pairs]
        # A pooled sequence is decoded whole, in one micro-batch, within the context.
        cap = min(llm.n_batch, llama_cpp.llama_n_ubatch(ctx), llama_cpp.llama_n_ctx(ctx))
        rerank.check_lengths(lengths, cap)
        scores = [0.0] * len(pairs)
        batch = llm._batch
        try:
            for group in rerank.batches(lengths, cap, llama_cpp.llama_n_seq_max(ctx)):
                batch.reset()
                for seq, i in enumerate(group):
                    batch.add_sequence(pairs[i], seq, True)
                llm._ctx.kv_cache_clear()
                llm._ctx.decode(batch)
                for seq, i in enumerate(group):
                    scores[i] = float(llama_cpp.llama_get_embeddings_seq(ctx, seq)[0])
        finally:
            batch.reset()
            llm._ctx.kv_cache_clear()
        total = sum(lengths)
        return {
            "object": "list",
            "scores": scores,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        projector = getattr(self._llm, "projector", None)
        if projector is not None:
            self._llm.projector = None
            projector.close()
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        self._pairs = None
