"""Hostile input over HTTP against the real app: every bad request gets a 4xx in the OpenAI
envelope naming what is wrong, never a 500, a hang or a dead model process; and no metric label
is ever made from a model name that is not registered."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from residency import registry
from residency.box import Box
from residency.settings import ModelSpec
from tests.conftest import OPEN_AUTH_ENV, Pool, tiny_models
from web import create_app
from web.body import MAX_JSON_DEPTH
from web.pipeline import UNKNOWN_LABEL
from web.validation import (
    MAX_CONTENT_PARTS,
    MAX_EMBEDDING_INPUTS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_REPEAT,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOOLS,
)

ADMIN = {"Authorization": "Bearer test-admin-key"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def client(tmp_path: Path, redis_url: str, r: redis.Redis) -> FlaskClient:
    box = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url=redis_url,
        environ={**OPEN_AUTH_ENV, "RESIDENCY_ADMIN_KEY": "test-admin-key"},
    )
    box.models_dir.mkdir(parents=True)
    for name, typ in (("tiny", "llm"), ("emb", "embedding")):
        (box.models_dir / f"{name}.gguf").write_bytes(b"GGUF")
        spec = ModelSpec(path=str(box.models_dir / f"{name}.gguf"), type=typ)
        registry.put(r, registry.Entry(name, spec, "admin"), "test")
    app: Flask = create_app(box)
    return app.test_client()


def envelope(resp: Any, status: int = 400, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.get_data(as_text=True)[:500]
    err = resp.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def post_raw(client: FlaskClient, data: bytes, path: str = "/v1/chat/completions") -> Any:
    return client.post(path, data=data, headers=JSON)


def nested(depth: int) -> bytes:
    """A chat body whose ``metadata`` holds arrays nested so that the innermost is at
    ``depth`` (the body object is level 1, metadata level 2)."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return b'{"model": "tiny", "messages": [], "metadata": ' + inner.encode() + b"}"


# --- the body ---------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 500, 100_000])
def test_deeply_nested_json_is_400(client: FlaskClient, depth: int) -> None:
    err = envelope(post_raw(client, nested(depth)), code="invalid_json")
    assert "nested deeper" in err["message"]


def test_nesting_at_the_limit_is_not_refused_for_depth(client: FlaskClient) -> None:
    # The body is otherwise invalid (no messages): validation answers, not the depth guard.
    err = envelope(post_raw(client, nested(MAX_JSON_DEPTH)))
    assert err["param"] == "messages"


def test_the_deep_place_is_named(client: FlaskClient) -> None:
    body = {**CHAT, "response_format": {"type": "json_object", "schema": {}}}
    node: dict[str, Any] = body["response_format"]["schema"]
    for _ in range(MAX_JSON_DEPTH):
        node["x"] = {}
        node = node["x"]
    err = envelope(client.post("/v1/chat/completions", json=body), code="invalid_json")
    assert err["param"].startswith("response_format.schema.x.x.x")


@pytest.mark.parametrize(
    "data",
    [
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        json.dumps(CHAT).encode("utf-16"),
        b"\xef\xbb\xbf" + json.dumps(CHAT).encode(),
    ],
    ids=["bad-bytes", "encoded-surrogate", "utf-16", "bom"],
)
def test_bodies_that_are_not_utf8_json_are_400(client: FlaskClient, data: bytes) -> None:
    envelope(post_raw(client, data), code="invalid_json")


def test_a_lone_surrogate_escape_is_400_naming_the_field(client: FlaskClient) -> None:
    data = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    err = envelope(post_raw(client, data), code="invalid_json")
    assert err["param"] == "messages[0].content"
    key = b'{"model": "tiny", "messages": [], "metadata": {"\\udfff": "x"}}'
    assert envelope(post_raw(client, key))["param"] == "metadata.\udfff"


def test_a_surrogate_pair_escape_is_fine(client: FlaskClient) -> None:
    data = b'{"model": "nope", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    envelope(post_raw(client, data), 404, "model_not_found")


@pytest.mark.parametrize("number", [b"1e999", b"-1e400", b"9" * 5000])
def test_numbers_json_cannot_hold_are_400(client: FlaskClient, number: bytes) -> None:
    data = b'{"model": "tiny", "messages": [], "temperature": ' + number + b"}"
    envelope(post_raw(client, data), code="invalid_json")


# --- numbers and types --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 2**31),
        ("max_tokens", 10**30),
        ("max_tokens", "5"),
        ("max_tokens", True),
        ("max_tokens", 1.5),
        ("max_completion_tokens", -(10**30)),
        ("temperature", -0.1),
        ("temperature", 1e308),
        ("temperature", 10**40),
        ("temperature", "hot"),
        ("top_p", 1.01),
        ("top_p", -1),
        ("min_p", [0.5]),
        ("top_k", -1),
        ("top_k", 10**12),
        ("top_k", 2.5),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repeat_penalty", 1e10),
        ("n", 2),
        ("n", -1),
        ("n", 10**20),
        ("n", "1"),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("seed", "42"),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("logprobs", "yes"),
        ("stream", "yes"),
        ("stream", 1),
        ("stop", 5),
        ("stop", [1]),
        ("tools", {}),
        ("tool_choice", 5),
        ("response_format", "json"),
        ("messages", "hi"),
        ("messages", {"role": "user"}),
        ("model", 5),
        ("model", ["tiny"]),
    ],
)
def test_bad_numbers_and_types_are_400_naming_the_field(
    client: FlaskClient, field: str, value: Any
) -> None:
    err = envelope(client.post("/v1/chat/completions", json={**CHAT, field: value}))
    assert err["param"] is not None and err["param"].split("[")[0] == field, err


@pytest.mark.parametrize(
    ("bias", "param"),
    [
        ({"-1": 1}, "logit_bias.-1"),
        ({"1e3": 1}, "logit_bias.1e3"),
        ({" 1": 1}, "logit_bias. 1"),
        ({"99999999999": 1}, "logit_bias.99999999999"),
        ({"9" * 5000: 1}, "logit_bias." + "9" * 32),
        ({"1": 1000}, "logit_bias.1"),
        ({"1": "x"}, "logit_bias.1"),
    ],
)
def test_bad_logit_bias_is_400(client: FlaskClient, bias: dict[str, Any], param: str) -> None:
    err = envelope(client.post("/v1/chat/completions", json={**CHAT, "logit_bias": bias}))
    assert err["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": 5}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": "no"}, "echo"),
        ("/v1/embeddings", {"model": "emb", "input": [1, 2]}, "input[0]"),
        ("/v1/embeddings", {"model": "emb", "input": {"a": 1}}, "input"),
        ("/v1/embeddings", {"model": "emb", "input": "x", "dimensions": -1}, "dimensions"),
    ],
)
def test_other_endpoints_name_the_field(
    client: FlaskClient, path: str, body: dict[str, Any], param: str
) -> None:
    assert envelope(client.post(path, json=body))["param"] == param


# --- caps -----------------------------------------------------------------------------------


def _tool(i: int, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": f"f{i}"}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def _rf(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


BIG_SCHEMA = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
# llama.cpp's grammar parser overflows its stack (SIGSEGV, the model process dies) on a few
# thousand repetitions; a bound past the cap is dropped before the grammar is built.
DEEP_REPEAT = {"type": "array", "items": {"type": "integer"}, "maxItems": 2000}
HUGE_BOUNDS = [
    {"response_format": _rf({"type": "object", "properties": {"a": DEEP_REPEAT}})},
    {"response_format": _rf({"type": "string", "pattern": "^a{1,99999}$"})},
    {
        "tools": [_tool(0), _tool(1, {"type": "string", "maxLength": 10**9})],
        "tool_choice": "required",
    },
]


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        (
            {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)},
            "messages",
            "array_above_max_length",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 257}]},
            "messages[0].content",
            "array_above_max_length",
        ),
        ({"tools": [_tool(i) for i in range(MAX_TOOLS + 1)]}, "tools", "array_above_max_length"),
        ({"stop": ["x"] * (MAX_STOP + 1)}, "stop", "array_above_max_length"),
        ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop", "string_above_max_length"),
        ({"stop": ["a", "x" * (MAX_STOP_CHARS + 1)]}, "stop[1]", "string_above_max_length"),
        (
            {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
            "logit_bias",
            "array_above_max_length",
        ),
        ({"response_format": _rf(BIG_SCHEMA)}, "response_format.json_schema.schema", None),
        (
            {"response_format": {"type": "json_object", "schema": BIG_SCHEMA}},
            "response_format.schema",
            "schema_too_large",
        ),
        (
            {"response_format": _rf({"type": "string", "pattern": "^((a|b){0,100}){0,100}$"})},
            "response_format.json_schema.schema.pattern",
            "schema_too_large",
        ),
    ],
)
def test_caps(client: FlaskClient, extra: dict[str, Any], param: str, code: str | None) -> None:
    err = envelope(client.post("/v1/chat/completions", json={**CHAT, **extra}))
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert MAX_CONTENT_PARTS == 256  # the case above is one over it


def test_caps_allow_their_limit(start_pool: Callable[..., Pool], models_dir: Path) -> None:
    """At each cap a request is served: it passes validation and a real model process
    generates its answer (counted in the model's usage), not merely "not 400"."""
    from residency.tinymodel import write_tiny_model
    from tests.integration.test_pool import client_for
    from tests.integration.test_usage import usage_of
    from tests.integration.tools_template import TOOLS_TEMPLATE

    # A template that takes tools, and room for the prompt of 128 of them.
    tools_model = models_dir / "tiny-tools.gguf"
    if not tools_model.exists():
        write_tiny_model(tools_model, seed=5, chat_template=TOOLS_TEMPLATE)
    pool = start_pool(models=tiny_models(models_dir, a={"path": str(tools_model), "n_ctx": 16384}))
    c = client_for(pool)
    at_caps = [
        {"stop": ["x" * MAX_STOP_CHARS] * MAX_STOP},
        {"tools": [_tool(i) for i in range(MAX_TOOLS)]},
        {
            "response_format": _rf(
                {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_SCHEMA_REPEAT}
            )
        },
        # Past the repeat cap: served, the bound dropped (the process would die building it).
        *HUGE_BOUNDS,
    ]
    for n, extra in enumerate(at_caps, 1):
        body = {**CHAT, "model": "a", "max_tokens": 4, "temperature": 0, **extra}
        resp = c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, (list(extra), resp.get_data(as_text=True)[:500])
        out = resp.get_json()
        assert out["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        assert out["usage"]["prompt_tokens"] > 0
        assert usage_of(pool.r, "anon", "a")["requests"] == n  # served by the model process
    # The tools were in the prompt it was given.
    assert usage_of(pool.r, "anon", "a")["prompt_tokens"] > 2 * MAX_TOOLS


def test_embedding_inputs_are_capped(client: FlaskClient) -> None:
    body = {"model": "emb", "input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}
    err = envelope(client.post("/v1/embeddings", json=body), code="array_above_max_length")
    assert err["param"] == "input"


def test_a_policy_regex_re2_cannot_run_is_400_naming_the_rule(client: FlaskClient) -> None:
    policy = {
        "candidates": ["tiny"],
        "default": "tiny",
        "rules": [{"id": "r", "match": {"regex": r"(\w+)\s\1"}, "route_to": "tiny"}],
    }
    resp = client.put("/admin/policies/auto", json=policy, headers=ADMIN)
    err = envelope(resp, code="invalid_policy")
    assert err["param"] == "rules[0].match.regex"
    assert "RE2" in err["message"]


# --- unknown model names and metric labels --------------------------------------------------


def _request_samples(client: FlaskClient) -> dict[tuple[str, str], float]:
    text = client.get("/metrics").get_data(as_text=True)
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("residency_requests_total{"):
            labels, _, value = line.partition("} ")
            parts = dict(
                p.split("=", 1) for p in labels.removeprefix("residency_requests_total{").split(",")
            )
            out[(parts["model"].strip('"'), parts["code"].strip('"'))] = float(value)
    return out


def test_unknown_model_names_never_become_metric_labels(client: FlaskClient) -> None:
    before = _request_samples(client)
    names = [f"made-up-{uuid.uuid4().hex}" for _ in range(5)] + ["x" * 5000, "_unknown_"]
    for name in names:
        body = {**CHAT, "model": name}
        envelope(client.post("/v1/chat/completions", json=body), 404, "model_not_found")
        envelope(client.post("/v1/completions", json={**body, "prompt": "x"}), 404)
        envelope(client.post("/v1/embeddings", json={"model": name, "input": "x"}), 404)
    after = _request_samples(client)
    text = client.get("/metrics").get_data(as_text=True)
    assert not any(n in text for n in names[:-1])
    assert {m for m, _ in after} - {m for m, _ in before} <= {UNKNOWN_LABEL}
    got = after[(UNKNOWN_LABEL, "404")] - before.get((UNKNOWN_LABEL, "404"), 0.0)
    assert got == 3 * len(names)


def test_a_registered_model_keeps_its_label(client: FlaskClient) -> None:
    before = _request_samples(client).get(("emb", "400"), 0.0)
    # Resolved (the name is registered), then refused: the label is the model's.
    envelope(client.post("/v1/chat/completions", json={**CHAT, "model": "emb"}))
    assert _request_samples(client)[("emb", "400")] == before + 1


# --- the context window, against a real model process ----------------------------------------


def test_a_prompt_over_the_context_is_400_and_the_model_lives_on(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool()
    c = create_app(pool.box).test_client()
    long = "hello world " * 600  # over 1000 tokens; the model's n_ctx is 512
    ok = c.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.get_json()
    pid = pool.pid("a")
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
        ("/v1/completions", {"prompt": long}, "prompt"),
    ]
    for path, body, param in cases:
        for stream in (False, True):
            resp = c.post(path, json={"model": "a", "max_tokens": 2, "stream": stream, **body})
            err = envelope(resp, 400, "context_length_exceeded")
            assert err["param"] == param
            assert "512" in err["message"]
    ok = c.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.get_json()
    assert pool.pid("a") == pid
    # logit_bias is checked against the model's own vocabulary there.
    resp = c.post(
        "/v1/completions",
        json={"model": "a", "prompt": "hi", "max_tokens": 2, "logit_bias": {"999999": 1}},
    )
    assert envelope(resp, 400, "invalid_value")["param"] == "logit_bias.999999"
    assert pool.pid("a") == pid
