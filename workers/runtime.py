"""The model runtime interface, and its llama.cpp implementation (the only module that imports
``llama_cpp``). A model process talks to a ``Runtime`` only, so a test that needs a controlled
delay or failure wraps the real one (``workers.faults``) behind the same interface."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from residency.errors import ApiError
from residency.settings import ModelSpec
from workers import devices

#: Called by a runtime once per generated token, streamed or not; raising ends the generation
#: (the model process's ``workers.gate.Gate.step``: cancel, deadline, shutdown).
OnStep = Callable[[], None]


class Runtime(Protocol):
    def load(self, spec: ModelSpec, device: str) -> None: ...

    def chat(
        self, params: dict[str, Any], stream: bool, on_step: OnStep | None = None
    ) -> Iterator[dict[str, Any]] | dict[str, Any]: ...

    def completion(
        self, params: dict[str, Any], stream: bool, on_step: OnStep | None = None
    ) -> Iterator[dict[str, Any]] | dict[str, Any]: ...

    def embed(self, inputs: list[str]) -> dict[str, Any]: ...

    def close(self) -> None: ...


# How llama-cpp-python's high-level Llama refuses input that does not fit (a ValueError, which
# the model process would otherwise answer as a 500): a prompt of n_ctx tokens or more leaves
# no room for one generated token; an embedding input must fit in one batch.
_CONTEXT = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")
_BATCH = re.compile(r"Requested tokens \((\d+)\) exceed batch size of (\d+)")
_NO_LOGPROBS = "logprobs is not supported"


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
    if _NO_LOGPROBS in msg:
        return ApiError(
            400, "logprobs are not supported by this server", param="logprobs", code="unsupported"
        )
    return None


@contextlib.contextmanager
def _client_errors(param: str) -> Iterator[None]:
    """llama.cpp's ValueErrors about the request's input, raised as the client's 400."""
    try:
        yield
    except ValueError as e:
        err = _client_error(e, param)
        if err is None:
            raise
        raise err from None


def _guarded(
    chunks: Iterator[dict[str, Any]], param: str, done: Callable[[], None]
) -> Iterator[dict[str, Any]]:
    # A stream raises on its first chunk; closing this generator closes llama.cpp's.
    try:
        with _client_errors(param):
            yield from chunks
    finally:
        done()


@functools.cache
def _stepped_llama() -> Any:
    """llama_cpp.Llama whose token loop calls ``on_step`` before it hands out each token.
    ``generate`` is the one loop every completion passes through, chat or not, streamed or
    not; llama-cpp-python's own hook for this, ``stopping_criteria``, is not passed through
    ``create_chat_completion`` (0.3), and an exception raised in a logits processor is lost in
    its C callback."""
    import llama_cpp  # imported here: web and coordinator processes never need it

    class SteppedLlama(llama_cpp.Llama):
        on_step: OnStep | None = None

        # Forwards every argument unchanged; only the token loop is wrapped.
        def generate(self, *args: Any, **kwargs: Any) -> Iterator[int]:  # type: ignore[override]
            on_step = self.on_step
            inner = super().generate(*args, **kwargs)
            try:
                for token in inner:
                    if on_step is not None:
                        on_step()
                    yield token
            finally:
                inner.close()

    return SteppedLlama


class LlamaRuntime:
    def __init__(self) -> None:
        self._llm: Any = None

    def load(self, spec: ModelSpec, device: str) -> None:
        if spec.path is None:
            raise ValueError("a remote model is never loaded")
        self._llm = _stepped_llama()(
            model_path=spec.path,
            n_ctx=spec.n_ctx,
            # A CPU device never offloads, whatever the spec asks for a GPU host.
            n_gpu_layers=spec.n_gpu_layers if device != "cpu" else 0,
            # Unset: one thread per core this process may run on (llama-cpp-python's default
            # is half the machine's cores).
            n_threads=spec.n_threads or devices.default_threads(),
            n_threads_batch=spec.n_threads_batch or devices.default_threads(),
            n_batch=spec.n_batch,
            chat_format=spec.chat_format,
            embedding=spec.type == "embedding",
            verbose=False,
        )

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

    def chat(self, params: dict[str, Any], stream: bool, on_step: OnStep | None = None) -> Any:
        return self._call(self.llm.create_chat_completion, params, stream, "messages", on_step)

    def completion(
        self, params: dict[str, Any], stream: bool, on_step: OnStep | None = None
    ) -> Any:
        return self._call(self.llm.create_completion, params, stream, "prompt", on_step)

    def _call(
        self,
        create: Any,
        params: dict[str, Any],
        stream: bool,
        param: str,
        on_step: OnStep | None,
    ) -> Any:
        self._check_logit_bias(params)
        llm = self.llm

        def done() -> None:
            llm.on_step = None

        # Read by the token loop when it starts (a stream's on its first chunk); one generation
        # runs at a time, so the next request cannot replace it before then.
        llm.on_step = on_step
        try:
            with _client_errors(param):
                out = create(**params, stream=stream)
        except BaseException:
            done()
            raise
        if stream:
            return _guarded(out, param, done)
        done()
        return out

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

    def embed(self, inputs: list[str]) -> dict[str, Any]:
        with _client_errors("input"):
            return dict(self.llm.create_embedding(inputs))

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
