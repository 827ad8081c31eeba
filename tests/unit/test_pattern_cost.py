"""The repeat product of a JSON-schema pattern (residency.pattern_cost): nesting multiplies, side by
side parts and alternatives take the largest, loops count once."""

from __future__ import annotations

import pytest

from residency.pattern_cost import nesting


@pytest.mark.parametrize(
    ("body", "product"),
    [
        ("abc", 1),
        ("a{0,256}", 256),
        ("a{5}", 5),
        ("a{3,}", 4),
        ("a{,7}", 7),
        ("(a{0,16}){0,16}", 256),
        ("[a-z]{1,64}@[a-z]{1,255}", 255),
        ("(a|b{0,30})", 30),
        ("((a|b){0,10}c{0,3}){0,10}", 100),
        ("(a*)*", 1),
        ("(a+){4}", 4),
        ("[{]{3}x", 3),  # a brace inside a class is no quantifier
        ("\\{{5}", 5),  # an escaped brace is an atom
        ("a{x}", 1),  # not a quantifier: literal braces
        ("((a{0,4}", 4),  # unbalanced: what is there counts
    ],
)
def test_products(body: str, product: int) -> None:
    assert nesting(body, 10**6) == product


def test_the_walk_stops_past_the_cap() -> None:
    # 64 levels of {0,256}: a product with ~150 digits; reported as cap + 1.
    body = "(" * 64 + "a" + "){0,256}" * 64
    assert nesting(body, 256) == 257
    assert nesting("a{0," + "9" * 5000 + "}", 256) == 257
