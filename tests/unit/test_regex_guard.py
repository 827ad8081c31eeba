"""Regex leaves run on RE2: what is refused (and where it is named), the program-size budget,
and the capped text a regex sees."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from residency.policies import (
    MAX_POLICY_REGEX_PROGRAM,
    REGEX_INPUT_CAP,
    ModelInfo,
    Policy,
    PolicyError,
    RoutingInput,
    evaluate,
    parse_policy,
)
from residency.policies import regex as rx

MODELS = {"small": ModelInfo("llm"), "big": ModelInfo("llm")}


def policy(*matches: dict[str, Any]) -> dict[str, Any]:
    rules = [{"id": f"r{i}", "match": m, "route_to": "big"} for i, m in enumerate(matches)]
    return {"candidates": ["small", "big"], "default": "small", "rules": rules}


def problems(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(PolicyError) as e:
        parse_policy("auto", data, MODELS)
    return e.value.problems


def routes(pattern: str, text: str) -> bool:
    p = parse_policy("auto", policy({"regex": pattern}), MODELS)
    return evaluate("auto", p, RoutingInput(text, False, False)).rule == "r0"


@pytest.mark.parametrize(
    "pattern",
    [
        r"(a)\1",  # backreference
        r"(?P<n>a)(?P=n)",  # named backreference
        r"(?=a)a",  # lookahead
        r"(?!a)b",  # negative lookahead
        r"(?<=a)b",  # lookbehind
        r"(?<!a)b",  # negative lookbehind
        r"(?>a+)b",  # atomic group
        r"a++b",  # possessive repeat
    ],
)
def test_what_re2_cannot_run_is_refused_naming_the_rule_path(pattern: str) -> None:
    found = problems(policy({"min_chars": 1}, {"any": [{"not": {"regex": pattern}}]}))
    assert list(found) == ["rules[1].match.any[0].not.regex"]
    assert "RE2" in found["rules[1].match.any[0].not.regex"]


def test_a_stored_policy_that_re2_refuses_does_not_parse() -> None:
    """Policies read back from Redis are re-validated by the model itself (no registry)."""
    with pytest.raises(ValidationError, match="RE2"):
        Policy.model_validate(policy({"regex": r"(?<=x)y"}))


@pytest.mark.parametrize(
    ("pattern", "text"), [("(x+)+y", "x"), ("(a|aa)*c", "a"), ("(.*a){12}z", "a")]
)
def test_patterns_that_backtrack_catastrophically_elsewhere_run_on_a_full_input(
    pattern: str, text: str
) -> None:
    """On a backtracking engine each of these takes exponential time on this text (a hang)."""
    assert not routes(pattern, text * REGEX_INPUT_CAP)
    assert routes(pattern, text * (REGEX_INPUT_CAP - 1) + pattern[-1])
    # The cap is a cap: the same match one byte further is not seen.
    assert not routes(pattern, text * REGEX_INPUT_CAP + pattern[-1])


def test_one_pattern_over_the_program_budget_is_refused() -> None:
    pattern = "[a-z]{1000}"
    assert rx.compiled(pattern).programsize > MAX_POLICY_REGEX_PROGRAM
    found = problems(policy({"regex": pattern}))
    assert "RE2 instructions" in found["rules[0].match.regex"]


def test_the_budget_is_for_all_regexes_of_a_policy_together() -> None:
    half = f"[a-z]{{{MAX_POLICY_REGEX_PROGRAM // 2}}}"
    size = rx.program_size(half)
    assert size <= MAX_POLICY_REGEX_PROGRAM < 2 * size
    parse_policy("auto", policy({"regex": half}, {"min_chars": 5}), MODELS)
    found = problems(policy({"regex": half}, {"all": [{"has_tools": True}, {"regex": half}]}))
    assert list(found) == ["rules[1].match.all[1].regex"]
    assert "together" in found["rules[1].match.all[1].regex"]


def test_the_subject_is_capped_at_a_character_boundary() -> None:
    text = "a" + "é" * REGEX_INPUT_CAP  # "é" is 2 bytes: the cap falls inside one
    got = rx.subject(text)
    assert len(got) == REGEX_INPUT_CAP - 1
    assert got.decode("utf-8") == text[: REGEX_INPUT_CAP // 2]
    assert rx.subject("short é") == "short é".encode()


def test_a_lone_surrogate_in_the_text_does_not_break_matching() -> None:
    assert routes("NEEDLE", "\ud800 NEEDLE")
    assert not routes("NEEDLE", "\udfff needle")


@pytest.mark.parametrize(
    ("pattern", "text", "hit"),
    [
        (r"\bSELECT\b", "run SELECT 1", True),
        (r"\bSELECT\b", "SELECTED", False),
        (r"(?i)select", "Select", True),
        ("é+", "café", True),
        (r"^\s*\d+\.", "  12. item", True),
        ("(?s)a.b", "a\nb", True),
        ("a.b", "a\nb", False),
    ],
)
def test_re2_syntax_matches_as_documented(pattern: str, text: str, hit: bool) -> None:
    assert routes(pattern, text) is hit
