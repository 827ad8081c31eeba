"""The model runtime interface, and its llama.cpp implementation (the only module that imports
``llama_cpp``). A model process talks to a ``Runtime`` only, so a test that needs a controlled
delay or failure wraps the real one (``workers.faults``) behind the same interface."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Protocol

from residency.errors import ApiError
from residency.settings import ModelSpec


class Runtime(Protocol):
    def load(self, spec: ModelSpec, device: str) -> None: ...

    def chat(
        self, params: dict[str, Any], stream: bool
    ) -> Iterator[dict[str, Any]] | dict[str, Any]: ...

    def completion(
        self, params: dict[str, Any], stream: bool
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


def _guarded(chunks: Iterator[dict[str, Any]], param: str) -> Iterator[dict[str, Any]]:
    # A stream raises on its first chunk; closing this generator closes llama.cpp's.
    try:
        yield from chunks
    except ValueError as e:
        err = _client_error(e, param)
        if err is None:
            raise
        raise err from None


class LlamaRuntime:
    def __init__(self) -> None:
        self._llm: Any = None

    def load(self, spec: ModelSpec, device: str) -> None:
        import llama_cpp  # imported here: web and coordinator processes never need it

        if spec.path is None:
            raise ValueError("a remote model is never loaded")
        self._llm = llama_cpp.Llama(
            model_path=spec.path,
            n_ctx=spec.n_ctx,
            # A CPU device never offloads, whatever the spec asks for a GPU host.
            n_gpu_layers=spec.n_gpu_layers if device != "cpu" else 0,
            n_threads=spec.n_threads,
            n_threads_batch=spec.n_threads_batch,
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

    def chat(self, params: dict[str, Any], stream: bool) -> Any:
        return self._call(self.llm.create_chat_completion, params, stream, "messages")

    def completion(self, params: dict[str, Any], stream: bool) -> Any:
        return self._call(self.llm.create_completion, params, stream, "prompt")

    def _call(self, create: Any, params: dict[str, Any], stream: bool, param: str) -> Any:
        self._check_logit_bias(params)
        try:
            out = create(**params, stream=stream)
        except ValueError as e:
            err = _client_error(e, param)
            if err is None:
                raise
            raise err from None
        return _guarded(out, param) if stream else out

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
        try:
            return dict(self.llm.create_embedding(inputs))
        except ValueError as e:
            err = _client_error(e, "input")
            if err is None:
                raise
            raise err from None

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
