"""residency/tinymodel.py's sizes: a benchmark-sized model (bench/gpu.sh) has the shape it was
asked for, a padded vocabulary llama.cpp's tokenizer reaches, and the default stays the tiny
model every other test loads."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from residency.cli import main
from residency.tinymodel import TINY, Shape, write_tiny_model

SMALL = Shape(n_layer=3, n_embd=96, n_head=6, n_head_kv=3, n_ff=160, n_vocab=600)


def field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_a_sized_model_has_its_shape_and_dtype(tmp_path: Path) -> None:
    r = gguf.GGUFReader(write_tiny_model(tmp_path / "m.gguf", dtype="f16", shape=SMALL))
    assert field(r, "llama.block_count") == 3
    assert field(r, "llama.embedding_length") == 96
    assert field(r, "llama.feed_forward_length") == 160
    assert field(r, "llama.attention.head_count") == 6
    assert field(r, "llama.attention.head_count_kv") == 3
    assert field(r, "llama.rope.dimension_count") == 16
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    assert len(field(r, "tokenizer.ggml.tokens")) == 600  # type: ignore[arg-type]
    tensors = {t.name: t for t in r.tensors}
    assert sum(n.endswith("attn_q.weight") for n in tensors) == 3
    assert list(tensors["token_embd.weight"].shape) == [96, 600]
    assert list(tensors["blk.2.attn_k.weight"].shape) == [96, 48]  # 3 KV heads of 16
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [160, 96]
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_the_default_shape_is_the_tiny_model(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf")
    b = write_tiny_model(tmp_path / "b.gguf", shape=Shape())
    assert a.read_bytes() == b.read_bytes()
    r = gguf.GGUFReader(a)
    assert field(r, "llama.embedding_length") == TINY.n_embd == 64
    assert len(field(r, "tokenizer.ggml.tokens")) == 397  # type: ignore[arg-type]


def test_llama_cpp_tokenizes_a_padded_piece_as_one_token(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write_tiny_model(tmp_path / "m.gguf", shape=SMALL)
    tokens = list(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents())
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    # "▁w1f": its prefixes "▁w1" and "▁w" are pieces too, so the merges reach it.
    assert llm.tokenize(b"w1f", add_bos=False) == [tokens.index("\u2581w1f")]
    assert llm.n_vocab() == 600
    del llm


@pytest.mark.parametrize(
    ("sizes", "named"),
    [
        ({"n_embd": 100, "n_head": 6}, "n_embd"),
        ({"n_head": 4, "n_head_kv": 3}, "n_head_kv"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_embd": 12, "n_head": 4, "n_head_kv": 4}, "n_embd / n_head"),
    ],
)
def test_a_bad_shape_names_its_field(sizes: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Shape(**sizes)


def test_a_vocabulary_smaller_than_the_natural_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n_vocab must be at least 397"):
        write_tiny_model(tmp_path / "m.gguf", shape=Shape(n_vocab=100))
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_the_cli_takes_the_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    argv = ["tiny-model", str(out), "--dtype", "f16", "--n-layer", "3", "--n-embd", "96"]
    argv += ["--n-head", "6", "--n-head-kv", "3", "--n-ff", "160", "--n-vocab", "600"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    r = gguf.GGUFReader(out)
    assert field(r, "llama.block_count") == 3
    assert len(field(r, "tokenizer.ggml.tokens")) == 600  # type: ignore[arg-type]
    assert main(["tiny-model", str(tmp_path / "bad.gguf"), "--n-embd", "65"]) == 2
    assert "n_embd (65)" in capsys.readouterr().err
    assert not (tmp_path / "bad.gguf").exists()
