"""Router policies that list equivalent candidates: lists in ``route_to``, ``default`` and the
LLM router's answer, ``choose`` / ``max_wait_s`` / ``evict_penalty_s``, and ``Decision.listed``.
A single name must behave exactly as before (``choose = "first"`` is today's routing)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from residency.policies import (
    Decision,
    Policy,
    PolicyError,
    RoutingInput,
    candidate_floor,
    evaluate,
    helper_models,
    parse_policy,
    router_decision,
    router_messages,
)
from tests.unit.test_policies import MODELS

CANDS = ["small", "big", "big-remote"]


def base(**kw: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"candidates": list(CANDS), "default": "small"}
    data.update(kw)
    return data


def rule(route_to: Any, rid: str = "r", match: Any = None) -> dict[str, Any]:
    return {"id": rid, "match": match or {"min_chars": 1}, "route_to": route_to}


def problems(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(PolicyError) as e:
        parse_policy("auto", data, MODELS)
    return e.value.problems


def inp(text: str = "", *, tools: bool = False, metadata: dict[str, str] | None = None) -> Any:
    return RoutingInput(text, tools, False, metadata or {})


# --------------------------------------------------------------------------------------------
# Parsing: a list wherever a candidate is named


def test_lists_parse_at_every_place() -> None:
    p = parse_policy(
        "auto",
        base(
            default=["small", "big-remote"],
            rules=[rule(["big", "big-remote", "small"]), rule("big", rid="s")],
        ),
        MODELS,
    )
    assert p.default_listed == ("small", "big-remote")
    assert p.rules[0].listed == ("big", "big-remote", "small")
    assert p.rules[1].route_to == "big" and p.rules[1].listed == ("big",)
    # What the web tier does per request (no registry): a stored spec round-trips.
    again = Policy.model_validate(p.model_dump())
    assert again == p


def test_string_forms_unchanged() -> None:
    p = parse_policy("auto", base(rules=[rule("big")]), MODELS)
    assert p.default == "small" and p.rules[0].route_to == "big"
    assert (p.choose, p.max_wait_s, p.evict_penalty_s) == ("first", 0.0, 10.0)


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        (
            base(rules=[rule("big"), rule(["small", "big", "x"], rid="s")]),
            "rules[1].route_to[2]",
            "'x' is not one of the candidates",
        ),
        (base(default=["judge"]), "default[0]", "'judge' is not one of the candidates"),
        (base(default="judge"), "default", "'judge' is not one of the candidates"),
        (base(rules=[rule(["big", "small", "big"])]), "rules[0].route_to[2]", "duplicate entry"),
        (base(default=["small", "small"]), "default[1]", "duplicate entry 'small'"),
        (base(rules=[rule([])]), "rules[0].route_to", "must not be empty"),
        (base(default=[]), "default", "must not be empty"),
        (base(rules=[rule(["big", 3])]), "rules[0].route_to[1]", "must be a candidate name"),
        (base(default=["small", ""]), "default[1]", "must be a candidate name"),
        (base(rules=[rule(3)]), "rules[0].route_to", "required: one of the candidates"),
        (base(rules=[rule("")]), "rules[0].route_to", "required: one of the candidates"),
        (base(default={"small": 1}), "default", "required: one of the candidates"),
    ],
)
def test_list_problem_paths(data: dict[str, Any], path: str, message: str) -> None:
    found = problems(data)
    assert message in found[path], found


def test_entry_problem_is_not_repeated_at_the_list() -> None:
    # Pydantic reports a bad entry of a union at the field ("route_to.list[str][1]"); the
    # entry's own path says it better, so the field itself is not reported too.
    found = problems(base(default=["small", 3], rules=[rule(["big", None])]))
    assert set(found) == {"default[1]", "rules[0].route_to[1]"}


def test_every_problem_at_once() -> None:
    found = problems(
        base(
            default=["small", "small"],
            rules=[rule(["nope"]), rule([], rid="e")],
            choose="fast",
            evict_penalty_s=-1,
        )
    )
    assert set(found) == {
        "default[1]",
        "rules[0].route_to[0]",
        "rules[1].route_to",
        "choose",
        "evict_penalty_s",
    }


def test_bad_shape_via_model_validate_is_one_message() -> None:
    # The web tier parses stored specs with Policy.model_validate, without parse_policy.
    with pytest.raises(ValueError) as e:
        Policy.model_validate(base(rules=[rule(["big", 3])]))
    assert "must be a candidate name or a non-empty list of them" in str(e.value)
    assert "list[str]" not in str(e.value)


# --------------------------------------------------------------------------------------------
# choose, max_wait_s, evict_penalty_s


def test_choice_fields_parse() -> None:
    p = parse_policy("auto", base(choose="fastest", max_wait_s=5, evict_penalty_s=2.5), MODELS)
    assert (p.choose, p.max_wait_s, p.evict_penalty_s) == ("fastest", 5.0, 2.5)
    p = parse_policy("auto", base(choose="first", max_wait_s=0, evict_penalty_s=0), MODELS)
    assert (p.choose, p.max_wait_s, p.evict_penalty_s) == ("first", 0.0, 0.0)


@pytest.mark.parametrize("bad", ["fast", "First", "", 1, None, ["first"]])
def test_choose_rejected(bad: Any) -> None:
    assert 'must be "first" or "fastest"' in problems(base(choose=bad))["choose"]


@pytest.mark.parametrize("key", ["max_wait_s", "evict_penalty_s"])
@pytest.mark.parametrize("bad", [-1, -0.5, True, False, "5", None, math.inf, math.nan, [1]])
def test_seconds_rejected(key: str, bad: Any) -> None:
    found = problems(base(choose="fastest", **{key: bad}))
    assert set(found) == {key}
    assert "must be a finite number of seconds >= 0" in found[key]


def test_max_wait_needs_fastest() -> None:
    assert problems(base(max_wait_s=5)) == {"max_wait_s": 'only used with choose = "fastest"'}
    assert "max_wait_s" in problems(base(choose="first", max_wait_s=0.1))
    parse_policy("auto", base(choose="fastest", max_wait_s=5), MODELS)
    parse_policy("auto", base(max_wait_s=0), MODELS)  # 0 = never: fine with first
    parse_policy("auto", base(evict_penalty_s=3), MODELS)  # has a default anyway


@pytest.mark.parametrize(
    "extra",
    [
        {"max_wait_s": "5", "choose": "fastest"},
        {"max_wait_s": True, "choose": "fastest"},
        {"evict_penalty_s": math.inf},
        {"max_wait_s": 5},
        {"choose": "fast"},
    ],
)
def test_choice_fields_checked_by_model_validate(extra: dict[str, Any]) -> None:
    # Live fields: the web tier's per-request parse must refuse what parse_policy refuses, not
    # coerce "5" or True into a number.
    with pytest.raises(ValueError):
        Policy.model_validate(base(**extra))


# --------------------------------------------------------------------------------------------
# Decisions carry what was listed


def test_evaluate_rule_list() -> None:
    p = parse_policy(
        "auto", base(rules=[rule(["big", "big-remote"], match={"min_chars": 5})]), MODELS
    )
    d = evaluate("auto", p, inp("hello world"))
    assert (d.candidate, d.rule, d.used_default, d.listed) == (
        "big",
        "r",
        False,
        ("big", "big-remote"),
    )
    assert d.trace["listed"] == ["big", "big-remote"] and d.trace["candidate"] == "big"
    json.dumps(d.trace)


def test_evaluate_default_list() -> None:
    p = parse_policy(
        "auto",
        base(default=["small", "big"], rules=[rule("big-remote", match={"min_chars": 99})]),
        MODELS,
    )
    d = evaluate("auto", p, inp("hi"))
    assert (d.candidate, d.rule, d.used_default, d.listed) == (
        "small",
        "default",
        True,
        ("small", "big"),
    )
    assert d.trace["listed"] == ["small", "big"]


def test_evaluate_single_name_lists_itself() -> None:
    d = evaluate("auto", parse_policy("auto", base(rules=[rule("big")]), MODELS), inp("x"))
    assert d.listed == ("big",) and d.trace["listed"] == ["big"]


def test_decision_built_the_old_way() -> None:
    d = Decision("big", "r", False, {})
    assert d.listed == ("big",)
    assert Decision("big", "r", False, {}, ("big", "small")).listed == ("big", "small")


ROUTER = {"type": "llm", "model": "judge", "prompt": "Pick one."}


def router_policy(**extra: Any) -> Policy:
    return parse_policy("auto", base(router=ROUTER, **extra), MODELS)


def test_router_messages_first_unchanged() -> None:
    content = router_messages("auto", router_policy(), inp("q"))[0]["content"]
    assert content == (
        "Pick one.\n\nAnswer with exactly one JSON object and nothing else, of the form "
        '{"model": <name>, "rationale": <reason>}. "model" must be exactly one of these names: '
        '"small", "big", "big-remote". "rationale" is a short, non-empty reason for the choice.'
    )


def test_router_messages_fastest_offers_a_list() -> None:
    content = router_messages("auto", router_policy(choose="fastest"), inp("q"))[0]["content"]
    assert '{"model": <name or list of names>, "rationale": <reason>}' in content
    assert "or, when several fit equally well, a list of them in preference order" in content


@pytest.mark.parametrize("choose", ["first", "fastest"])
def test_router_list_reply(choose: str) -> None:
    reply = '{"model": ["big-remote", "big"], "rationale": "either"}'
    d = router_decision("auto", router_policy(choose=choose), reply)
    assert (d.candidate, d.rule, d.used_default) == ("big-remote", "router", False)
    assert d.listed == ("big-remote", "big") and d.trace["listed"] == ["big-remote", "big"]


def test_router_name_reply_lists_itself() -> None:
    d = router_decision("auto", router_policy(), '{"model": "big", "rationale": "r"}')
    assert d.listed == ("big",) and d.trace["listed"] == ["big"]


@pytest.mark.parametrize(
    "model",
    [[], ["big", "big"], ["big", "huge"], ["big", 3], [["big"]], 3, None, {"big": 1}],
)
def test_router_bad_list_reply_uses_default(model: Any) -> None:
    reply = json.dumps({"model": model, "rationale": "r"})
    d = router_decision("auto", router_policy(default=["small", "big"]), reply)
    assert (d.candidate, d.rule, d.used_default) == ("small", "default", True)
    assert d.listed == ("small", "big") and d.trace["listed"] == ["small", "big"]
    assert d.trace["router"]["error"].startswith("bad reply")


# --------------------------------------------------------------------------------------------
# Floor and helpers: over the candidates, lists change nothing


def test_floor_and_helpers_unchanged_by_lists() -> None:
    plain = parse_policy("a", base(rules=[rule("big")]), MODELS)
    listed = parse_policy(
        "a", base(default=["small", "big"], rules=[rule(["big", "big-remote"])]), MODELS
    )
    assert candidate_floor({"a": listed}, MODELS) == candidate_floor({"a": plain}, MODELS)
    assert candidate_floor({"a": listed}, MODELS).candidates == {"small", "big"}
    routed = router_policy(choose="fastest", default=["big", "small"])
    assert helper_models({"a": listed, "r": routed}) == {"judge"}


# --------------------------------------------------------------------------------------------
# A one-element list is the name itself

WORDS = ["def", "class", "hello", "sql", "why"]
LOCAL = ["small", "big", "big-remote"]

leaf = st.one_of(
    st.builds(lambda ws: {"keywords_any": ws}, st.lists(st.sampled_from(WORDS), min_size=1)),
    st.builds(lambda n: {"min_chars": n}, st.integers(0, 30)),
    st.builds(lambda n: {"max_chars": n}, st.integers(0, 30)),
    st.builds(lambda b: {"has_tools": b}, st.booleans()),
    st.builds(lambda v: {"metadata": {"key": "tier", "equals": v}}, st.sampled_from("ab")),
)
match = st.recursive(
    leaf,
    lambda kids: st.one_of(
        st.builds(lambda c: {"any": c}, st.lists(kids, min_size=1, max_size=3)),
        st.builds(lambda c: {"all": c}, st.lists(kids, min_size=1, max_size=3)),
        st.builds(lambda c: {"not": c}, kids),
    ),
    max_leaves=6,
)
rules = st.lists(st.tuples(match, st.sampled_from(LOCAL)), min_size=0, max_size=5).map(
    lambda rs: [{"id": f"r{i}", "match": m, "route_to": t} for i, (m, t) in enumerate(rs)]
)
inputs = st.builds(
    inp,
    st.lists(st.sampled_from([*WORDS, "x", " "]), max_size=12).map("".join),
    tools=st.booleans(),
    metadata=st.sampled_from([{}, {"tier": "a"}, {"tier": "b"}]),
)


@settings(max_examples=300, deadline=None)
@given(rules=rules, default=st.sampled_from(LOCAL), i=inputs)
def test_one_element_lists_decide_the_same(
    rules: list[dict[str, Any]], default: str, i: RoutingInput
) -> None:
    plain = parse_policy("auto", base(default=default, rules=rules), MODELS)
    wrapped = parse_policy(
        "auto",
        base(default=[default], rules=[{**r, "route_to": [r["route_to"]]} for r in rules]),
        MODELS,
    )
    a, b = evaluate("auto", plain, i), evaluate("auto", wrapped, i)
    assert (a.candidate, a.rule, a.used_default) == (b.candidate, b.rule, b.used_default)
    assert a.listed == b.listed == (a.candidate,)
    assert a.trace == b.trace


def test_docs_table_matches_the_policy_defaults() -> None:
    # The settings-table test does not see policy keys; this keeps their doc rows in step.
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    rows = dict(
        re.findall(r"^\s*\| `(\w+)` \| `([^`]*)` \|", doc[doc.index("## Router policies") :], re.M)
    )
    for key in ("choose", "max_wait_s", "evict_penalty_s"):
        assert rows[key] == json.dumps(Policy.model_fields[key].default), key
