"""Which JSON schemas the sampling grammar enforces (pure).

A JSON schema in ``response_format`` (or the parameters of a tool the answer is forced to call)
becomes a grammar through llama-cpp-python's converter. That converter looks at one branch of
keywords per schema node and ignores the rest: ``{"type": "integer", "minimum": 1}`` would
sample any integer, ``format: "email"`` any string, and a node it cannot read at all makes the
whole schema fall back to "any JSON". ``unsupported`` walks a schema the way the converter does
and names the first keyword it would not enforce, with its path, so the request is refused
(400) instead of answered with output the schema does not hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

#: Keywords that constrain nothing (they are allowed anywhere).
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "$schema",
        "$id",
        "$comment",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$defs",
        "definitions",
    }
)
PRIMITIVES = frozenset({"boolean", "number", "integer", "string", "null", "object", "array"})
STRING_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid3", "uuid4"})
_UUID = re.compile(r"^uuid[1-5]?$")
# Pattern syntax the converter copies into the grammar faithfully: literal characters,
# escaped punctuation, classes [...], groups (...), alternation and quantifiers. Look-arounds,
# non-capturing or named groups, backreferences and class escapes (\d, \w, \s, \b...) are not.
_PATTERN_BAD = (
    (re.compile(r"\(\?"), "groups with '(?' (look-arounds, non-capturing, named)"),
    (re.compile(r"\\[0-9A-Za-z]"), "escapes such as \\d, \\w, \\s, \\b or \\1"),
    (re.compile(r"[*+?}]\?"), "lazy quantifiers"),
    (re.compile(r"[*+?}][+]"), "possessive quantifiers"),
)


class Unsupported(ValueError):
    def __init__(self, path: str, feature: str) -> None:
        super().__init__(f"{feature} (at '{path}')")
        self.path = path
        self.feature = feature


def unsupported(schema: Any, path: str) -> Unsupported | None:
    """The first part of ``schema`` (at ``path``) the grammar would not enforce, or None."""
    try:
        _check(schema, path, schema, set())
    except Unsupported as e:
        return e
    return None


def _extra(node: dict[str, Any], path: str, allowed: frozenset[str] | set[str], why: str) -> None:
    for key in node:
        if key not in allowed and key not in ANNOTATIONS:
            raise Unsupported(f"{path}.{key}", f"'{key}' is not enforced {why}")


def _defs(node: dict[str, Any], path: str) -> Iterator[tuple[str, Any]]:
    for key in ("$defs", "definitions"):
        defs = node.get(key)
        if defs is None:
            continue
        if not isinstance(defs, dict):
            raise Unsupported(f"{path}.{key}", f"'{key}' must be an object")
        for name, sub in defs.items():
            yield f"{path}.{key}.{name}", sub


def _resolve(root: Any, ref: str, path: str) -> Any:
    if not ref.startswith("#/") and ref != "#":
        raise Unsupported(path, f"'$ref' to '{ref[:80]}' (only local '#/...' references)")
    target = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            raise Unsupported(path, f"'$ref' '{ref[:80]}' points at nothing")
        target = target[part]
    return target


def _check(node: Any, path: str, root: Any, refs: set[str]) -> None:
    # Depth is bounded by the request body's nesting (web.body); references are followed once.
    if not isinstance(node, dict):
        raise Unsupported(path, "a schema that is not an object (e.g. true/false)")
    for p, sub in _defs(node, path):
        _check(sub, p, root, refs)
    kind = node.get("type")
    fmt = node.get("format")
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str):
            raise Unsupported(f"{path}.$ref", "'$ref' must be a string")
        _extra(node, path, {"$ref"}, "beside '$ref'")
        target = _resolve(root, ref, f"{path}.$ref")
        if ref not in refs:
            refs.add(ref)
            _check(target, f"{path}.$ref", root, refs)
        return
    if "oneOf" in node or "anyOf" in node:
        if "oneOf" in node and "anyOf" in node:
            raise Unsupported(path, "'oneOf' and 'anyOf' in one schema")
        key = "oneOf" if "oneOf" in node else "anyOf"
        _extra(node, path, {key}, f"beside '{key}' (put it in each alternative)")
        alts = node[key]
        if not isinstance(alts, list) or not alts:
            raise Unsupported(f"{path}.{key}", f"'{key}' must be a non-empty array")
        for i, alt in enumerate(alts):
            _check(alt, f"{path}.{key}[{i}]", root, refs)
        return
    if isinstance(kind, list):
        _extra(node, path, {"type"}, "beside a list of types (use 'anyOf' instead)")
        for i, t in enumerate(kind):
            if t not in PRIMITIVES:
                raise Unsupported(f"{path}.type[{i}]", f"type {t!r}")
        return
    if "const" in node:
        _extra(node, path, {"const", "type"}, "beside 'const'")
        return
    if "enum" in node:
        _extra(node, path, {"enum", "type"}, "beside 'enum'")
        if not isinstance(node["enum"], list) or not node["enum"]:
            raise Unsupported(f"{path}.enum", "'enum' must be a non-empty array")
        return
    if kind is not None and kind not in PRIMITIVES:
        raise Unsupported(f"{path}.type", f"type {kind!r}")
    if kind in (None, "object") and (
        "properties" in node or node.get("additionalProperties", True) is not True
    ):
        _object(node, path, root, refs)
        return
    if kind in (None, "object") and "allOf" in node:
        _all_of(node, path, root, refs)
        return
    if kind in (None, "array") and ("items" in node or "prefixItems" in node):
        _array(node, path, root, refs)
        return
    if kind in (None, "string") and "pattern" in node:
        _extra(node, path, {"type", "pattern"}, "beside 'pattern'")
        _pattern(node["pattern"], f"{path}.pattern")
        return
    if (
        kind in (None, "string")
        and isinstance(fmt, str)
        and (_UUID.match(fmt) or fmt in STRING_FORMATS)
    ):
        _extra(node, path, {"type", "format"}, f"beside 'format': '{fmt}'")
        return
    if "format" in node:
        raise Unsupported(
            f"{path}.format",
            f"'format': {fmt!r} is not enforced (only {', '.join(sorted(STRING_FORMATS))})",
        )
    if kind == "string":
        _extra(node, path, {"type", "minLength", "maxLength"}, "on a string")
        return
    if kind is None:
        if not (set(node) - ANNOTATIONS):
            # The converter reads an empty schema as "an object", and one with only
            # annotations not at all (the whole schema would fall back to any JSON).
            if node:
                raise Unsupported(path, "a schema without 'type' (any value) is not enforced")
            return
        raise Unsupported(path, f"keywords {sorted(set(node) - ANNOTATIONS)} without a 'type'")
    _extra(node, path, {"type"}, f"on type '{kind}'")


def _object(node: dict[str, Any], path: str, root: Any, refs: set[str]) -> None:
    _extra(node, path, {"type", "properties", "required", "additionalProperties"}, "on an object")
    props = node.get("properties", {})
    if not isinstance(props, dict):
        raise Unsupported(f"{path}.properties", "'properties' must be an object")
    for name, sub in props.items():
        _check(sub, f"{path}.properties.{name}", root, refs)
    required = node.get("required", [])
    if not isinstance(required, list):
        raise Unsupported(f"{path}.required", "'required' must be an array")
    for i, name in enumerate(required):
        if name not in props:
            raise Unsupported(
                f"{path}.required[{i}]", f"required property {name!r} not in 'properties'"
            )
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        _check(extra, f"{path}.additionalProperties", root, refs)
    elif extra is not None and not isinstance(extra, bool):
        raise Unsupported(f"{path}.additionalProperties", "must be a boolean or a schema")


def _all_of(node: dict[str, Any], path: str, root: Any, refs: set[str]) -> None:
    # The converter merges the components' properties into one object and reads nothing else.
    _extra(node, path, {"type", "allOf"}, "beside 'allOf'")
    parts = node["allOf"]
    if not isinstance(parts, list) or not parts:
        raise Unsupported(f"{path}.allOf", "'allOf' must be a non-empty array")
    for i, part in enumerate(parts):
        p = f"{path}.allOf[{i}]"
        if isinstance(part, dict) and "$ref" in part:
            _extra(part, p, {"$ref"}, "beside '$ref'")
            part = _resolve(root, str(part["$ref"]), f"{p}.$ref")
        if not isinstance(part, dict) or "properties" not in part:
            raise Unsupported(p, "an 'allOf' part that is not an object with 'properties'")
        _extra(part, p, {"type", "properties", "required"}, "in an 'allOf' part")
        _object(part, p, root, refs)


def _array(node: dict[str, Any], path: str, root: Any, refs: set[str]) -> None:
    if "items" in node and "prefixItems" in node:
        raise Unsupported(path, "'items' beside 'prefixItems'")
    items = node.get("items", node.get("prefixItems"))
    if isinstance(items, list):
        _extra(node, path, {"type", "items", "prefixItems"}, "on a fixed list of items")
        for i, sub in enumerate(items):
            _check(sub, f"{path}.items[{i}]", root, refs)
        return
    _extra(node, path, {"type", "items", "minItems", "maxItems"}, "on an array")
    _check(items, f"{path}.items", root, refs)


def _pattern(pattern: Any, path: str) -> None:
    if not isinstance(pattern, str):
        raise Unsupported(path, "'pattern' must be a string")
    if not (pattern.startswith("^") and pattern.endswith("$")) or pattern.endswith("\\$"):
        raise Unsupported(path, "a 'pattern' not anchored with ^ and $")
    body = pattern[1:-1]
    for rx, what in _PATTERN_BAD:
        if rx.search(body):
            raise Unsupported(path, f"'pattern' {what}")
    if re.search(r"(?<!\[)\^|(?<!\\)\$", body):
        raise Unsupported(path, "'pattern' anchors inside the pattern")
