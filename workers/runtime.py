"""The model runtime interface, and its llama.cpp implementation (the only module that imports
``llama_cpp``). A model process talks to a ``Runtime`` only, so a test that needs a controlled
delay or failure wraps the real one (``workers.faults``) behind the same interface."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

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
        return self.llm.create_chat_completion(**params, stream=stream)

    def completion(self, params: dict[str, Any], stream: bool) -> Any:
        return self.llm.create_completion(**params, stream=stream)

    def embed(self, inputs: list[str]) -> dict[str, Any]:
        return dict(self.llm.create_embedding(inputs))

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
