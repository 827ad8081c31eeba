"""Every OpenAI-shaped answer of the box, whole and streamed (each chunk, each event), checked
against OpenAI's published schemas (``tests/fixtures/openai_schemas.py``, written by hand from
openai/openai-openapi): chat completions (text, logprobs, tool calls forced or required, on a
model whose template takes tools and on one whose does not), completions (with logprobs),
embeddings, the model list and one model, and the Responses API (text, an answer cut by its
token limit, function calls).

The answers are read as raw JSON over a real HTTP server, not through a client library, which
would fill in what is missing. The tiny models emit random tokens; the assertions are on
shapes, never on text.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import requests

from tests.fixtures import sse
from tests.fixtures.openai_schemas import RESPONSE_EVENTS, check, problems
from tests.integration.test_openai_compat import client

__all__ = ["client"]  # the fixture ``base`` reads its address from

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris"]}, "days": {"const": 3}},
    "required": ["city", "days"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather", "parameters": PARAMETERS},
}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
RESP_WEATHER = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}


@pytest.fixture
def base(client: openai.OpenAI) -> str:
    """Models ``a`` (plain ChatML), ``t`` (a template with tools) and ``emb`` (embeddings)."""
    return str(client.base_url).rstrip("/")


def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = requests.post(base + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def events(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return sse.read(base + path, body)


def check_all(name: str, objs: list[dict[str, Any]]) -> None:
    found = [f"[{i}] {p}" for i, o in enumerate(objs) for p in problems(name, o)]
    assert not found, "\n".join(found)


# --- chat completions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"logprobs": True, "top_logprobs": 2},
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": PARAMETERS},
            },
            "max_tokens": 100,
        },
        {"stop": [" ", "e", "a"], "temperature": 1.0, "max_tokens": 60},
    ],
    ids=["text", "logprobs", "json", "schema", "stop"],
)
def test_chat_answers_whole_and_streamed(base: str, extra: dict[str, Any]) -> None:
    body = {"model": "a", "messages": USER, "max_tokens": 6, **extra}
    whole = post(base, "/chat/completions", body)
    check("CreateChatCompletionResponse", whole)
    if extra.get("logprobs"):
        assert whole["choices"][0]["logprobs"]["content"]
    chunks = events(base, "/chat/completions", body)
    check_all("CreateChatCompletionStreamResponse", chunks)
    with_usage = events(
        base, "/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    check_all("CreateChatCompletionStreamResponse", with_usage)
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]


@pytest.mark.parametrize(
    ("model", "choice"),
    [("a", FORCED), ("a", "required"), ("t", FORCED), ("t", "required"), ("t", "auto")],
)
def test_chat_tool_calls_whole_and_streamed(base: str, model: str, choice: Any) -> None:
    body = {
        "model": model,
        "messages": USER,
        "tools": [WEATHER],
        "tool_choice": choice,
        "max_tokens": 60 if choice == "auto" else 200,
    }
    whole = post(base, "/chat/completions", body)
    check("CreateChatCompletionResponse", whole)
    if choice != "auto":
        assert whole["choices"][0]["message"]["tool_calls"]
    check_all("CreateChatCompletionStreamResponse", events(base, "/chat/completions", body))


# --- completions, embeddings, models ----------------------------------------------------------


@pytest.mark.parametrize(
    "extra", [{}, {"logprobs": 2}, {"echo": True}, {"suffix": " The end."}], ids=str
)
def test_completions_whole_and_streamed(base: str, extra: dict[str, Any]) -> None:
    body = {"model": "a", "prompt": "Once upon a time", "max_tokens": 5, **extra}
    whole = post(base, "/completions", body)
    check("CreateCompletionResponse", whole)
    if "logprobs" in extra:
        assert whole["choices"][0]["logprobs"]["tokens"]
    # Each streamed chunk is a completion object, its finish reason null until the last.
    chunk = "CreateCompletionResponse (stream chunk)"
    check_all(chunk, events(base, "/completions", body))
    usage = events(base, "/completions", {**body, "stream_options": {"include_usage": True}})
    check_all(chunk, usage)


def test_embeddings(base: str) -> None:
    one = post(base, "/embeddings", {"model": "emb", "input": "hello"})
    check("CreateEmbeddingResponse", one)
    many = post(base, "/embeddings", {"model": "emb", "input": ["hello", "world"]})
    check("CreateEmbeddingResponse", many)
    assert [d["index"] for d in many["data"]] == [0, 1]


def test_models_list_and_one(base: str) -> None:
    listed = requests.get(base + "/models", timeout=30).json()
    check("ListModelsResponse", listed)
    assert {m["id"] for m in listed["data"]} >= {"a", "t", "emb"}
    for name in ("a", "emb"):
        check("Model", requests.get(f"{base}/models/{name}", timeout=30).json())


def test_errors(base: str) -> None:
    def refused(method: str, path: str, body: Any, status: int) -> dict[str, Any]:
        resp = requests.request(method, base + path, json=body, timeout=60)
        assert resp.status_code == status, resp.text
        out: dict[str, Any] = resp.json()
        check("ErrorResponse", out)
        return out

    chat = {"model": "a", "messages": USER}
    assert refused("POST", "/chat/completions", {**chat, "top_p": "x"}, 400)
    refused("POST", "/chat/completions", {**chat, "model": "nope"}, 404)
    refused("POST", "/completions", {"model": "a"}, 400)
    refused("POST", "/embeddings", {"model": "a", "input": "x"}, 400)  # not an embedding model
    refused("POST", "/responses", {"model": "a", "input": "x", "previous_response_id": "r"}, 400)
    refused("GET", "/models/nope", None, 404)
    refused("GET", "/nowhere", None, 404)
    refused("GET", "/chat/completions", None, 405)


# --- responses --------------------------------------------------------------------------------


def check_response_events(evs: list[dict[str, Any]]) -> None:
    found = []
    for i, ev in enumerate(evs):
        name = RESPONSE_EVENTS.get(ev["type"])
        if name is None:
            found.append(f"[{i}] an event type OpenAI does not define: {ev['type']!r}")
            continue
        found += [f"[{i}] {p}" for p in problems(name, ev)]
    assert not found, "\n".join(found)
    assert [ev["sequence_number"] for ev in evs] == list(range(len(evs)))


@pytest.mark.parametrize(
    "extra",
    [
        {"max_output_tokens": 6},
        {"max_output_tokens": 4, "instructions": "Be brief.", "user": "u1", "metadata": {"k": "v"}},
        {"tools": [RESP_WEATHER], "tool_choice": "required", "max_output_tokens": 200},
        {
            "tools": [RESP_WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 200,
        },
        {
            "text": {"format": {"type": "json_schema", "name": "w", "schema": PARAMETERS}},
            "max_output_tokens": 100,
        },
        {"model": "t", "tools": [RESP_WEATHER], "max_output_tokens": 30},
    ],
    ids=["text", "echoed", "required", "forced", "schema", "t-auto"],
)
def test_responses_whole_and_streamed(base: str, extra: dict[str, Any]) -> None:
    body = {"model": "a", "input": "What is the weather in Paris?", **extra}
    whole = post(base, "/responses", body)
    check("Response", whole)
    evs = events(base, "/responses", body)
    check_response_events(evs)
    assert evs[-1]["type"] in ("response.completed", "response.incomplete")
    assert [i["type"] for i in evs[-1]["response"]["output"]] == [
        i["type"] for i in whole["output"]
    ]
