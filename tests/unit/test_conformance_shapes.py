"""The answer-shaping pieces checked against the published shapes without a box: what a test
against real models cannot make happen at will (a Responses stream that fails, every error
status of the Anthropic API), and llama-cpp-python's chat shapes as ``workers.chat_shape``
gets them."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types.shared import ErrorResponse

from residency.errors import ApiError
from tests.fixtures.openai_schemas import RESPONSE_EVENTS, check
from web import anthropic
from web.responses_output import Events, Meta, from_chat
from workers import chat_shape

ECHO: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": None,
    "store": False,
    "temperature": None,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": None,
    "truncation": "disabled",
    "user": None,
}
META = Meta("resp_1", 1, "m")


@pytest.mark.parametrize(
    "error",
    [
        {"type": "server_error", "message": "boom", "code": "internal", "param": None},
        {"type": "rate_limit_error", "message": "slow down", "code": None, "param": None},
        {"type": "invalid_request_error", "message": "bad", "code": None, "param": "input"},
    ],
)
def test_a_failed_responses_stream_conforms(error: dict[str, Any]) -> None:
    ev = Events(META, ECHO)
    out = ev.start() + ev.feed({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    out += ev.fail(error)
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
    for e in out:
        check(RESPONSE_EVENTS[e["type"]], e)


def test_a_whole_response_cut_by_its_limit_conforms() -> None:
    chat = {
        "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    r = from_chat(chat, {**ECHO, "user": "u1"}, META)
    check("Response", r)
    assert r["status"] == "incomplete" and r["user"] == "u1"
    assert "user" not in from_chat(chat, ECHO, META)  # none named: left out, never null


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 409, 415, 422, 429, 500, 503, 504])
def test_every_anthropic_error_parses_as_the_sdks_error_response(status: int) -> None:
    body = anthropic.error_body(ApiError(status, "what went wrong"))
    parsed = ErrorResponse.model_validate(body)
    assert parsed.error.message == "what went wrong"


def test_a_request_too_large_keeps_anthropics_own_type() -> None:
    # Anthropic's API answers 413 with request_too_large, a type the SDK's ErrorResponse union
    # does not list (its client raises ContentTooLargeError by the status alone).
    assert anthropic.error_body(ApiError(413, "too big"))["error"]["type"] == "request_too_large"


def test_llama_cpp_chat_shapes_become_openais() -> None:
    # What llama-cpp-python's forced-tool stream sends after its first chunk.
    raw = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": None,
                "logprobs": None,
                "delta": {
                    "role": None,
                    "content": None,
                    "function_call": None,
                    "tool_calls": None,
                },
            }
        ],
    }
    check("CreateChatCompletionStreamResponse", chat_shape.chunk(raw))
    assert raw["choices"][0]["delta"] == {"content": None}
    whole = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": None,
                "message": {"role": "assistant", "content": "hi"},
            }
        ],
    }
    check("CreateChatCompletionResponse", chat_shape.answer(whole))
    assert whole["choices"][0]["message"]["refusal"] is None
