"""The OpenAPI document against a running box: schemathesis generates requests from
``GET /openapi.json`` for every operation (the admin operations that change the box left out)
and sends them to a real HTTP server with real Redis and real model processes (tiny GGUFs).
No answer may be a 5xx, and every answer must be one the document declares: its status, its
content type and its body's schema. The generation paths also get bodies that break the
document (schemathesis' negative mode): each must be refused with a declared 4xx.

The budget is bounded (``EXAMPLES`` per operation, no shrinking) and generation is
derandomized, so a run is the same every time: a failure is a finding, not noise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from residency.tinymodel import write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.integration.test_bounded_work import http_server

EXAMPLES = 20
ADMIN = {"Authorization": "Bearer test-admin-key"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
#: Request bodies whose ``model`` is pinned to the box's models, so that the fuzzer reaches the
#: generation (a made-up name only ever gets a 404).
MODEL_BODIES = (
    "ChatCompletionRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "RerankRequest",
    "ResponseRequest",
    "MessageRequest",
    "CountTokensRequest",
)
#: Admin operations that only read (or, for validate, decide without serving).
READ_ONLY_POSTS = {"/admin/policies/validate"}


def _fuzzed(path: str, method: str) -> bool:
    if not path.startswith("/admin/") or path.startswith("/admin/ui"):
        return True
    return method == "GET" or path in READ_ONLY_POSTS


def _document(base: str, models: list[str]) -> dict[str, Any]:
    doc = requests.get(f"{base}/openapi.json", timeout=30).json()
    doc = copy.deepcopy(doc)
    for name in MODEL_BODIES:
        doc["components"]["schemas"][name]["properties"]["model"] = {"enum": models}
    return doc


def _fuzz(op: Any, base: str, mode: GenerationMode) -> str | None:
    """Run one operation's budget in ``mode``; the first failure's report, or None."""
    failures: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if failures:
            return
        try:
            case.call_and_validate(base_url=base, headers=ADMIN, checks=CHECKS, timeout=120)
        except Exception as e:  # schemathesis' FailureGroup, or the request failing
            failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {e}")

    run()
    return failures[0] if failures else None


def test_the_box_answers_what_its_openapi_document_declares(
    start_pool: Callable[..., Pool], models_dir: Path
) -> None:
    reranker = models_dir / "tiny-rerank.gguf"
    if not reranker.exists():
        write_tiny_model(reranker, seed=11, rerank=True)
    # Short answers: the fuzzer's max_tokens is clamped to the model's cap.
    models = tiny_models(
        models_dir,
        a={"max_tokens": 4},
        rr={"path": str(reranker), "n_ctx": 512, "type": "rerank"},
    )
    models = {k: models[k] for k in ("a", "emb", "rr")}
    pool = start_pool(models=models)
    with http_server(pool) as port:
        base = f"http://127.0.0.1:{port}"
        # Served without any key.
        assert requests.get(f"{base}/openapi.json", timeout=30).status_code == 200
        schema = schemathesis.openapi.from_dict(_document(base, sorted(models)))
        ran: list[str] = []
        found: list[str] = []
        for result in schema.get_all_operations():
            op = result.ok()
            if not _fuzzed(op.path, op.method.upper()):
                continue
            ran.append(f"{op.method.upper()} {op.path}")
            # Bodies that break the document too, on the API's generation paths: each must be
            # refused with a declared 4xx, never crash the box.
            negative = op.method.upper() == "POST" and op.path.startswith("/v1/")
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[: 1 + negative]:
                failure = _fuzz(op, base, mode)
                if failure is not None:
                    found.append(failure)
    assert "POST /v1/chat/completions" in ran and "GET /admin/config" in ran
    assert not found, "\n\n".join(found)
