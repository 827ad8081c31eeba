"""Ollama's requests and answers translated to chat completions and back (web/ollama.py)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from residency.errors import ApiError
from tests.fixtures.images import png
from web import ollama, validation

USER = [{"role": "user", "content": "hi"}]


def test_chat_maps_options_format_think_and_streams_by_default() -> None:
    req = ollama.to_chat(
        {
            "model": "m",
            "messages": USER,
            "format": "json",
            "think": True,
            "keep_alive": "10m",
            "options": {"num_predict": 5, "temperature": 0.2, "stop": ["x"], "num_ctx": 4096},
            "extra": 1,
        }
    )
    assert req.stream is True and req.chat["stream_options"] == {"include_usage": True}
    assert req.chat["max_tokens"] == 5 and req.chat["temperature"] == 0.2
    assert req.chat["stop"] == ["x"]
    assert req.chat["response_format"] == {"type": "json_object"}
    assert req.chat["reasoning_effort"] == "medium"
    assert req.ignored == ["extra", "options.num_ctx", "keep_alive"] and not req.unload
    validation.validate_chat(req.chat)  # what comes out is a valid chat request


@pytest.mark.parametrize(
    ("think", "effort"), [(False, "none"), (True, "medium"), ("low", "low"), ("high", "high")]
)
def test_think_becomes_a_reasoning_effort(think: Any, effort: str) -> None:
    req = ollama.to_chat({"model": "m", "messages": USER, "think": think, "stream": False})
    assert req.chat["reasoning_effort"] == effort and "stream" not in req.chat


def test_a_schema_format_and_an_unlimited_num_predict() -> None:
    schema = {"type": "object"}
    req = ollama.to_chat(
        {"model": "m", "messages": USER, "format": schema, "options": {"num_predict": -1}}
    )
    assert req.chat["response_format"] == {"type": "json_object", "schema": schema}
    assert "max_tokens" not in req.chat


@pytest.mark.parametrize("value", [0, "0", "0s", "0m", 0.0])
def test_keep_alive_zero_asks_for_an_unload(value: Any) -> None:
    req = ollama.to_chat({"model": "m", "messages": USER, "keep_alive": value})
    assert req.unload and "keep_alive" not in req.ignored


def test_tool_calls_and_results_get_ids_and_string_arguments() -> None:
    msgs = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "f", "arguments": {"a": 1}}},
                {"function": {"name": "g", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "G", "tool_name": "g"},
        {"role": "tool", "content": "F"},
    ]
    chat = ollama.to_chat({"model": "m", "messages": msgs}).chat
    calls = chat["messages"][1]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {}]
    assert chat["messages"][2]["tool_call_id"] == calls[1]["id"]
    assert chat["messages"][3]["tool_call_id"] == calls[0]["id"]
    validation.validate_chat(chat)


def test_images_become_data_urls_of_their_own_type() -> None:
    b64 = base64.b64encode(png(4, 4)).decode()
    chat = ollama.to_chat(
        {"model": "m", "messages": [{"role": "user", "content": "see", "images": [b64]}]}
    ).chat
    parts = chat["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "see"}
    assert parts[1]["image_url"]["url"] == f"data:image/png;base64,{b64}"
    with pytest.raises(ApiError) as e:
        ollama.to_chat({"model": "m", "messages": [{"role": "user", "images": ["!!"]}]})
    assert e.value.param == "messages[0].images[0]"


def test_generate_is_a_chat_or_raw_a_completion_and_refuses_what_does_not_map() -> None:
    req = ollama.generate_to_chat({"model": "m", "prompt": "p", "system": "s", "stream": False})
    assert req.chat["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "p"},
    ]
    raw = ollama.generate_to_chat({"model": "m", "prompt": "p", "raw": True})
    assert raw.raw and raw.chat["prompt"] == "p"
    validation.validate_completion(raw.chat)
    for field, value in (("suffix", "x"), ("template", "t"), ("context", [1])):
        with pytest.raises(ApiError) as e:
            ollama.generate_to_chat({"model": "m", "prompt": "p", field: value})
        assert e.value.param == field and e.value.status == 400
    assert ollama.generate_to_chat({"model": "m"}).empty
    with pytest.raises(ApiError) as e:
        ollama.generate_to_chat({"model": "m", "prompt": "p", "raw": True, "images": ["iVBORw=="]})
    assert e.value.param == "images"


def test_chat_errors_name_the_ollama_field() -> None:
    req = ollama.to_chat({"model": "m", "messages": USER, "options": {"temperature": 9}})
    with pytest.raises(ApiError) as e:
        validation.validate_chat(req.chat)
    renamed = ollama.renamed(e.value)
    assert renamed.param == "options.temperature" and "'options.temperature'" in renamed.message


def _answer(**msg: Any) -> dict[str, Any]:
    return {
        "choices": [{"message": {"role": "assistant", **msg}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
        "timings": {"queue_ms": 1.5, "prompt_ms": 2, "predicted_ms": 3},
    }


def test_a_whole_answer_in_ollamas_shape() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    out = ollama.chat_answer(
        _answer(content=None, reasoning_content="hm", tool_calls=[call]), "m", 99
    )
    assert out["message"]["tool_calls"] == [
        {"function": {"index": 0, "name": "f", "arguments": {"a": 1}}}
    ]
    assert out["message"]["thinking"] == "hm" and out["message"]["content"] == ""
    assert out["done"] is True and out["done_reason"] == "stop"
    assert (out["total_duration"], out["load_duration"]) == (99, 1_500_000)
    assert (out["prompt_eval_count"], out["prompt_eval_duration"]) == (3, 2_000_000)
    assert (out["eval_count"], out["eval_duration"]) == (4, 3_000_000)


def _chunks(pieces: list[tuple[str, str]], call: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for kind, text in pieces:
        out.append({"choices": [{"delta": {kind: text}, "finish_reason": None}]})
    if call is not None:
        for i in range(0, len(call), 3):
            piece: dict[str, Any] = {"index": 0, "function": {"arguments": call[i : i + 3]}}
            if i == 0:
                piece["function"]["name"] = "f"
            out.append({"choices": [{"delta": {"tool_calls": [piece]}}]})
    out.append({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    out.append({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})
    return out


pieces = st.lists(
    st.tuples(st.sampled_from(["content", "reasoning_content"]), st.text(max_size=8)), max_size=12
)


@given(pieces, st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.integers())))
def test_a_stream_reassembles_to_the_answer(
    parts: list[tuple[str, str]], args: dict[str, int] | None
) -> None:
    lines = ollama.Lines("m", False, 0)
    call = None if args is None else json.dumps(args)
    objs = [o for c in _chunks(parts, call) for o in lines.feed(c)] + lines.end(10)
    decoded = [json.loads(ollama.line(o)) for o in objs]
    assert [o["done"] for o in decoded] == [False] * (len(decoded) - 1) + [True]
    text = "".join(o["message"]["content"] for o in decoded)
    thought = "".join(o["message"].get("thinking", "") for o in decoded)
    assert text == "".join(t for k, t in parts if k == "content")
    assert thought == "".join(t for k, t in parts if k == "reasoning_content")
    calls = [c for o in decoded for c in o["message"].get("tool_calls", [])]
    if args is None:
        assert calls == []
    else:
        assert calls == [{"function": {"index": 0, "name": "f", "arguments": args}}]
    last = decoded[-1]
    assert (last["eval_count"], last["prompt_eval_count"], last["total_duration"]) == (2, 1, 10)


def test_a_generate_stream_writes_response_pieces() -> None:
    lines = ollama.Lines("m", True, 0)
    objs = lines.feed({"choices": [{"text": "ab", "finish_reason": "length"}]}) + lines.end(5)
    assert [o["response"] for o in objs] == ["ab", ""]
    assert objs[-1]["done_reason"] == "length"


def test_an_assistant_message_carries_a_bounded_number_of_calls() -> None:
    # Each tool message looks its call up among the last message's: the count bounds that work.
    calls = [{"function": {"name": "f", "arguments": {}}}] * (ollama.MAX_CALLS + 1)
    msgs = [*USER, {"role": "assistant", "content": "", "tool_calls": calls}]
    with pytest.raises(ApiError) as e:
        ollama.to_chat({"model": "m", "messages": msgs})
    assert e.value.param == "messages[1].tool_calls"
    ollama.to_chat({"model": "m", "messages": [*USER, {**msgs[1], "tool_calls": calls[:-1]}]})
