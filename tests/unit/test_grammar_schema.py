"""JSON schemas the sampling grammar would not enforce are refused with the feature and its path
(web.grammar_schema through web.validation); ``stream_options`` is validated."""

from __future__ import annotations

from typing import Any

import pytest

from residency.errors import ApiError
from web.validation import validate_chat, validate_completion

MSG = [{"role": "user", "content": "hi"}]


def chat_with_schema(schema: Any) -> dict[str, Any]:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return validate_chat({"model": "m", "messages": MSG, "response_format": rf}).params


def refused(schema: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat_with_schema(schema)
    assert e.value.status == 400
    assert e.value.code == "unsupported_schema"
    return e.value


ROOT = "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("schema", "path", "words"),
    [
        ({"type": "integer", "minimum": 1}, f"{ROOT}.minimum", "minimum"),
        ({"type": "string", "format": "email"}, f"{ROOT}.format", "email"),
        (
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "^\\d+$"}}},
            f"{ROOT}.properties.a.pattern",
            "\\d",
        ),
        ({"type": "string", "pattern": "abc"}, f"{ROOT}.pattern", "anchored"),
        ({"type": "string", "pattern": "^(?=a)b$"}, f"{ROOT}.pattern", "(?"),
        ({"$ref": "https://example.com/s.json"}, f"{ROOT}.$ref", "local"),
        ({"$ref": "#/$defs/missing"}, f"{ROOT}.$ref", "nothing"),
        (
            {"type": "object", "properties": {}, "patternProperties": {"^a$": {}}},
            f"{ROOT}.patternProperties",
            "patternProperties",
        ),
        ({"if": {"type": "string"}, "then": {"maxLength": 2}}, ROOT, "if"),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
            f"{ROOT}.required[0]",
            "'b'",
        ),
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, None, "unique"),
        ({"type": ["string", "null"], "maxLength": 3}, f"{ROOT}.maxLength", "anyOf"),
        ({"description": "anything"}, ROOT, "without 'type'"),
        ({"type": "object", "minProperties": 1}, f"{ROOT}.minProperties", "object"),
        (True, ROOT, "not an object"),
    ],
)
def test_features_the_grammar_ignores_are_named_with_their_path(
    schema: Any, path: str | None, words: str
) -> None:
    if not isinstance(schema, dict):
        # response_format needs an object at the top; the same check runs on tool parameters.
        schema = {"type": "object", "properties": {"a": schema}}
        path = f"{ROOT}.properties.a"
    err = refused(schema)
    if path is not None:
        assert err.param == path, err.message
    assert words in err.message


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 8},
                "kind": {"enum": ["a", "b"]},
                "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
                "when": {"type": "string", "format": "date"},
                "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
                "n": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
            },
            "required": ["name", "kind"],
            "additionalProperties": False,
            "$defs": {"tag": {"type": "string", "maxLength": 4}},
        },
        {"type": "object", "allOf": [{"properties": {"a": {"type": "boolean"}}}]},
        {"type": "array", "prefixItems": [{"type": "number"}, {"const": 1}]},
    ],
)
def test_schemas_the_grammar_enforces_pass(schema: dict[str, Any]) -> None:
    rf = chat_with_schema(schema)["response_format"]
    assert rf == {"type": "json_object", "schema": schema}


def test_a_forced_tools_parameters_are_checked_but_an_auto_tools_are_not() -> None:
    loose = {"type": "object", "properties": {"to": {"type": "string", "format": "email"}}}
    tools = [{"type": "function", "function": {"name": "mail", "parameters": loose}}]
    body = {"model": "m", "messages": MSG, "tools": tools}
    assert validate_chat(body).params["tools"] == tools
    for choice in ("required", {"type": "function", "function": {"name": "mail"}}):
        with pytest.raises(ApiError) as e:
            validate_chat({**body, "tool_choice": choice})
        assert e.value.param == "tools[0].function.parameters.properties.to.format"


# --- stream_options ---------------------------------------------------------------------------


@pytest.mark.parametrize("validate", [validate_chat, validate_completion])
def test_include_usage_travels_to_the_model_process(validate: Any) -> None:
    body = {"model": "m", "messages": MSG, "prompt": "x", "stream": True}
    v = validate({**body, "stream_options": {"include_usage": True}})
    assert v.params["stream_options"] == {"include_usage": True}
    v = validate({**body, "stream_options": {"include_usage": False}})
    assert "stream_options" not in v.params


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
    ],
)
def test_bad_stream_options_are_named(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        validate_chat({"model": "m", "messages": MSG, **extra})
    assert e.value.status == 400
    assert e.value.param == param
