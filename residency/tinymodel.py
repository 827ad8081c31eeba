"""Write a tiny, seeded-random llama-architecture GGUF model.

Why this exists: the server needs *a* real GGUF file to load for its test
suite and for smoke tests of a deployment (does the process start, load a
model, tokenize, run a chat/completion/embedding request end to end?), but
real models are gigabytes and cannot be shipped or downloaded in CI. The model
written here is a few hundred KB, loads in milliseconds and decodes with
llama.cpp like any llama/SentencePiece model; its weights are random, so its
output is gibberish and generation stops at ``max_tokens`` (finish_reason
"length"), not at an end-of-sequence token.

The randomness is shaped a little so that the gibberish is well behaved:
token-embedding rows (tied to the output projection) of the NORMAL pieces are
much larger than those of the byte-fallback and control tokens, so sampling
practically always picks printable-ASCII pieces. With plain uniform-scale
weights the model samples byte tokens ~2/3 of the time, emits partial UTF-8
sequences, and llama-cpp-python then keeps generating past ``max_tokens``
(until the context is full, where decoding fails). Layer weights are scaled by
``LAYER_SCALE / sqrt(fan_in)`` so the layers actually change the residual
stream and the model doesn't simply repeat its last token.

The file is fully determined by its arguments: the same ``seed``, ``dtype``,
``embedding``, ``rerank`` and ``shape`` produce a byte-identical file.

``shape`` sizes the model up for benchmarks (``bench/gpu.sh`` writes one of about 1B parameters
in Llama 3.2 1B's shape): more layers, wider ones, and a vocabulary padded to ``n_vocab`` with
NORMAL pieces ``"▁w<hex>"`` (each one's prefixes are pieces too, so SentencePiece's merging
reaches it). The default is the tiny shape above.

``rerank=True`` writes a reranker instead, in the shape llama.cpp's rank pooling
accepts from a causal decoder: the ``qwen3`` architecture (the llama layout
plus per-head Q/K norms), a two-label classification head ``cls.output``
("yes", "no", as llama.cpp converts Qwen3 rerankers) and ``pooling_type =
RANK``. llama.cpp then pools each sequence's last token through the head and a
softmax: a sequence's score is its "yes" probability. The ``llama``
architecture has no classification head in llama.cpp (its loader takes no
``cls.*`` tensor), so rank pooling there reads the wrong floats of a batch.

Only the standard library, ``numpy`` and ``gguf`` are used, so this module can
run where llama.cpp is not installed.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal

import gguf
import numpy as np
import numpy.typing as npt

__all__ = ["CHATML_TEMPLATE", "TINY", "Shape", "write_tiny_model"]

ARCH: Final = "llama"
RERANK_ARCH: Final = "qwen3"
RERANK_LABELS: Final = ("yes", "no")
CLS_SCALE: Final = 0.2  # std of the classification head: scores spread over (0, 1)
MODEL_NAME: Final = "residency-tiny"

N_LAYER: Final = 2
N_EMBD: Final = 64
N_HEAD: Final = 4
N_HEAD_KV: Final = 2
N_FF: Final = 128
CONTEXT_LENGTH: Final = 2048
RMS_EPS: Final = 1e-5
ROPE_FREQ_BASE: Final = 10000.0
HEAD_DIM: Final = N_EMBD // N_HEAD
N_KV_DIM: Final = HEAD_DIM * N_HEAD_KV
# Weight scales (std of the normal distribution); see the module docstring.
LAYER_SCALE: Final = 2.0  # divided by sqrt(fan_in)
EMBD_SCALE_NORMAL: Final = 0.3  # token_embd rows of NORMAL tokens
EMBD_SCALE_OTHER: Final = 0.02  # token_embd rows of byte / control / unknown tokens

SPACE: Final = "\u2581"  # SentencePiece's "▁" word-boundary marker

Dtype = Literal["f32", "f16", "q8_0"]


@dataclass(frozen=True)
class Shape:
    """The model's sizes; ``n_vocab`` None: the natural vocabulary (~400 tokens), else padded to
    that many tokens (at least the natural count)."""

    n_layer: int = N_LAYER
    n_embd: int = N_EMBD
    n_head: int = N_HEAD
    n_head_kv: int = N_HEAD_KV
    n_ff: int = N_FF
    n_vocab: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}), and "
                f"n_head of n_head_kv ({self.n_head_kv})"
            )
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd / n_head must be even (RoPE), got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.n_head_kv


TINY: Final = Shape()

UNK_ID: Final = 0
BOS_ID: Final = 1
EOS_ID: Final = 2
IM_START_ID: Final = 3
IM_END_ID: Final = 4

# The standard ChatML template (as shipped by e.g. OpenHermes / Qwen).
CHATML_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Whole words get a "▁word" piece; every "▁" prefix of each word is added too
# so that SentencePiece's bigram merging can actually reach the full word.
_WORDS: Final = (
    "the", "a", "and", "to", "of", "in", "is", "it", "hello", "hi", "world", "you",
    "how", "are", "this", "that", "for", "with",
)  # fmt: skip


def _vocab(
    n_vocab: int | None = None, control: tuple[str, ...] = ()
) -> tuple[list[str], list[float], list[int]]:
    """Return (tokens, scores, token types) of the ~400-token SPM vocab, padded to ``n_vocab``
    tokens when given, then the ``control`` tokens."""
    tokens: list[str] = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types: list[int] = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
    ]
    scores: list[float] = [0.0] * len(tokens)

    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)

    normal: list[str] = [SPACE]
    for word in _WORDS:
        for end in range(1, len(word) + 1):
            piece = SPACE + word[:end]
            if piece not in normal:
                normal.append(piece)
    # Printable ASCII except the space itself (spaces become "▁").
    normal.extend(chr(c) for c in range(0x21, 0x7F))

    if n_vocab is not None:
        natural = len(tokens) + len(normal)
        if n_vocab < natural:
            raise ValueError(f"n_vocab must be at least {natural}, got {n_vocab}")
        # "▁w<hex>": each one's prefixes come earlier (the hex of i // 16), so merging reaches it.
        normal.extend(f"{SPACE}w{i:x}" for i in range(n_vocab - natural))

    for rank, piece in enumerate(normal):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank))

    for piece in control:
        if piece in tokens:
            raise ValueError(f"{piece!r} is in the vocabulary already")
        tokens.append(piece)
        types.append(gguf.TokenType.CONTROL)
        scores.append(0.0)

    return tokens, scores, types


_FILE_TYPES: Final = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def _add_metadata(
    writer: gguf.GGUFWriter,
    *,
    tokens: list[str],
    scores: list[float],
    types: list[int],
    dtype: Dtype,
    embedding: bool,
    rerank: bool = False,
    chat_template: str | None = CHATML_TEMPLATE,
    shape: Shape = TINY,
    space_prefix: bool = True,
) -> None:
    writer.add_name(MODEL_NAME)
    writer.add_file_type(_FILE_TYPES[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_vocab_size(len(tokens))
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    if embedding:
        writer.add_pooling_type(gguf.PoolingType.MEAN)
    if rerank:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(list(RERANK_LABELS))

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    # <|im_end|> ends a ChatML turn; llama.cpp also treats </s> as end-of-generation.
    writer.add_eos_token_id(IM_END_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(value=True)
    # A reranker's pair is [BOS] query [EOS] [SEP] document [EOS] (llama.cpp adds each token
    # its vocabulary says to add): the rerank model adds all three.
    writer.add_add_eos_token(value=rerank)
    if rerank:
        writer.add_sep_token_id(EOS_ID)
        writer.add_add_sep_token(value=True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if not space_prefix:
        writer.add_add_space_prefix(False)


def _add_tensors(
    writer: gguf.GGUFWriter,
    rng: np.random.Generator,
    *,
    types: list[int],
    dtype: Dtype,
    rerank: bool = False,
    shape: Shape = TINY,
) -> None:

    def matrix(
        name: str, rows: int, cols: int, scale: float | npt.NDArray[np.float32] | None = None
    ) -> None:
        if scale is None:
            scale = LAYER_SCALE / math.sqrt(cols)
        data = rng.standard_normal((rows, cols), dtype=np.float32)
        data = (data * np.asarray(scale, dtype=np.float32)).astype(np.float32)
        if dtype == "f32":
            writer.add_tensor(name, data)
        elif dtype == "f16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(shape.n_embd, dtype=np.float32))

    # numpy shapes are (out, in); output.weight is omitted (tied to token_embd).
    normal = np.asarray(types) == gguf.TokenType.NORMAL
    row_scale = np.where(normal, EMBD_SCALE_NORMAL, EMBD_SCALE_OTHER).astype(np.float32)
    embd, kv, ff, hd = shape.n_embd, shape.kv_dim, shape.n_ff, shape.head_dim
    matrix("token_embd.weight", len(types), embd, row_scale[:, None])
    for i in range(shape.n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", embd, embd)
        matrix(f"blk.{i}.attn_k.weight", kv, embd)
        matrix(f"blk.{i}.attn_v.weight", kv, embd)
        matrix(f"blk.{i}.attn_output.weight", embd, embd)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", ff, embd)
        matrix(f"blk.{i}.ffn_up.weight", ff, embd)
        matrix(f"blk.{i}.ffn_down.weight", embd, ff)
    norm("output_norm.weight")
    if rerank:
        for i in range(shape.n_layer):
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(hd, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(hd, dtype=np.float32))
        matrix("cls.output.weight", len(RERANK_LABELS), embd, CLS_SCALE)


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: Dtype = "f32",
    embedding: bool = False,
    rerank: bool = False,
    chat_template: str | None = CHATML_TEMPLATE,
    shape: Shape = TINY,
    control_tokens: tuple[str, ...] = (),
) -> pathlib.Path:
    """Write a tiny random llama GGUF model to ``path`` and return the path.

    ``dtype`` selects the storage of the 2-D weight matrices (norms are always
    F32); ``shape`` sizes the model (see the module docstring). ``embedding=True``
    adds ``llama.pooling_type = MEAN`` so that llama.cpp returns one vector of
    length ``n_embd`` (64) per input when the model is
    loaded with embeddings enabled (without it, llama-cpp-python returns one
    vector per token). ``rerank=True`` writes a reranker (see the module
    docstring) for llama.cpp's rank pooling. ``chat_template`` replaces the
    ChatML template (e.g. one that takes ``tools``; None: the GGUF carries
    none). ``control_tokens`` are added at the end of the vocabulary as
    control tokens (markers such as ``<think>``, which llama.cpp renders as
    nothing unless asked to); the tokens before them keep their ids, and the
    text gets no SentencePiece space prefix. The file is written to a
    temporary sibling and then renamed over ``path``, so concurrent writers
    never expose a partial file. Missing parent directories are created.
    """
    if dtype not in _FILE_TYPES:
        msg = f"unsupported dtype {dtype!r}; expected 'f32', 'f16' or 'q8_0'"
        raise ValueError(msg)
    if embedding and rerank:
        raise ValueError("a tiny model is an embedding model or a reranker, not both")

    out = pathlib.Path(path)
    tokens, scores, types = _vocab(shape.n_vocab, control_tokens)
    with gguf_file(out, RERANK_ARCH if rerank else ARCH) as writer:
        _add_metadata(
            writer,
            tokens=tokens,
            scores=scores,
            types=types,
            dtype=dtype,
            embedding=embedding,
            rerank=rerank,
            chat_template=chat_template,
            shape=shape,
            # SentencePiece puts a space before the text that follows a special token: a model
            # with markers of its own writes none, as the BPE vocabularies that have them do.
            space_prefix=not control_tokens,
        )
        _add_tensors(
            writer,
            np.random.default_rng(seed),
            types=types,
            dtype=dtype,
            rerank=rerank,
            shape=shape,
        )
    return out


@contextlib.contextmanager
def gguf_file(out: pathlib.Path, arch: str) -> Iterator[gguf.GGUFWriter]:
    """A writer for a GGUF at ``out`` (parent folders made): what is added inside the block is
    written to a temporary sibling, then renamed over ``out``, so concurrent writers never
    expose a partial file; an error leaves nothing behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
