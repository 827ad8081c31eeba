"""A schema as a grammar is built from it (residency.grammar_limits): bounds past the cap
dropped, patterns' repeats opened, costly patterns found (and dropped when loosened)."""

from __future__ import annotations

import pytest

from residency.grammar_limits import (
    MAX_PATTERN_NESTING,
    costly_patterns,
    pattern_nesting,
    unbounded,
    unbounded_pattern,
)


@pytest.mark.parametrize(
    ("pattern", "compiled"),
    [
        ("^a{0,256}$", "^a{0,256}$"),
        ("^a{2,257}$", "^a{2,}$"),
        ("^a{300,400}$", "^a{0,}$"),
        ("^a{300}$", "^a{0,}$"),
        ("^a{,99999}$", "^a{0,}$"),
        ("^a{" + "9" * 5000 + "}$", "^a{0,}$"),
        ("^[{]{999}\\{999}x{5}$", "^[{]{0,}\\{999}x{5}$"),  # a class or an escape is copied
    ],
)
def test_pattern_bounds_past_the_cap_are_opened(pattern: str, compiled: str) -> None:
    assert unbounded_pattern(pattern) == compiled


def test_counts_past_the_cap_are_dropped_and_data_and_names_are_left_alone() -> None:
    schema = {
        "type": "object",
        "properties": {
            "content": {"type": "string", "maxLength": 524288, "minLength": 1},
            "lines": {"type": "array", "items": {"type": "string"}, "maxItems": 1e9},
            "maxLength": {"type": "integer"},  # a property so named is not a bound
            "pattern": {"type": "string", "pattern": "^x{1000}$"},
        },
        "const": {"maxLength": 1000},
        "$defs": {"enum": {"enum": [{"maxItems": 9999}]}},
    }
    assert unbounded(schema) == {
        "type": "object",
        "properties": {
            "content": {"type": "string", "minLength": 1},
            "lines": {"type": "array", "items": {"type": "string"}},
            "maxLength": {"type": "integer"},
            "pattern": {"type": "string", "pattern": "^x{0,}$"},
        },
        "const": {"maxLength": 1000},
        "$defs": {"enum": {"enum": [{"maxItems": 9999}]}},
    }
    assert schema["properties"]["content"]["maxLength"] == 524288  # a copy


def test_costly_patterns_are_found_on_the_compiled_pattern_and_dropped_when_loosened() -> None:
    costly = "^((a|b){0,100}){0,100}$"
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "pattern": costly},
            "t": {"type": "string", "pattern": "^(a{0,9999}){0,100}$"},  # a loop, 100 times
        },
    }
    assert pattern_nesting(costly) > MAX_PATTERN_NESTING
    assert pattern_nesting("^(a{0,9999}){0,100}$") == 100
    assert list(costly_patterns(schema, "p")) == [("p.properties.s.pattern", costly)]
    assert unbounded(schema, loosen=True)["properties"] == {
        "s": {"type": "string"},
        "t": {"type": "string", "pattern": "^(a{0,}){0,100}$"},
    }
    assert unbounded(schema)["properties"]["s"]["pattern"] == costly
