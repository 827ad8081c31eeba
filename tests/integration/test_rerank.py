"""POST /v1/rerank against real parts: a real Redis, the coordinator and agent running, a model
process running llama.cpp with rank pooling on a tiny reranker GGUF (``write_tiny_model(...,
rerank=True)``), requests through the Flask app.

The tiny reranker's weights are random, so which document is "relevant" is random too: the
tests check the answer against llama.cpp scoring the same pairs directly, and its order, cut and
indices against those scores.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from residency import keys
from residency.tinymodel import BOS_ID, EOS_ID, IM_END_ID, write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.integration.test_pool import chat, client_for

QUERY = "hello world"
DOCS = ["the world is", "how are you", "that is it", "hello", "a a a a", "this and that"]


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("rerankers")
    return {
        "rr": write_tiny_model(d / "rr.gguf", seed=4, rerank=True),
        "rr2": write_tiny_model(d / "rr2.gguf", seed=5, rerank=True),
    }


def models(models_dir: Path, rerankers: dict[str, Path]) -> dict[str, dict[str, Any]]:
    extra = {n: {"path": str(p), "n_ctx": 512, "type": "rerank"} for n, p in rerankers.items()}
    return tiny_models(models_dir, **extra)


def direct_scores(path: Path, query: str, docs: list[str]) -> tuple[list[float], int]:
    """Each pair scored alone by llama.cpp (rank pooling), laid out by hand as llama.cpp's
    server lays out a pair for this vocabulary: [BOS] query [EOS] [SEP] document [EOS] (the
    tiny reranker's EOS is <|im_end|> and its SEP </s>); and the tokens they took."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
        n_ctx=512,
        verbose=False,
    )
    try:

        def tok(s: str) -> list[int]:
            return list(llm.tokenize(s.encode(), add_bos=False, special=False))

        ctx = llm._ctx.ctx
        scores, total = [], 0
        for d in docs:
            pair = [BOS_ID, *tok(query), IM_END_ID, EOS_ID, *tok(d), IM_END_ID]
            total += len(pair)
            batch = llama_cpp.llama_batch_init(len(pair), 0, 1)
            try:
                for i, t in enumerate(pair):
                    batch.token[i], batch.pos[i] = t, i
                    batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 1, 0, True
                batch.n_tokens = len(pair)
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
                assert llama_cpp.llama_decode(ctx, batch) == 0
                scores.append(float(llama_cpp.llama_get_embeddings_seq(ctx, 0)[0]))
            finally:
                llama_cpp.llama_batch_free(batch)
        return scores, total
    finally:
        llm.close()


def rerank(c: Any, model: str = "rr", **kw: Any) -> Any:
    return c.post("/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCS, **kw})


def test_scores_are_llama_cpps_sorted_with_their_documents(
    start_pool: Callable[..., Pool], models_dir: Path, rerankers: dict[str, Path]
) -> None:
    pool = start_pool(models=models(models_dir, rerankers))
    resp = rerank(client_for(pool))
    assert resp.status_code == 200, resp.get_json()
    out = resp.get_json()
    want, tokens = direct_scores(rerankers["rr"], QUERY, DOCS)
    assert len(set(want)) == len(DOCS)  # distinct scores: the order below is well defined
    results = out["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    for r in results:
        assert r["document"] == {"text": DOCS[r["index"]]}
        assert r["relevance_score"] == pytest.approx(want[r["index"]], rel=1e-4, abs=1e-6)
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert out["model"] == "rr"
    assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_top_n_and_documents_left_out(
    start_pool: Callable[..., Pool], models_dir: Path, rerankers: dict[str, Path]
) -> None:
    pool = start_pool(models=models(models_dir, rerankers))
    c = client_for(pool)
    full = rerank(c).get_json()["results"]
    resp = rerank(c, top_n=2, return_documents=False, documents=[{"text": d} for d in DOCS])
    assert resp.status_code == 200, resp.get_json()
    top = resp.get_json()["results"]
    assert top == [{"index": r["index"], "relevance_score": r["relevance_score"]} for r in full[:2]]


def test_a_model_of_another_type_is_the_clients_400(
    start_pool: Callable[..., Pool], models_dir: Path, rerankers: dict[str, Path]
) -> None:
    pool = start_pool(models=models(models_dir, rerankers))
    c = client_for(pool)
    for model in ("a", "emb"):
        err = rerank(c, model).get_json()["error"]
        assert (err["param"], err["code"]) == ("model", "wrong_model_type"), err
    err = c.post("/v1/embeddings", json={"model": "rr", "input": "x"}).get_json()["error"]
    assert (err["param"], err["code"]) == ("model", "wrong_model_type")
    resp = chat(c, "rr")
    assert resp.status_code == 400
    assert resp.get_json()["error"]["code"] == "wrong_model_type"
    assert rerank(c, "nope").status_code == 404
    assert pool.resident() == set()  # nothing was loaded for a refused request


def test_the_rerank_pool_counts_separately(
    start_pool: Callable[..., Pool], models_dir: Path, rerankers: dict[str, Path]
) -> None:
    """One limit (max_loaded_models = 1) counted per type: a reranker takes no slot of an LLM
    or an embedding model, and a second reranker evicts only the first."""
    pool = start_pool(pool={"max_loaded_models": 1}, models=models(models_dir, rerankers))
    c = client_for(pool)
    assert chat(c, "a").status_code == 200
    assert c.post("/v1/embeddings", json={"model": "emb", "input": "x"}).status_code == 200
    assert rerank(c, "rr").status_code == 200
    assert pool.resident() == {"a", "emb", "rr"}
    assert rerank(c, "rr2").status_code == 200
    pool.wait_for(lambda: pool.resident() == {"a", "emb", "rr2"}, what="rr evicted for rr2")
    health = c.get("/health").get_json()
    assert health["max_models"]["rerank"] == {"configured": 1, "effective": 1}
    assert pool.r.hget(keys.limits(), "rerank") == "1"
