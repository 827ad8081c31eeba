"""A model's vision projector (libmtmd, ``[models.X] mmproj``): images into the text model's
sequence.

An image becomes a span of the prompt: libmtmd decodes the file (PNG, JPEG, GIF, BMP),
resizes it to what the projector takes, and says how many positions of the text model it fills;
the projector's encoder turns it into that many embeddings, which are then decoded into the
slot's sequence like prompt tokens, only as vectors instead of token ids.

The work is split by thread. ``tokenize`` and ``encode`` run in the thread that serves the
request, before its job is submitted: the encoder is the costly part (a real projector's is a
ViT of hundreds of millions of parameters), and on its own libmtmd context it runs beside the
engine's steps instead of inside one, so the other slots keep streaming while an image is
encoded. Only ``decode`` — the embeddings into the llama.cpp context — runs on the engine
thread, which owns that context, as one step's extra decode.

In the prompt's token list, each of an image's positions holds ``Image.token``: a negative id
(never a vocabulary token) derived from the image's bytes. Prefix reuse compares token lists,
so a conversation that sends the same image again reuses its cached positions, and another
image never matches.

Projectors that lay out images with M-RoPE positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL…) use fewer
positions than embeddings; the engine counts one position per token, so they are refused at
load with a clear error rather than served wrong.

This module and ``workers.runtime`` are the ones that import ``llama_cpp``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("residency.model")

#: Sentinel ids are in [-(SPAN), -1]: int32 (as the slot cache stores tokens) and never a
#: vocabulary id.
SPAN = (1 << 31) - 2


#: ggml's log levels: warnings and errors reach the model process's log; libmtmd's info lines
#: (several per image) do not.
_GGML_LOG_WARN = 3


@functools.cache
def _quiet_logs() -> Any:
    """Route libmtmd's log through Python's (once per process; the callback is kept alive
    here, as C holds only its address)."""
    import llama_cpp
    from llama_cpp import mtmd_cpp

    @llama_cpp.llama_log_callback
    def forward(level: int, text: bytes | None, _user: Any) -> None:
        if level >= _GGML_LOG_WARN and text:
            log.warning("libmtmd: %s", text.decode("utf-8", "replace").rstrip())

    mtmd_cpp.mtmd_log_set(forward, None)
    mtmd_cpp.mtmd_helper_log_set(forward, None)
    return forward


class ImageError(ValueError):
    """An image the projector cannot read (not an image, a format libmtmd does not decode)."""


def image_token(data: bytes) -> int:
    """The id that stands for each of an image's positions in a prompt's token list."""
    h = int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
    return -(1 + h % SPAN)


@dataclass(eq=False)
class Image:
    """One image's span of a prompt: how many positions it fills, the id standing for each, and
    libmtmd's chunk (freed when this is collected); ``embd`` holds its embeddings once
    ``Projector.encode`` has run."""

    n_tokens: int
    token: int
    chunk: Any
    embd: Any = None
    _free: Any = field(default=None, repr=False)

    @property
    def encoded(self) -> bool:
        return self.embd is not None


class Projector:
    """libmtmd's context for one loaded model (``llm``: its ``llama_cpp.Llama``)."""

    def __init__(self, path: str, llm: Any, n_threads: int, use_gpu: bool) -> None:
        from llama_cpp import mtmd_cpp

        _quiet_logs()
        self._mt = mtmd_cpp
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        ctx = mtmd_cpp.mtmd_init_from_file(path.encode(), llm.model, params)
        if not ctx:
            raise ValueError(
                f"mmproj {path!r}: libmtmd could not load it as a projector for this model "
                "(a file of another model's width, or not a projector)"
            )
        self._ctx = ctx
        if not mtmd_cpp.mtmd_support_vision(ctx):
            self.close()
            raise ValueError(f"mmproj {path!r} has no vision encoder (an audio projector?)")
        if mtmd_cpp.mtmd_decode_use_mrope(ctx):
            self.close()
            raise ValueError(
                f"mmproj {path!r} places images with M-RoPE positions (Qwen2-VL-style), which "
                "this server does not serve yet"
            )
        self.n_embd = int(llm.n_embd())
        # One encode at a time: the context holds one output buffer.
        self._lock = threading.Lock()
        self.encoded = 0  # images encoded (for tests and stats)

    def tokenize(self, data: bytes) -> list[int | Image]:
        """What ``data`` (an image file's bytes) puts in a prompt, in order: the token ids of
        any marker text the projector wraps an image in, and the image itself."""
        mt = self._mt
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mt.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
        if not bitmap:
            raise ImageError("not an image libmtmd can decode (PNG, JPEG, GIF, BMP)")
        chunks = mt.mtmd_input_chunks_init()
        try:
            part = mt.mtmd_input_part(None, bitmap)
            parts = (ctypes.POINTER(mt.mtmd_input_part) * 1)(ctypes.pointer(part))
            rc = mt.mtmd_tokenize_from_parts(self._ctx, chunks, parts, 1, False)
            if rc != 0:
                raise ImageError(f"libmtmd could not tokenize the image ({rc})")
            token = image_token(data)
            out: list[int | Image] = []
            for i in range(mt.mtmd_input_chunks_size(chunks)):
                chunk = mt.mtmd_input_chunks_get(chunks, i)
                kind = mt.mtmd_input_chunk_get_type(chunk)
                if kind == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    ids = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    out.extend(int(ids[k]) for k in range(n.value))
                elif kind == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    out.append(self._image(chunk, token))
                else:
                    raise ImageError("the projector made a chunk that is not an image")
            return out
        finally:
            mt.mtmd_input_chunks_free(chunks)
            mt.mtmd_bitmap_free(bitmap)

    def _image(self, chunk: Any, token: int) -> Image:
        mt = self._mt
        own = mt.mtmd_input_chunk_copy(chunk)
        img = Image(int(mt.mtmd_input_chunk_get_n_tokens(own)), token, own)
        img._free = weakref.finalize(img, mt.mtmd_input_chunk_free, own)
        return img

    def encode(self, image: Image) -> None:
        """Run the encoder on ``image`` (the serving thread's work, before its job is
        submitted); its embeddings are kept on it for the engine thread."""
        if image.encoded:
            return
        mt = self._mt
        n = image.n_tokens * self.n_embd
        with self._lock:
            rc = mt.mtmd_encode_chunk(self._ctx, image.chunk)
            if rc != 0:
                raise RuntimeError(f"the vision encoder failed ({rc})")
            out = mt.mtmd_get_output_embd(self._ctx)
            embd = (ctypes.c_float * n)()
            ctypes.memmove(embd, out, n * ctypes.sizeof(ctypes.c_float))
            self.encoded += 1
        image.embd = embd

    def decoder(self, lctx: Any, n_batch: int) -> Callable[[Image, int, int], int]:
        """The engine thread's call: ``(image, pos, seq)`` decodes the image's embeddings into
        sequence ``seq`` of the llama.cpp context ``lctx`` from position ``pos``; 0 when it
        worked. An image whose attention is not causal (Gemma 3's) is decoded in one batch,
        as it must be."""
        mt = self._mt
        no_callback = mt.mtmd_helper_post_decode_callback()

        def decode(image: Image, pos: int, seq: int) -> int:
            if image.embd is None:
                raise RuntimeError("an image reached the engine before it was encoded")
            whole = mt.mtmd_decode_use_non_causal(self._ctx, image.chunk)
            batch = max(n_batch, image.n_tokens) if whole else n_batch
            new_pos = ctypes.c_int32(0)
            return int(
                mt.mtmd_helper_decode_image_chunk(
                    self._ctx,
                    lctx,
                    image.chunk,
                    image.embd,
                    pos,
                    seq,
                    batch,
                    ctypes.byref(new_pos),
                    no_callback,
                    None,
                )
            )

        return decode

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx:
            self._mt.mtmd_free(ctx)
