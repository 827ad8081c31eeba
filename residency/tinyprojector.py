"""Write a tiny, seeded-random vision projector GGUF for a tiny model (libmtmd's ``mmproj``).

Why this exists: a vision model needs its projector to read an image, and the test suite and
a deployment's smoke test need one that loads in milliseconds. This writes the smallest
projector llama.cpp's ``clip`` loader takes: a LLaVA-style ``mlp`` projector — a two-block
ViT encoder over ``IMAGE_SIZE``-pixel square images cut in ``PATCH_SIZE``-pixel patches, then
``mm.0`` → GELU → ``mm.2`` into the text model's embedding width. libmtmd resizes any image to
that square, so every image is ``IMAGE_TOKENS`` embeddings in the text model's sequence, with
no marker tokens around them. Its weights are random: the model "sees" noise, but every step
of a real vision request — decoding the image, encoding it, prefilling its embeddings beside
the other slots' tokens — runs for real.

The file is fully determined by its arguments. Only ``numpy`` and ``gguf``
are used.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Final

import numpy as np

from residency.tinymodel import gguf_file

__all__ = ["IMAGE_SIZE", "IMAGE_TOKENS", "PATCH_SIZE", "write_tiny_projector"]

IMAGE_SIZE: Final = 56
PATCH_SIZE: Final = 14
IMAGE_TOKENS: Final = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16
N_EMBD: Final = 32  # the encoder's width
N_HEAD: Final = 2
N_FF: Final = 64
N_LAYER: Final = 2  # llava reads the second-to-last block's output: one block runs
PROJ_HIDDEN: Final = 32
EPS: Final = 1e-6
# CLIP's own normalization constants (what LLaVA projectors carry).
IMAGE_MEAN: Final = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD: Final = (0.26862954, 0.26130258, 0.27577711)


def write_tiny_projector(
    path: str | os.PathLike[str], *, n_embd_text: int, seed: int = 0, image_size: int = IMAGE_SIZE
) -> pathlib.Path:
    """Write a tiny random projector whose output width is ``n_embd_text`` (the text model's
    ``embedding_length``: libmtmd refuses a projector of another width) to ``path``; written
    to a temporary sibling and renamed, as ``write_tiny_model`` does. ``image_size`` (a
    multiple of ``PATCH_SIZE``) sets the positions an image fills: ``(image_size /
    PATCH_SIZE)²`` — 16 by default, 256 at 224 pixels (Gemma 3's count, for benchmarks)."""
    if n_embd_text < 1:
        raise ValueError(f"n_embd_text must be at least 1, got {n_embd_text}")
    if image_size < PATCH_SIZE or image_size % PATCH_SIZE:
        raise ValueError(f"image_size must be a multiple of {PATCH_SIZE}, got {image_size}")
    n_patches = (image_size // PATCH_SIZE) ** 2
    out = pathlib.Path(path)
    rng = np.random.default_rng(seed)
    with gguf_file(out, "clip") as writer:
        writer.add_string("general.name", "residency-tiny-mmproj")
        writer.add_uint32("general.file_type", 0)  # all F32
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_bool("clip.has_text_encoder", False)
        writer.add_bool("clip.use_gelu", True)
        writer.add_string("clip.projector_type", "mlp")
        writer.add_uint32("clip.vision.image_size", image_size)
        writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
        writer.add_uint32("clip.vision.embedding_length", N_EMBD)
        writer.add_uint32("clip.vision.feed_forward_length", N_FF)
        writer.add_uint32("clip.vision.projection_dim", n_embd_text)
        writer.add_uint32("clip.vision.attention.head_count", N_HEAD)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", EPS)
        writer.add_uint32("clip.vision.block_count", N_LAYER)
        writer.add_array("clip.vision.image_mean", list(IMAGE_MEAN))
        writer.add_array("clip.vision.image_std", list(IMAGE_STD))

        def tensor(name: str, *shape: int, scale: float | None = None) -> None:
            # numpy shapes are ggml's reversed: a matrix is (out, in).
            if scale is None:
                scale = 1.0 / math.sqrt(shape[-1])
            data = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
            writer.add_tensor(name, data.astype(np.float32))

        def norm(name: str, width: int) -> None:
            writer.add_tensor(f"{name}.weight", np.ones(width, dtype=np.float32))
            writer.add_tensor(f"{name}.bias", np.zeros(width, dtype=np.float32))

        # A conv kernel: (out channels, in channels, height, width).
        tensor("v.patch_embd.weight", N_EMBD, 3, PATCH_SIZE, PATCH_SIZE, scale=0.05)
        tensor("v.position_embd.weight", n_patches, N_EMBD, scale=0.02)
        norm("v.pre_ln", N_EMBD)
        for i in range(N_LAYER):
            norm(f"v.blk.{i}.ln1", N_EMBD)
            for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
                tensor(f"v.blk.{i}.{part}.weight", N_EMBD, N_EMBD)
                tensor(f"v.blk.{i}.{part}.bias", N_EMBD, scale=0.0)
            norm(f"v.blk.{i}.ln2", N_EMBD)
            tensor(f"v.blk.{i}.ffn_up.weight", N_FF, N_EMBD)
            tensor(f"v.blk.{i}.ffn_up.bias", N_FF, scale=0.0)
            tensor(f"v.blk.{i}.ffn_down.weight", N_EMBD, N_FF)
            tensor(f"v.blk.{i}.ffn_down.bias", N_EMBD, scale=0.0)
        tensor("mm.0.weight", PROJ_HIDDEN, N_EMBD)
        tensor("mm.0.bias", PROJ_HIDDEN, scale=0.0)
        # Scaled like the text model's own token embeddings, so an image's embeddings are in
        # the range the text model's layers expect.
        tensor("mm.2.weight", n_embd_text, PROJ_HIDDEN, scale=0.3 / math.sqrt(PROJ_HIDDEN))
        tensor("mm.2.bias", n_embd_text, scale=0.0)
    return out
