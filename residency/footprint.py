"""What a loaded model costs in memory, estimated before the load from its GGUF header and spec.

Pure: no Redis, no llama.cpp. The estimate is of what a model process measures after its load
(``workers.model_process`` records both): on a CPU device its whole resident set, on a GPU its
per-process device memory. It is a sum of four parts:

- weights: the tensors' bytes by their ggml type (on a GPU, only the offloaded layers' share);
- kv: the KV cache, f16, one cell per token of each slot's context (llama-cpp-python 0.3.36
  keeps a full-size cache for sliding-window layers too: "using full-size SWA cache");
- compute: what llama.cpp keeps beside them. On a CPU its compute buffer is reserved but its
  pages are untouched until a batch runs, so what a load makes resident is a small fixed part
  and the vocabulary (token tables, the output buffer); long prompts later touch more of the
  buffer (tens of MB for a 270M model). On a GPU the reserved buffer is allocated whole: one
  ubatch of logits dominates it;
- overhead: the process itself (Python, residency, llama.cpp's runtime): what the agent's
  standby process holds before it knows its model.

The CPU constants were calibrated against measured loads (the tiny test model, SmolLM2 135M,
Gemma 3 270M); the GPU ones are not calibrated yet and are marked so.

The header is read with a small parser of its own (the ``gguf`` package's constants, not its
``GGUFReader``): GGUFReader builds a view per token of the vocabulary, about 15 s for Gemma's
262k tokens, where skipping them takes a fraction of a second. No tensor data is read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import asdict, dataclass
from typing import Any

import gguf

MIB = 1 << 20

#: Bytes per element of the KV cache (llama.cpp's default type_k/type_v: f16).
KV_BYTES = 2
#: Resident set of a model process with llama.cpp imported and initialized and no model (the
#: agent's standby process), on a CPU device: 71-79 MiB measured (more right after an install,
#: while the libraries' pages are all in the page cache). It grew with the answer readers, the
#: projector's and tracing's modules, and redis importing OpenTelemetry's SDK once installed.
CPU_PROCESS_BYTES = 76 * MIB
#: What a CPU load makes resident besides weights and KV cache: a fixed part, plus this much per
#: vocabulary token (llama.cpp's token tables, llama-cpp-python's copies), plus the output
#: buffer (one row of logits per sequence).
CPU_LOAD_BYTES = 4 * MIB
CPU_BYTES_PER_TOKEN = 220
#: Uncalibrated: a CUDA context of the process on its GPU.
GPU_CONTEXT_BYTES = 512 * MIB
#: llama-cpp-python's physical batch: n_ubatch = min(n_batch, 512).
MAX_UBATCH = 512
#: Architectures llama.cpp runs as encoders: no KV cache.
ENCODER_ARCHS = frozenset(
    {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert"}
)

_SCALARS: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
#: Numeric arrays up to this long are kept (per-layer head counts); longer ones are counted.
_KEEP_ARRAY = 4096


@dataclass(frozen=True)
class Tensor:
    name: str
    n_bytes: int

    @property
    def layer(self) -> int | None:
        """The block index of a ``blk.N.*`` tensor; None for the others."""
        parts = self.name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
            return int(parts[1])
        return None


@dataclass(frozen=True)
class Header:
    """A GGUF file's metadata (arrays of strings only counted) and tensor sizes."""

    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[Tensor, ...]

    @property
    def arch(self) -> str:
        return str(self.metadata["general.architecture"])

    def arch_key(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{name}", default)

    @property
    def n_vocab(self) -> int:
        return int(
            self.array_lengths.get("tokenizer.ggml.tokens") or self.arch_key("vocab_size") or 0
        )


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.at = 0

    def unpack(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return s

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]


def _value(c: _Cursor, vtype: int) -> Any:
    if vtype == gguf.GGUFValueType.STRING:
        return c.string()
    return c.unpack(_SCALARS[vtype])


def read_header(path: str | os.PathLike[str]) -> Header:
    """The metadata and tensor sizes of the GGUF (v2 or v3, little-endian) at ``path``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        if c.unpack("<I") != gguf.GGUF_MAGIC or c.unpack("<I") not in (2, 3):
            raise ValueError(f"{path}: not a GGUF v2/v3 little-endian file")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        metadata: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key, vtype = c.string(), c.unpack("<I")
            if vtype != gguf.GGUFValueType.ARRAY:
                metadata[key] = _value(c, vtype)
                continue
            itype, count = c.unpack("<I"), c.unpack("<Q")
            lengths[key] = count
            if itype == gguf.GGUFValueType.STRING:
                c.skip_strings(count)
            elif itype == gguf.GGUFValueType.ARRAY:
                raise ValueError(f"{path}: nested array in {key!r}")
            elif count <= _KEEP_ARRAY:
                metadata[key] = [_value(c, itype) for _ in range(count)]
            else:
                c.at += count * struct.calcsize(_SCALARS[itype])
        tensors = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
            ttype = c.unpack("<I")
            c.unpack("<Q")  # offset into the data: never read
            n = 1
            for d in dims:
                n *= d
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            tensors.append(Tensor(name, n // block * size))
    return Header(metadata, lengths, tuple(tensors))


@dataclass(frozen=True)
class Footprint:
    """Bytes of one loaded model, by part (see the module docstring)."""

    weights: int
    kv: int
    compute: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def device_kind(device: str) -> str:
    """``cpu`` for ``cpu`` and ``cpu:0-3``; ``cuda`` for ``cuda:N``."""
    return device.split(":", 1)[0]


def _per_layer(v: Any, n_layer: int) -> list[int]:
    return [int(x) for x in v] if isinstance(v, list) else [int(v)] * n_layer


def kv_bytes(h: Header, cells: int, layers: set[int] | None = None) -> int:
    """The f16 KV cache of ``cells`` cells over ``layers`` (all when None)."""
    if h.arch in ENCODER_ARCHS:
        return 0
    n_layer = int(h.arch_key("block_count"))
    n_embd = int(h.arch_key("embedding_length"))
    heads = _per_layer(h.arch_key("attention.head_count"), n_layer)
    heads_kv = _per_layer(h.arch_key("attention.head_count_kv", heads), n_layer)
    total = 0
    for i in range(n_layer):
        if (layers is not None and i not in layers) or heads_kv[i] == 0:
            continue
        head_dim = n_embd // heads[i] if heads[i] else 0
        k = int(h.arch_key("attention.key_length", head_dim))
        v = int(h.arch_key("attention.value_length", head_dim))
        total += cells * heads_kv[i] * (k + v) * KV_BYTES
    return total


def _offloaded(h: Header, n_gpu_layers: int) -> tuple[set[int], bool]:
    """The block indexes llama.cpp puts on the GPU (the last ``n_gpu_layers``), and whether the
    output layer goes too (only when every block does and one more layer is asked for)."""
    n_layer = int(h.arch_key("block_count"))
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    return set(range(max(0, n_layer - ngl), n_layer)), ngl > n_layer


def estimate(
    h: Header,
    *,
    n_ctx: int,
    slots: int,
    n_batch: int,
    model_type: str = "llm",
    n_gpu_layers: int = 0,
    device: str = "cpu",
    overhead: int | None = None,
) -> Footprint:
    """The footprint of ``h`` loaded with these parameters on ``device``: its resident set on a
    CPU, its device memory on a GPU. ``slots`` is the chat model's parallel (its context is
    ``n_ctx * slots`` cells); embedding and rerank models have one sequence. ``overhead``
    replaces the process's default (e.g. a measured standby process)."""
    one_seq = model_type in ("embedding", "rerank")
    seqs = 1 if one_seq else slots
    cells = n_ctx * seqs
    n_vocab = h.n_vocab
    # Embedding and rerank contexts size their output buffer for a whole batch of outputs.
    outputs = n_batch if one_seq else seqs
    if device_kind(device) == "cpu":
        return Footprint(
            weights=sum(t.n_bytes for t in h.tensors),
            kv=kv_bytes(h, cells),
            compute=CPU_LOAD_BYTES + n_vocab * (CPU_BYTES_PER_TOKEN + 4 * outputs),
            overhead=CPU_PROCESS_BYTES if overhead is None else overhead,
        )
    layers, output = _offloaded(h, n_gpu_layers)
    if not layers:
        return Footprint(0, 0, 0, 0)  # nothing on the GPU: llama.cpp makes no context there
    weights = sum(
        t.n_bytes
        for t in h.tensors
        if (t.layer in layers if t.layer is not None else output and t.name != "token_embd.weight")
    )
    n_head = max(_per_layer(h.arch_key("attention.head_count"), 1))
    ubatch = min(n_batch, MAX_UBATCH)
    # One ubatch of logits, and of attention scores over a slot's context (no flash attention).
    compute = 4 * ubatch * (n_vocab + n_ctx * n_head)
    return Footprint(
        weights=weights,
        kv=kv_bytes(h, cells, layers),
        compute=compute,
        overhead=GPU_CONTEXT_BYTES if overhead is None else overhead,
    )


def spec_digest(
    *, path: str, size: int, model_type: str, n_ctx: int, slots: int, n_batch: int,
    n_gpu_layers: int, device: str, mmproj: tuple[str, int] | None = None,
) -> str:  # fmt: skip
    """What a measured footprint depends on: a measurement under another digest (another file,
    context, slot count, offload, device kind or vision projector: ``mmproj`` is its path and
    size) says nothing about the next load."""
    kind = device_kind(device)
    fields: dict[str, object] = {
        "path": path,
        "size": size,
        "type": model_type,
        "n_ctx": n_ctx,
        "slots": slots,
        "n_batch": n_batch,
        "n_gpu_layers": n_gpu_layers if kind != "cpu" else 0,
        "device": kind,
    }
    if mmproj is not None:  # absent without one: digests measured before projectors still hold
        fields["mmproj"] = list(mmproj)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def expected_bytes(estimated: int, recorded: dict[str, str] | None, digest: str) -> int:
    """The bytes a load should be counted for: the last measurement of the same digest (a
    ``keys.footprint`` hash) when there is one, else the estimate."""
    if recorded and recorded.get("spec") == digest and (recorded.get("bytes") or "").isdigit():
        return int(recorded["bytes"])
    return estimated
