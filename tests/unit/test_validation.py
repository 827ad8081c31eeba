"""OpenAI request validation (web.validation): every bad field is named, good bodies normalize."""

from __future__ import annotations

from typing import Any

import pytest

from residency.errors import ApiError
from web import validation
from web.faults import parse_faults
from web.validation import validate_chat, validate_completion, validate_embedding

USER = {"role": "user", "content": "hi"}
C0 = "messages[0].content"


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **kw}


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "once upon", **kw}


def embedding(**kw: Any) -> dict[str, Any]:
    return {"model": "e", "input": "hello", **kw}


BAD_CHAT: list[tuple[dict[str, Any], str]] = [
    ({"messages": [USER]}, "model"),
    (chat(model=3), "model"),
    (chat(model=""), "model"),
    ({"model": "m"}, "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[USER, {"role": "user", "content": 5}]), "messages[1].content"),
    (chat(messages=[USER, "hi"]), "messages[1]"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": []}]), "messages[0].content"),
    (
        chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
        "messages[0].content[0].type",
    ),
    (
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
        "messages[0].content[0].text",
    ),
    (
        chat(messages=[{"role": "tool", "content": "x", "tool_call_id": 4}]),
        "messages[0].tool_call_id",
    ),
    (chat(n=2), "n"),
    (chat(n="1"), "n"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=1.5), "max_tokens"),
    (chat(max_tokens="10"), "max_tokens"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(max_tokens=5, max_completion_tokens=6), "max_completion_tokens"),
    (chat(temperature=2.5), "temperature"),
    (chat(temperature=-0.1), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=True), "temperature"),
    (chat(top_p=1.5), "top_p"),
    (chat(top_k=-1), "top_k"),
    (chat(top_k=1.5), "top_k"),
    (chat(min_p=2), "min_p"),
    (chat(presence_penalty=3), "presence_penalty"),
    (chat(stop=5), "stop"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(stop=["a", 1]), "stop[1]"),
    (chat(stream="yes"), "stream"),
    (chat(stream=1), "stream"),
    (chat(seed="x"), "seed"),
    (chat(logit_bias={"abc": 1}), "logit_bias.abc"),
    (chat(logit_bias={"15": 500}), "logit_bias.15"),
    (chat(tools={"type": "function"}), "tools"),
    (chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
    (chat(tool_choice="sometimes"), "tool_choice"),
    (chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (chat(response_format={"type": "xml"}), "response_format.type"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema.schema"),
    (chat(response_format="json"), "response_format"),
    (chat(logprobs="yes"), "logprobs"),
    (chat(top_logprobs=50), "top_logprobs"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT)
def test_bad_chat_names_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as ei:
        validate_chat(body)
    assert ei.value.status == 400
    assert ei.value.param == param
    assert ei.value.type == "invalid_request_error"


BAD_COMPLETION: list[tuple[dict[str, Any], str]] = [
    ({"model": "m"}, "prompt"),
    (completion(prompt=5), "prompt"),
    (completion(prompt=["a", "b"]), "prompt"),
    (completion(prompt=[1, 2, 3]), "prompt"),
    (completion(n=3), "n"),
    (completion(best_of=2), "best_of"),
    (completion(suffix=1), "suffix"),
    (completion(echo="no"), "echo"),
    (completion(logprobs=10), "logprobs"),
    (completion(max_tokens=-4), "max_tokens"),
    (completion(temperature=9), "temperature"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETION)
def test_bad_completion_names_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as ei:
        validate_completion(body)
    assert (ei.value.status, ei.value.param) == (400, param)


BAD_EMBEDDING: list[tuple[dict[str, Any], str, str | None]] = [
    ({"model": "e"}, "input", None),
    (embedding(input=[]), "input", None),
    (embedding(input=""), "input", None),
    (embedding(input=["a", 3]), "input[1]", "unsupported"),
    (embedding(input=[[1, 2], [3]]), "input[0]", "unsupported"),
    (embedding(input=["a", None]), "input[1]", None),
    (embedding(input=7), "input", None),
    (embedding(encoding_format="hex"), "encoding_format", None),
    (embedding(dimensions=64), "dimensions", "unsupported"),
    (embedding(model=None), "model", None),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_EMBEDDING)
def test_bad_embedding_names_param(body: dict[str, Any], param: str, code: str | None) -> None:
    with pytest.raises(ApiError) as ei:
        validate_embedding(body)
    assert (ei.value.status, ei.value.param) == (400, param)
    if code:
        assert ei.value.code == code


def test_token_arrays_say_unsupported() -> None:
    with pytest.raises(ApiError, match="token arrays are not supported"):
        validate_embedding(embedding(input=[1, 2, 3]))


GOOD_CHAT: list[tuple[dict[str, Any], dict[str, Any], bool]] = [
    (chat(), {"messages": [USER]}, False),
    (chat(stream=True), {"messages": [USER]}, True),
    (chat(stream=None), {"messages": [USER]}, False),
    (
        # Fields OpenAI clients send that mean nothing here are ignored, not rejected.
        chat(
            user="u1",
            metadata={"a": "b"},
            parallel_tool_calls=False,
            store=False,
            n=1,
        ),
        {"messages": [USER]},
        False,
    ),
    (chat(max_completion_tokens=7), {"messages": [USER], "max_tokens": 7}, False),
    (chat(max_tokens=7, max_completion_tokens=7), {"messages": [USER], "max_tokens": 7}, False),
    (chat(max_tokens=None), {"messages": [USER]}, False),
    (chat(stop="END"), {"messages": [USER], "stop": ["END"]}, False),
    (
        chat(
            temperature=0,
            top_p=1,
            top_k=0,
            min_p=0.1,
            seed=42,
            presence_penalty=-2,
            frequency_penalty=1.5,
            repeat_penalty=1.1,
            logit_bias={"15": -100},
        ),
        {
            "messages": [USER],
            "temperature": 0,
            "top_p": 1,
            "top_k": 0,
            "min_p": 0.1,
            "seed": 42,
            "presence_penalty": -2,
            "frequency_penalty": 1.5,
            "repeat_penalty": 1.1,
            "logit_bias": {"15": -100.0},
        },
        False,
    ),
    (
        chat(messages=[{"role": "developer", "content": "be brief"}, USER]),
        {"messages": [{"role": "system", "content": "be brief"}, USER]},
        False,
    ),
    (
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        ),
        {"messages": [{"role": "user", "content": "a\nb"}]},
        False,
    ),
    (
        chat(messages=[{"role": "user", "content": "x", "refusal": None, "audio": {}}]),
        {"messages": [{"role": "user", "content": "x"}]},
        False,
    ),
    (
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            }
        ),
        {
            "messages": [USER],
            "response_format": {"type": "json_object", "schema": {"type": "object"}},
        },
        False,
    ),
    (chat(response_format={"type": "text"}), {"messages": [USER]}, False),
    (
        chat(response_format={"type": "json_object"}),
        {"messages": [USER], "response_format": {"type": "json_object"}},
        False,
    ),
    (
        chat(logprobs=True, top_logprobs=3),
        {"messages": [USER], "logprobs": True, "top_logprobs": 3},
        False,
    ),
]


@pytest.mark.parametrize(("body", "params", "stream"), GOOD_CHAT)
def test_good_chat_normalizes(body: dict[str, Any], params: dict[str, Any], stream: bool) -> None:
    v = validate_chat(body)
    assert v.model == "m"
    assert v.params == params
    assert v.stream is stream


def test_chat_tools_pass_through() -> None:
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    choice = {"type": "function", "function": {"name": "get"}}
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}
    msgs = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    v = validate_chat(chat(messages=msgs, tools=tools, tool_choice=choice))
    assert v.params["tools"] == tools
    assert v.params["tool_choice"] == choice
    assert v.params["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert v.params["messages"][2]["tool_call_id"] == "c1"


def test_image_parts_are_kept() -> None:
    parts = [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": "x"}}]
    v = validate_chat(chat(messages=[{"role": "user", "content": parts}]))
    assert v.params["messages"][0]["content"] == parts


GOOD_COMPLETION: list[tuple[dict[str, Any], dict[str, Any], bool]] = [
    (completion(), {"prompt": "once upon"}, False),
    (completion(prompt=["one"]), {"prompt": "one"}, False),
    (
        completion(max_tokens=3, stream=True, echo=True, suffix="!", logprobs=2, user="x"),
        {"prompt": "once upon", "max_tokens": 3, "echo": True, "suffix": "!", "logprobs": 2},
        True,
    ),
    (completion(stop=["\n", "."], best_of=1), {"prompt": "once upon", "stop": ["\n", "."]}, False),
]


@pytest.mark.parametrize(("body", "params", "stream"), GOOD_COMPLETION)
def test_good_completion(body: dict[str, Any], params: dict[str, Any], stream: bool) -> None:
    v = validate_completion(body)
    assert (v.params, v.stream) == (params, stream)


@pytest.mark.parametrize(
    ("inp", "expected", "fmt"),
    [
        ("hello", ["hello"], None),
        (["a", "b"], ["a", "b"], "float"),
        (["a"], ["a"], "base64"),
    ],
)
def test_good_embedding(inp: Any, expected: list[str], fmt: str | None) -> None:
    body = embedding(input=inp, user="u")
    if fmt:
        body["encoding_format"] = fmt
    v = validate_embedding(body)
    assert v.params == {"input": expected}
    assert v.stream is False
    assert v.options["encoding_format"] == (fmt or "float")


# --- POST /admin/faults bodies --------------------------------------------------------------


def test_faults_set_and_clear() -> None:
    put, drop = parse_faults(
        {
            "load_delay_s": {"a": 2, "b": 0},
            "fail_next_load": "a",
            "memory_pressure": 0.95,
            "hold": {"a": True, "b": False},
        }
    )
    assert put == {
        "load_delay_s:a": "2.0",
        "fail_next_load": "a",
        "memory_pressure": "0.95",
        "hold:a": "1",
    }
    assert sorted(drop) == ["hold:b", "load_delay_s:b"]
    assert parse_faults({"fail_next_load": None, "memory_pressure": 0}) == (
        {},
        ["fail_next_load", "memory_pressure"],
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"bogus": 1}, "bogus"),
        ({"memory_pressure": 1.5}, "memory_pressure"),
        ({"load_delay_s": {"a": -1}}, "load_delay_s.a"),
        ({"load_delay_s": 3}, "load_delay_s"),
        ({"hold": {"a": "yes"}}, "hold.a"),
        ({"hold": {"bad name!": True}}, "hold.bad name!"),
        ({"fail_next_load": 3}, "fail_next_load"),
    ],
)
def test_bad_faults(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as ei:
        parse_faults(body)
    assert (ei.value.status, ei.value.param) == (400, param)


# --- JSON schema caps -------------------------------------------------------------------------


BIG_BOUNDS = [
    {"type": "string", "pattern": "^a{" + "9" * 5000 + "}$"},
    {"type": "string", "pattern": "^a{2,257}$"},
    {"anyOf": [{"type": "array", "items": {"type": "integer"}, "maxItems": 1e9}]},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 257}}},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 524288}}},
]


@pytest.mark.parametrize("schema", BIG_BOUNDS)
def test_bounds_past_the_repeat_cap_are_accepted_where_a_grammar_is_built_or_not(
    schema: dict[str, Any],
) -> None:
    # The grammar drops them (residency.grammar_limits): no 400 for a client's plain limits.
    validation.check_schema("s", schema)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    validate_chat(chat(response_format=rf))
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "f"}}):
        validate_chat(chat(tools=[tool], **({"tool_choice": choice} if choice else {})))


def test_schema_at_the_caps_passes() -> None:
    validation.check_schema(
        "s",
        {
            "type": "object",
            "properties": {"a": {"type": "string", "pattern": "^[a-z]{1,256}$", "maxLength": 256}},
            "description": "x" * (validation.MAX_SCHEMA_BYTES - 200),
        },
    )


# --- what a schema's grammar costs ------------------------------------------------------------


def _pattern_schema(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}


NESTED_PATTERNS = [
    "^((a|b){0,100}){0,100}$",  # each repeat within the cap; together 10000
    "^(a{0,16}){0,17}$",  # just past: 272
    "^(((a{0,4}){0,4}){0,4}){0,5}$",  # four levels
    "^(x|(a{0,20}){0,20})$",  # inside an alternative
    "^(a{3,}){100}$",  # {n,}: n copies and a loop
    "^(a{200,999}){0,2}$",  # past the cap: {200,}, n copies and a loop (201 x 2)
]


@pytest.mark.parametrize("pattern", NESTED_PATTERNS)
def test_patterns_whose_nested_repeats_multiply_past_the_bound_are_refused_naming_the_field(
    pattern: str,
) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": _pattern_schema(pattern)}}
    with pytest.raises(ApiError) as e:
        validate_chat(chat(response_format=rf))
    param = "response_format.json_schema.schema.properties.s.pattern"
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "schema_too_large")
    assert "multiply" in e.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": _pattern_schema(pattern)}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(ApiError) as e:
            validate_chat(chat(tools=[tool], tool_choice=choice))
        assert e.value.param == "tools[0].function.parameters.properties.s.pattern"
    # With "auto" web cannot know whether a grammar is built (the model's template may take
    # tools): the model process drops such a pattern where it builds one.
    validate_chat(chat(tools=[tool]))
    validate_chat(chat(tools=[tool], tool_choice="auto"))


@pytest.mark.parametrize(
    "pattern",
    [
        "^a{0,256}$",
        "^[a-z]{1,64}@[a-z]{1,255}$",  # side by side: the largest counts, not the sum
        "^(a{0,16}){0,16}$",  # nested, at the bound
        "^((a{0,4}){0,4}){0,16}$",
        "^([0-9]{1,3}\\.){3}[0-9]{1,3}$",
        "^(ab|cd)*(x+)+[{]{2}$",  # loops are not written out
        "^[A-Z]{2}-[0-9]+$",
        "^a{,99999}$",  # past the cap: a loop
        "^(a{0,999}){0,200}$",
    ],
)
def test_flat_and_small_nested_patterns_pass(pattern: str) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": _pattern_schema(pattern)}}
    validate_chat(chat(response_format=rf))


def _tool(i: int, size: int) -> dict[str, Any]:
    props = {"note": {"type": "string", "description": "d" * size}}
    params = {"type": "object", "properties": props}
    return {"type": "function", "function": {"name": f"tool_{i}", "parameters": params}}


def test_the_union_of_tool_choice_required_is_bounded_like_one_schema() -> None:
    # 128 tools of ~1 KiB each: every one is small, their union (one grammar) is not.
    tools = [_tool(i, 1000) for i in range(validation.MAX_TOOLS)]
    with pytest.raises(ApiError) as e:
        validate_chat(chat(tools=tools, tool_choice="required"))
    assert (e.value.status, e.value.param, e.value.code) == (400, "tool_choice", "schema_too_large")
    assert f"{validation.MAX_SCHEMA_BYTES}" in e.value.message
    # The same tools without the union: no grammar over all of them is built.
    validate_chat(chat(tools=tools, tool_choice="auto"))
    named = {"type": "function", "function": {"name": "tool_3"}}
    validate_chat(chat(tools=tools, tool_choice=named))
    # A union within the bound passes: 128 small tools.
    validate_chat(chat(tools=[_tool(i, 100) for i in range(128)], tool_choice="required"))


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"modalities": "text"}, "modalities"),
    ],
)
def test_what_a_chat_cannot_serve_is_refused_by_name(extra: dict[str, Any], param: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(ApiError) as e:
        validate_chat(body)
    assert e.value.param == param


def test_text_modalities_and_unknown_fields_are_served() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    v = validate_chat({**body, "modalities": ["text"], "store": True, "frobnicate": 1})
    assert v.params == validate_chat(body).params
