"""The pure footprint estimate on generated GGUFs, against bytes computed by hand from the tiny
model's shapes (residency/tinymodel.py: 397 tokens, 2 layers, n_embd 64, 4 heads, 2 KV heads
of 16, n_ff 128)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from residency import footprint
from residency.tinymodel import write_tiny_model

N_VOCAB = 397
F32_NORM = 64 * 4
# attn_norm, q, k, v, output, ffn_norm, gate, up, down
F32_LAYER = F32_NORM + 64 * 64 * 4 + 2 * (32 * 64 * 4) + 64 * 64 * 4 + F32_NORM + 3 * (128 * 64 * 4)
F32_EMBD = N_VOCAB * 64 * 4
F32_WEIGHTS = F32_EMBD + 2 * F32_LAYER + F32_NORM  # + output_norm; output is tied to the embd


def q8(elements: int) -> int:
    return elements // 32 * 34  # Q8_0: blocks of 32 weights in 34 bytes


Q8_LAYER = 2 * F32_NORM + q8(64 * 64) * 2 + q8(32 * 64) * 2 + 3 * q8(128 * 64)
Q8_WEIGHTS = q8(N_VOCAB * 64) + 2 * Q8_LAYER + F32_NORM
# Per cell and layer: 2 KV heads x (16 K + 16 V) f16 values.
KV_PER_CELL = 2 * (2 * (16 + 16) * 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fp")
    return {
        "f32": write_tiny_model(d / "f32.gguf"),
        "q8": write_tiny_model(d / "q8.gguf", dtype="q8_0"),
        "embed": write_tiny_model(d / "embed.gguf", embedding=True),
        "rerank": write_tiny_model(d / "rerank.gguf", rerank=True),
    }


def test_hand_computed_sizes_match() -> None:
    assert (F32_WEIGHTS, Q8_WEIGHTS, KV_PER_CELL) == (397_824, 106_612, 256)


@pytest.mark.parametrize("kind", ["f32", "q8", "embed", "rerank"])
def test_header_agrees_with_gguf_reader(tiny: dict[str, Path], kind: str) -> None:
    h = footprint.read_header(tiny[kind])
    rd = gguf.GGUFReader(tiny[kind])
    assert [(t.name, t.n_bytes) for t in h.tensors] == [
        (t.name, int(t.n_bytes)) for t in rd.tensors
    ]
    assert h.n_vocab == N_VOCAB
    assert h.arch_key("block_count") == 2


def test_cpu_estimate_of_the_tiny_models(tiny: dict[str, Path]) -> None:
    f32 = footprint.estimate(footprint.read_header(tiny["f32"]), n_ctx=512, slots=3, n_batch=512)
    assert f32.weights == F32_WEIGHTS
    assert f32.kv == 512 * 3 * KV_PER_CELL  # a chat model's context is n_ctx x slots cells
    assert f32.overhead == footprint.CPU_PROCESS_BYTES
    assert f32.compute == footprint.CPU_LOAD_BYTES + N_VOCAB * (
        footprint.CPU_BYTES_PER_TOKEN + 4 * 3
    )
    assert f32.total == f32.weights + f32.kv + f32.compute + f32.overhead
    assert f32.to_dict()["total"] == f32.total

    q8h = footprint.read_header(tiny["q8"])
    assert footprint.estimate(q8h, n_ctx=512, slots=1, n_batch=512).weights == Q8_WEIGHTS
    measured_overhead = footprint.estimate(q8h, n_ctx=512, slots=1, n_batch=512, overhead=7)
    assert measured_overhead.overhead == 7


def test_embedding_models_have_one_sequence(tiny: dict[str, Path]) -> None:
    h = footprint.read_header(tiny["embed"])
    e = footprint.estimate(h, n_ctx=512, slots=4, n_batch=256, model_type="embedding")
    assert e.kv == 512 * KV_PER_CELL
    # Its output buffer holds a whole batch of outputs.
    assert e.compute == footprint.CPU_LOAD_BYTES + N_VOCAB * (
        footprint.CPU_BYTES_PER_TOKEN + 4 * 256
    )


def test_gpu_estimate_counts_only_the_offloaded_layers(tiny: dict[str, Path]) -> None:
    h = footprint.read_header(tiny["f32"])

    def on_gpu(ngl: int) -> footprint.Footprint:
        return footprint.estimate(
            h, n_ctx=512, slots=1, n_batch=1024, n_gpu_layers=ngl, device="cuda:0"
        )

    assert on_gpu(0) == footprint.Footprint(0, 0, 0, 0)
    one = on_gpu(1)  # the last block
    assert (one.weights, one.kv) == (F32_LAYER, 512 * KV_PER_CELL // 2)
    two = on_gpu(2)  # every block, but not the output layer
    assert (two.weights, two.kv) == (2 * F32_LAYER, 512 * KV_PER_CELL)
    every = on_gpu(-1)  # and output_norm too; token_embd stays on the host
    assert every.weights == 2 * F32_LAYER + F32_NORM
    assert every.compute == 4 * 512 * (N_VOCAB + 512 * 4)  # one ubatch: min(n_batch, 512)
    assert every.overhead == footprint.GPU_CONTEXT_BYTES


def _metadata_only(path: Path, arch: str, **keys: Any) -> footprint.Header:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(3)
    w.add_embedding_length(640)
    w.add_head_count(4)
    for name, value in keys.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{name}", value)
        else:
            w.add_uint32(f"{arch}.{name}", value)
    w.add_token_list(["a", "b", "c"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return footprint.read_header(path)


def test_kv_reads_key_and_value_lengths(tmp_path: Path) -> None:
    # Gemma 3's shape: one KV head of 256 where n_embd / n_head would say 160.
    lengths = {"attention.key_length": 256, "attention.value_length": 256}
    h = _metadata_only(tmp_path / "g.gguf", "gemma3", **{"attention.head_count_kv": 1}, **lengths)
    assert h.n_vocab == 3
    assert footprint.kv_bytes(h, 100) == 3 * 100 * 1 * (256 + 256) * 2


def test_kv_takes_per_layer_head_counts(tmp_path: Path) -> None:
    h = _metadata_only(tmp_path / "p.gguf", "llama", **{"attention.head_count_kv": [0, 1, 2]})
    assert footprint.kv_bytes(h, 10) == 10 * (0 + 1 + 2) * (160 + 160) * 2


def test_encoders_have_no_kv_cache(tmp_path: Path) -> None:
    h = _metadata_only(tmp_path / "b.gguf", "bert")
    assert footprint.kv_bytes(h, 512) == 0


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="not a GGUF"):
        footprint.read_header(bad)


def _digest(**over: Any) -> str:
    base: dict[str, Any] = {
        "path": "/m/a.gguf",
        "size": 10,
        "model_type": "llm",
        "n_ctx": 512,
        "slots": 1,
        "n_batch": 512,
        "n_gpu_layers": -1,
        "device": "cpu",
    }
    return footprint.spec_digest(**(base | over))


def test_a_measurement_counts_only_under_its_own_digest() -> None:
    d = _digest()
    # A CPU load never offloads, and a CPU device's cores do not change the footprint.
    assert d == _digest(n_gpu_layers=0) == _digest(device="cpu:0-3")
    changed = [
        _digest(**{k: v})
        for k, v in [("n_ctx", 1024), ("slots", 2), ("size", 11), ("device", "cuda:0")]
    ]
    assert len({d, *changed}) == 5
    assert _digest(device="cuda:0", n_gpu_layers=10) != _digest(device="cuda:0")
    recorded = {"bytes": "123", "spec": d}
    assert footprint.expected_bytes(99, recorded, d) == 123
    assert footprint.expected_bytes(99, recorded, changed[0]) == 99
    assert footprint.expected_bytes(99, None, d) == 99
    assert footprint.expected_bytes(99, {"bytes": "", "spec": d}, d) == 99
