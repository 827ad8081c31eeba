"""The OpenAPI document (web/openapi.py): a valid OpenAPI 3.1 document, every route of the app
in it and nothing else, and its request fields cross-checked against the validators, so the
document cannot drift from what the box enforces without a test failing here."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from openapi_spec_validator import validate

from residency.box import Box
from residency.errors import ApiError
from residency.settings import key_meta
from web import anthropic, openapi, rerank, responses_request, validation
from web.app import create_app

Validator = Callable[[Mapping[str, Any]], validation.Validated]

USER = [{"role": "user", "content": "hi"}]
#: (fields, required, validator, a minimal valid body, a valid item for each array field)
CASES: dict[str, tuple[dict[str, Any], tuple[str, ...], Validator, dict[str, Any]]] = {
    "chat": (
        openapi.CHAT,
        openapi.CHAT_REQUIRED,
        validation.validate_chat,
        {"model": "m", "messages": USER},
    ),
    "completion": (
        openapi.COMPLETION,
        openapi.COMPLETION_REQUIRED,
        validation.validate_completion,
        {"model": "m", "prompt": "hi"},
    ),
    "embedding": (
        openapi.EMBEDDING,
        openapi.EMBEDDING_REQUIRED,
        validation.validate_embedding,
        {"model": "m", "input": "hi"},
    ),
    "rerank": (
        openapi.RERANK,
        openapi.RERANK_REQUIRED,
        rerank.validate_rerank,
        {"model": "m", "query": "q", "documents": ["d"]},
    ),
}
ITEMS: dict[str, Any] = {
    "messages": USER[0],
    "tools": {"type": "function", "function": {"name": "f"}},
    "input": "hi",
    "documents": "d",
}
#: One value of each JSON type, tried in this order as the wrong type for a field.
BY_TYPE: list[tuple[str, Any]] = [
    ("object", {}),
    ("array", []),
    ("boolean", True),
    ("string", "x"),
    ("number", 1.5),
]


def _types(schema: Mapping[str, Any]) -> set[str]:
    """The JSON types a schema allows (integer counts as number for 1.5: it is not one)."""
    if "oneOf" in schema:
        return set().union(*(_types(s) for s in schema["oneOf"]))
    t = schema.get("type")
    if t is None:
        const = schema.get("const")
        return {"string"} if isinstance(const, str) else set()
    return set(t) if isinstance(t, list) else {t}


def _refused(validate: Validator, body: dict[str, Any], field: str) -> ApiError:
    with pytest.raises(ApiError) as e:
        validate(body)
    assert e.value.status == 400
    assert e.value.param is not None
    assert re.match(rf"{re.escape(field)}($|[.\[])", e.value.param), (field, e.value.param)
    return e.value


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = openapi.document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)
    schemes = doc["components"]["securitySchemes"]
    assert schemes["bearer"]["scheme"] == "bearer"
    assert schemes["apiKey"] == {**schemes["apiKey"], "in": "header", "name": "x-api-key"}


def _app_routes(tmp_path: Path) -> set[tuple[str, str]]:
    app = create_app(Box(data_dir=tmp_path, config_path=None, redis_url="redis://127.0.0.1:1"))
    out = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.rule.endswith("/") or "<any(" in rule.rule:
            continue  # Flask's static route, /admin/ui/ (same page as /admin/ui), ui assets
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        for m in rule.methods or ():
            if m not in ("HEAD", "OPTIONS"):
                out.add((path, m.lower()))
    return out


def test_every_route_of_the_app_is_documented_and_nothing_else(tmp_path: Path) -> None:
    doc = openapi.document()
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert documented == _app_routes(tmp_path)


def test_errors_reference_one_envelope_per_api() -> None:
    doc = openapi.document()
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for status, resp in op["responses"].items():
                if int(status) < 400:
                    continue
                schema = resp["content"]["application/json"]["schema"]
                if path.startswith("/v1/messages"):
                    assert schema == {"$ref": "#/components/schemas/AnthropicError"}
                elif path.startswith("/api/"):
                    assert schema == {"$ref": "#/components/schemas/OllamaError"}
                elif path not in ("/readyz", "/health"):
                    assert schema == {"$ref": "#/components/schemas/Error"}, (path, status)


def test_admin_paths_need_the_bearer_and_ops_probes_none() -> None:
    paths = openapi.document()["paths"]
    for path, ops in paths.items():
        for op in ops.values():
            if path.startswith("/admin/") and not path.startswith("/admin/ui"):
                assert op["security"] == [{"bearer": []}]
            elif path.startswith("/v1/"):
                assert {"bearer": []} in op["security"] and {"apiKey": []} in op["security"]
    for path in ("/livez", "/readyz", "/openapi.json", "/admin/ui"):
        assert paths[path]["get"]["security"] == []


def test_the_settings_schema_names_every_key() -> None:
    schema = openapi.document()["components"]["schemas"]["SettingsSchema"]
    assert set(schema["properties"]["keys"]["properties"]) == set(key_meta())


# --- the request fields against the validators ------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_documented_fields_are_the_validators(case: str) -> None:
    fields, required, validate, valid = CASES[case]
    validate(valid)
    # An undocumented field is ignored (the document says additionalProperties: true).
    validate({**valid, "not_a_field": {"x": 1}})
    schema = openapi.SCHEMAS[
        {
            "chat": "ChatCompletionRequest",
            "completion": "CompletionRequest",
            "embedding": "EmbeddingRequest",
            "rerank": "RerankRequest",
        }[case]
    ]
    assert schema["additionalProperties"] is True
    assert schema["required"] == list(required)
    for field in required:
        body = {k: x for k, x in valid.items() if k != field}
        assert _refused(validate, body, field).code == "missing_required"
    checked = 0
    for field, fs in fields.items():
        if field in openapi.WEB_FIELDS:
            continue
        allowed = _types(fs)
        assert allowed, f"{case}.{field} has no type"
        wrong = next(x for t, x in BY_TYPE if t not in allowed)
        _refused(validate, {**valid, field: wrong}, field)
        for bound in _out_of_bounds(field, fs):
            _refused(validate, {**valid, field: bound}, field)
            checked += 1
        # The documented bounds themselves are accepted (the document is not stricter).
        for key in ("minimum", "maximum"):
            if key in fs:
                validate({**valid, field: fs[key]})
    assert checked >= len(fields) // 3, "too few bounds checked: is the table still read?"


def _out_of_bounds(field: str, fs: Mapping[str, Any]) -> list[Any]:
    """Values just outside what ``fs`` documents (bounds, allowed values, lengths)."""
    out: list[Any] = []
    integer = fs.get("type") == "integer"
    step = 1 if integer else 0.5
    if "minimum" in fs:
        out.append(fs["minimum"] - step)
    if "maximum" in fs:
        out.append(fs["maximum"] + step)
    if "enum" in fs:
        out.append(max(x for x in fs["enum"]) + 1 if integer else "not-one-of-them")
    for member in fs.get("oneOf", [fs]):
        if member.get("type") == "string" and "maxLength" in member:
            out.append("x" * (member["maxLength"] + 1))
        if member.get("type") == "string" and member.get("minLength"):
            out.append("")
        if member.get("type") == "array":
            if member.get("minItems"):
                out.append([])
            if "maxItems" in member and "items" in member:
                item = ITEMS.get(field, "x")
                out.append([item] * (member["maxItems"] + 1))
    return out


def test_the_translated_bodies_list_exactly_the_accepted_fields() -> None:
    schemas = openapi.document()["components"]["schemas"]
    pairs = [
        ("ResponseRequest", responses_request.FIELDS),
        ("MessageRequest", anthropic.MESSAGE_FIELDS),
        ("CountTokensRequest", anthropic.COUNT_FIELDS),
    ]
    for name, fields in pairs:
        assert set(schemas[name]["properties"]) == fields
        assert schemas[name]["additionalProperties"] is False
    # An undocumented field is refused by the translators, naming it.
    body = {"model": "m", "input": "hi", "not_a_field": 1}
    with pytest.raises(ApiError) as e:
        responses_request.to_chat(body)
    assert e.value.param == "not_a_field"
    msg = {"model": "m", "max_tokens": 4, "messages": USER, "not_a_field": 1}
    for count in (False, True):
        with pytest.raises(ApiError) as e:
            anthropic.to_chat(msg, count=count)
        assert e.value.status == 400 and "not_a_field" in e.value.message
