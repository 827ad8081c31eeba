"""The rerank API's pure parts: request validation, the answer's shape and order, how a pair is
laid out and batched, the ``rerank`` model type, and its own pool in the admission rules."""

from __future__ import annotations

from typing import Any

import pytest

from residency.errors import ApiError
from residency.pool.decide import Evict, Load, ModelView, Snapshot, WorkerView, decide
from residency.pool.snapshot import TYPES
from residency.settings import ModelSpec, SettingsError, build
from residency.states import ModelState as S
from web.rerank import MAX_RERANK_DOCUMENTS, answer, validate_rerank
from workers import rerank

# --- validation -------------------------------------------------------------------------------


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "rr", "query": "q", "documents": ["a", "b"], **kw}


def test_valid_request_with_defaults() -> None:
    v = validate_rerank(body(documents=["a", {"text": "b"}]))
    assert v.model == "rr"
    assert v.params == {"query": "q", "documents": ["a", "b"]}
    assert v.options == {"top_n": None, "return_documents": True}
    assert v.stream is False


def test_top_n_and_return_documents_pass_on() -> None:
    v = validate_rerank(body(top_n=1, return_documents=False))
    assert v.options == {"top_n": 1, "return_documents": False}


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": None}, "model"),
        ({"model": 3}, "model"),
        ({"query": None}, "query"),
        ({"query": 3}, "query"),
        ({"query": "  "}, "query"),
        ({"documents": None}, "documents"),
        ({"documents": "a"}, "documents"),
        ({"documents": []}, "documents"),
        ({"documents": ["a"] * (MAX_RERANK_DOCUMENTS + 1)}, "documents"),
        ({"documents": ["a", 3]}, "documents[1]"),
        ({"documents": ["a", ["b"]]}, "documents[1]"),
        ({"documents": [{"content": "a"}]}, "documents[0].text"),
        ({"documents": [{"text": 1}]}, "documents[0].text"),
        ({"top_n": 0}, "top_n"),
        ({"top_n": True}, "top_n"),
        ({"top_n": "2"}, "top_n"),
        ({"return_documents": "yes"}, "return_documents"),
    ],
)
def test_bad_fields_are_named(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        validate_rerank(body(**patch))
    assert e.value.status == 400
    assert e.value.param == param


# --- the answer -------------------------------------------------------------------------------


def reply(*scores: float, tokens: int = 9) -> dict[str, Any]:
    return {"scores": list(scores), "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def test_answer_sorted_by_score_with_documents() -> None:
    v = validate_rerank(body(documents=["x", {"text": "y"}, "z"]))
    out = answer(reply(0.2, 0.9, 0.5), v)
    assert [r["index"] for r in out["results"]] == [1, 2, 0]
    assert [r["relevance_score"] for r in out["results"]] == [0.9, 0.5, 0.2]
    assert [r["document"] for r in out["results"]] == [{"text": "y"}, {"text": "z"}, {"text": "x"}]
    assert out["model"] == "rr"
    assert out["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert out["id"].startswith("rerank-")


def test_ties_keep_input_order_and_top_n_cuts() -> None:
    v = validate_rerank(body(documents=["a", "b", "c", "d"], top_n=3))
    out = answer(reply(0.5, 0.7, 0.5, 0.1), v)
    assert [r["index"] for r in out["results"]] == [1, 0, 2]


def test_top_n_above_the_count_returns_all_and_documents_can_be_left_out() -> None:
    v = validate_rerank(body(top_n=10, return_documents=False))
    out = answer(reply(0.1, 0.3), v)
    assert out["results"] == [
        {"index": 1, "relevance_score": 0.3},
        {"index": 0, "relevance_score": 0.1},
    ]


def test_answer_refuses_a_score_count_that_does_not_match() -> None:
    with pytest.raises(ValueError):
        answer(reply(0.1), validate_rerank(body()))


# --- pairs and batches ------------------------------------------------------------------------


def fake_tokenize(text: str, special: bool) -> list[int]:
    return [100 + ord(c) for c in text] if not special else [-1, *map(ord, text)]


def test_pair_layout_adds_the_tokens_the_vocabulary_adds() -> None:
    full = rerank.PairFormat(bos=1, eos=2, sep=3)
    assert rerank.pair_tokens(full, fake_tokenize, "a", "bc") == [1, 197, 2, 3, 198, 199, 2]
    bare = rerank.PairFormat(bos=1)
    assert rerank.pair_tokens(bare, fake_tokenize, "a", "b") == [1, 197, 198]


def test_pair_layout_from_the_rerank_template_parses_special_tokens() -> None:
    fmt = rerank.PairFormat(template="<q>{query}</q>{document}", bos=1, eos=2)
    assert rerank.pair_tokens(fmt, fake_tokenize, "x", "y") == [-1, *map(ord, "<q>x</q>y")]


def test_batches_fill_tokens_and_sequences_in_order() -> None:
    assert rerank.batches([3, 3, 3, 5, 1], max_tokens=6, max_seqs=8) == [[0, 1], [2], [3, 4]]
    assert rerank.batches([1, 1, 1, 1, 1], max_tokens=100, max_seqs=2) == [[0, 1], [2, 3], [4]]
    assert rerank.batches([6], max_tokens=6, max_seqs=1) == [[0]]


def test_a_pair_longer_than_a_batch_is_the_clients_400() -> None:
    rerank.check_lengths([4, 5], cap=5)
    with pytest.raises(ApiError) as e:
        rerank.check_lengths([4, 6, 9], cap=5)
    assert (e.value.status, e.value.param, e.value.code) == (
        400,
        "documents[1]",
        "context_length_exceeded",
    )


# --- the model type and its pool --------------------------------------------------------------


def test_rerank_is_a_model_type_with_its_own_limit() -> None:
    assert ModelSpec(path="/m.gguf", type="rerank").type == "rerank"
    assert "rerank" in TYPES
    with pytest.raises(SettingsError) as e:
        build({"models": {"x": {"path": "/m.gguf", "type": "reranker"}}})
    assert "models.x.type" in e.value.problems


W = {"box1": WorkerView("box1", ("cpu",))}


def mv(name: str, typ: str, state: S = S.UNLOADED, **kw: Any) -> ModelView:
    ready = state is S.READY
    return ModelView(
        name=name,
        type=typ,
        state=state,
        token=f"t-{name}",
        host="box1" if ready else None,
        device="cpu" if ready else None,
        **kw,
    )


def snap(*models: ModelView) -> Snapshot:
    limits = {t: 1 for t in TYPES}
    return Snapshot({m.name: m for m in models}, W, limits, 1000.0)


def test_a_waiting_reranker_never_evicts_an_llm_or_an_embedding_model() -> None:
    acts = decide(
        snap(
            mv("chat", "llm", S.READY, last_used=1.0),
            mv("emb", "embedding", S.READY, last_used=1.0),
            mv("rr", "rerank", queued=1, demand_since=1.0),
        )
    )
    assert [a for a in acts if isinstance(a, Load)] == [Load("rr", "box1", "cpu")]
    assert [a for a in acts if isinstance(a, Evict)] == []


def test_a_waiting_llm_never_evicts_a_reranker() -> None:
    acts = decide(snap(mv("rr", "rerank", S.READY, last_used=1.0), mv("chat", "llm", queued=1)))
    assert [a for a in acts if isinstance(a, Load)] == [Load("chat", "box1", "cpu")]
    assert [a for a in acts if isinstance(a, Evict)] == []


def test_a_waiting_reranker_evicts_the_idle_reranker_in_its_full_pool() -> None:
    acts = decide(
        snap(
            mv("chat", "llm", S.READY, last_used=1.0),
            mv("rr1", "rerank", S.READY, last_used=1.0),
            mv("rr2", "rerank", queued=1, demand_since=1.0),
        )
    )
    assert [a for a in acts if isinstance(a, Evict)] == [Evict("rr1", "t-rr1", "lru")]
