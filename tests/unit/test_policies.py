"""Router policies: validation paths, the match language, decisions, helper replies, the floor."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from residency import policies as pol
from residency.policies import (
    Classifier,
    ModelInfo,
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

MODELS: dict[str, ModelInfo] = {
    "small": ModelInfo("llm"),
    "big": ModelInfo("llm"),
    "big-remote": ModelInfo("llm", remote=True),
    "judge": ModelInfo("llm"),
    "embed": ModelInfo("embedding"),
}


def inp(
    text: str = "",
    *,
    tools: bool = False,
    images: bool = False,
    metadata: dict[str, str] | None = None,
) -> RoutingInput:
    return RoutingInput(text, tools, images, metadata or {})


def rules_policy(*rules: dict[str, Any], **extra: Any) -> Policy:
    data: dict[str, Any] = {
        "candidates": ["small", "big"],
        "default": "small",
        "rules": list(rules),
    }
    data.update(extra)
    return parse_policy("auto", data, MODELS)


def matches(match: dict[str, Any], i: RoutingInput, **extra: Any) -> bool:
    """Whether one rule with this match tree routes ``i`` to its target."""
    p = rules_policy({"id": "r", "match": match, "route_to": "big"}, **extra)
    return evaluate("auto", p, i).rule == "r"


def problems(data: dict[str, Any], name: str = "auto") -> dict[str, str]:
    with pytest.raises(PolicyError) as e:
        parse_policy(name, data, MODELS)
    return e.value.problems


def base(**kw: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"candidates": ["small", "big"], "default": "small"}
    data.update(kw)
    return data


def one_rule(match: Any, classifiers: Any = None, **rule: Any) -> dict[str, Any]:
    extra = {} if classifiers is None else {"classifiers": classifiers}
    return base(rules=[{"id": "r", "match": match, "route_to": "big", **rule}], **extra)


TOPIC = {"topic": {"model": "judge", "labels": ["code", "chat"]}}

# --------------------------------------------------------------------------------------------
# Leaves and combinators


@pytest.mark.parametrize(
    ("match", "text", "expected"),
    [
        ({"keywords_any": ["def ", "class "]}, "please def f(): pass", True),
        ({"keywords_any": ["def ", "class "]}, "nothing here", False),
        ({"keywords_all": ["alpha", "beta"]}, "beta then alpha", True),
        ({"keywords_all": ["alpha", "beta"]}, "only alpha", False),
        ({"keywords_any": ["HELLO"]}, "well hello there", True),
        ({"keywords_any": ["hello"]}, "HELLO!", True),
        # ASCII-only folding: non-ASCII letters compare exactly.
        ({"keywords_any": ["É"]}, "é", False),
        ({"keywords_any": ["é"]}, "Café", True),
        ({"keywords_any": ["ÉTÉ"]}, "ÉtÉ", True),  # the ASCII T folds, the É compare exactly
        ({"regex": "```"}, "see ```py\nx\n```", True),
        ({"regex": r"\bSELECT\b"}, "select * from t", False),  # regex is case-sensitive
        ({"regex": r"\bSELECT\b"}, "SELECT * FROM t", True),
        ({"regex": "(ab)+c"}, "xxababc", True),
    ],
)
def test_text_leaves(match: dict[str, Any], text: str, expected: bool) -> None:
    assert matches(match, inp(text)) is expected


@pytest.mark.parametrize(
    ("match", "text", "expected"),
    [
        ({"min_chars": 2}, "é", True),  # "é" is 2 bytes, 1 character
        ({"min_chars": 3}, "é", False),
        ({"max_chars": 1}, "é", False),
        ({"max_chars": 2}, "é", True),
        ({"min_chars": 6}, "日本", True),  # 6 bytes, 2 characters
        ({"min_chars": 7}, "日本", False),
        ({"max_chars": 6}, "日本", True),
        ({"max_chars": 5}, "日本", False),
        ({"min_chars": 0}, "", True),
        ({"max_chars": 0}, "", True),
        ({"min_chars": 3, "max_chars": 6}, "日本", True),  # several keys mean all
        ({"min_chars": 3, "max_chars": 5}, "日本", False),
    ],
)
def test_byte_length_leaves(match: dict[str, Any], text: str, expected: bool) -> None:
    assert matches(match, inp(text)) is expected


def test_byte_length_property() -> None:
    assert inp("é").byte_length == 2
    assert inp("日本").byte_length == 6
    assert inp("abc").byte_length == 3


@pytest.mark.parametrize(
    ("match", "i", "expected"),
    [
        ({"has_tools": True}, inp(tools=True), True),
        ({"has_tools": True}, inp(), False),
        ({"has_tools": False}, inp(), True),
        ({"has_images": True}, inp(images=True), True),
        ({"has_images": True}, inp(), False),
        ({"has_images": False}, inp(images=True), False),
    ],
)
def test_flag_leaves(match: dict[str, Any], i: RoutingInput, expected: bool) -> None:
    assert matches(match, i) is expected


@pytest.mark.parametrize(
    ("leaf", "md", "expected"),
    [
        ({"key": "tier", "equals": "pro"}, {"tier": "pro"}, True),
        ({"key": "tier", "equals": "pro"}, {"tier": "Pro"}, False),
        ({"key": "tier", "equals": "pro"}, {}, False),
        ({"key": "tier", "any": ["pro", "team"]}, {"tier": "team"}, True),
        ({"key": "tier", "any": ["pro", "team"]}, {"tier": "free"}, False),
        ({"key": "tier", "exists": True}, {"tier": "x"}, True),
        ({"key": "tier", "exists": True}, {}, False),
        ({"key": "tier", "exists": False}, {}, True),
        ({"key": "tier", "exists": False}, {"tier": "x"}, False),
    ],
)
def test_metadata_leaf(leaf: dict[str, Any], md: dict[str, str], expected: bool) -> None:
    assert matches({"metadata": leaf}, inp(metadata=md)) is expected


@pytest.mark.parametrize(
    ("match", "text", "expected"),
    [
        ({"any": [{"keywords_any": ["x"]}, {"keywords_any": ["y"]}]}, "y", True),
        ({"any": [{"keywords_any": ["x"]}, {"keywords_any": ["y"]}]}, "z", False),
        ({"all": [{"keywords_any": ["x"]}, {"keywords_any": ["y"]}]}, "xy", True),
        ({"all": [{"keywords_any": ["x"]}, {"keywords_any": ["y"]}]}, "x", False),
        ({"not": {"keywords_any": ["x"]}}, "y", True),
        ({"not": {"keywords_any": ["x"]}}, "x", False),
    ],
)
def test_combinators(match: dict[str, Any], text: str, expected: bool) -> None:
    assert matches(match, inp(text)) is expected


NESTED = {
    "all": [
        {"any": [{"keywords_any": ["sql"]}, {"regex": r"SELECT\s"}]},
        {"not": {"any": [{"has_tools": True}, {"max_chars": 3}]}},
    ]
}


@pytest.mark.parametrize(
    ("i", "expected"),
    [
        (inp("write SELECT x"), True),
        (inp("an SQL question"), True),
        (inp("an SQL question", tools=True), False),
        (inp("sql"), False),  # too short: max_chars 3 is true, so the not is false
        (inp("hello world"), False),
    ],
)
def test_nested_tree(i: RoutingInput, expected: bool) -> None:
    assert matches(NESTED, i) is expected


# --------------------------------------------------------------------------------------------
# Rule order, default, trace


def test_first_match_wins_and_trace() -> None:
    p = rules_policy(
        {"id": "long", "match": {"min_chars": 5}, "route_to": "big"},
        {"id": "short-code", "match": {"keywords_any": ["def"]}, "route_to": "small"},
    )
    d = evaluate("auto", p, inp("def f(): pass"))
    assert (d.candidate, d.rule, d.used_default) == ("big", "long", False)
    assert [r["id"] for r in d.trace["rules"]] == ["long"]  # later rules are not evaluated
    cond = d.trace["rules"][0]["conditions"][0]
    assert cond["path"] == "match.min_chars" and cond["result"] is True
    assert cond["value"] == 13
    json.dumps(d.trace)  # JSON-able


def test_no_match_uses_default_and_records_every_rule() -> None:
    p = rules_policy(
        {"id": "a", "match": {"keywords_any": ["zzz"]}, "route_to": "big"},
        {"id": "b", "match": {"has_tools": True}, "route_to": "big"},
    )
    d = evaluate("auto", p, inp("hi"))
    assert (d.candidate, d.rule, d.used_default) == ("small", "default", True)
    assert d.trace["policy"] == "auto" and d.trace["candidate"] == "small"
    assert [(r["id"], r["matched"]) for r in d.trace["rules"]] == [("a", False), ("b", False)]
    assert d.trace["errors"] == []


def test_policy_without_rules_always_defaults() -> None:
    p = parse_policy("auto", base(), MODELS)
    assert evaluate("auto", p, inp("x")).rule == "default"


def test_trace_records_nested_paths() -> None:
    p = rules_policy({"id": "r", "match": NESTED, "route_to": "big"})
    d = evaluate("auto", p, inp("an SQL question"))
    paths = [c["path"] for c in d.trace["rules"][0]["conditions"]]
    assert paths == [
        "match.all[0].any[0].keywords_any",
        "match.all[1].not.any[0].has_tools",
        "match.all[1].not.any[1].max_chars",
    ]


def test_evaluate_refuses_router_policy() -> None:
    p = parse_policy("auto", base(router={"type": "llm", "model": "judge", "prompt": "p"}), MODELS)
    with pytest.raises(ValueError):
        evaluate("auto", p, inp("x"))


def test_regex_input_is_capped() -> None:
    p = rules_policy({"id": "r", "match": {"regex": "NEEDLE"}, "route_to": "big"})
    far = "a" * pol.REGEX_INPUT_CAP + "NEEDLE"
    near = "é" * (pol.REGEX_INPUT_CAP // 2 - 3) + "NEEDLE"  # ends exactly at the cap
    assert evaluate("auto", p, inp(far)).rule == "default"
    assert evaluate("auto", p, inp(near)).rule == "r"


# --------------------------------------------------------------------------------------------
# Classifier leaves


class FakeClassifier:
    def __init__(self, scores: Mapping[str, Any] | Exception) -> None:
        self.scores = scores
        self.calls: list[tuple[str, str]] = []

    def __call__(self, cid: str, text: str) -> Mapping[str, float]:
        self.calls.append((cid, text))
        if isinstance(self.scores, Exception):
            raise self.scores
        return self.scores


def clf_policy(*leaves: dict[str, Any]) -> Policy:
    rules = [
        {"id": f"r{i}", "match": {"classifier": leaf}, "route_to": "big"}
        for i, leaf in enumerate(leaves)
    ]
    return parse_policy("auto", base(rules=rules, classifiers=TOPIC), MODELS)


@pytest.mark.parametrize(
    ("leaf", "score", "expected"),
    [
        ({"id": "topic", "label": "code"}, 0.5, True),  # no bounds: min_score 0.5, inclusive
        ({"id": "topic", "label": "code"}, 0.49, False),
        ({"id": "topic", "label": "code", "min_score": 0.8}, 0.8, True),
        ({"id": "topic", "label": "code", "min_score": 0.8}, 0.79, False),
        ({"id": "topic", "label": "code", "max_score": 0.2}, 0.2, True),
        ({"id": "topic", "label": "code", "max_score": 0.2}, 0.0, True),  # max only: min 0
        ({"id": "topic", "label": "code", "max_score": 0.2}, 0.21, False),
        ({"id": "topic", "label": "code", "min_score": 0.3, "max_score": 0.3}, 0.3, True),
    ],
)
def test_classifier_bounds(leaf: dict[str, Any], score: float, expected: bool) -> None:
    fake = FakeClassifier({"code": score, "chat": 1 - score})
    d = evaluate("auto", clf_policy(leaf), inp("q"), fake)
    assert (d.rule == "r0") is expected
    assert d.trace["errors"] == []


def test_classifier_called_once_per_id() -> None:
    fake = FakeClassifier({"code": 0.1, "chat": 0.9})
    p = clf_policy({"id": "topic", "label": "code"}, {"id": "topic", "label": "chat"})
    d = evaluate("auto", p, inp("hello"), fake)
    assert d.rule == "r1"
    assert fake.calls == [("topic", "hello")]


@pytest.mark.parametrize(
    "behaviour",
    [RuntimeError("helper down"), {"chat": 0.9}, {"code": "high", "chat": 0.1}, {"code": True}],
    ids=["raises", "missing-label", "not-a-number", "bool"],
)
def test_classifier_failure_is_false_with_error(behaviour: Any) -> None:
    fake = FakeClassifier(behaviour)
    p = clf_policy({"id": "topic", "label": "code", "max_score": 1.0})
    d = evaluate("auto", p, inp("x"), fake)
    assert (d.candidate, d.rule, d.used_default) == ("small", "default", True)
    assert len(d.trace["errors"]) == 1 and d.trace["errors"][0]["classifier"] == "topic"
    json.dumps(d.trace)


def test_classifier_failure_is_recorded_once_and_not_retried() -> None:
    fake = FakeClassifier(RuntimeError("boom"))
    p = clf_policy({"id": "topic", "label": "code"}, {"id": "topic", "label": "chat"})
    d = evaluate("auto", p, inp("x"), fake)
    assert len(fake.calls) == 1
    assert len(d.trace["errors"]) == 1 and "boom" in d.trace["errors"][0]["error"]


def test_classifier_without_classify_is_false_with_error() -> None:
    d = evaluate("auto", clf_policy({"id": "topic", "label": "code"}), inp("x"))
    assert d.used_default and d.trace["errors"]


def test_not_of_failed_classifier_matches() -> None:
    # match_false applies to the leaf; a "not" above it sees false and matches, as documented.
    p = parse_policy(
        "auto",
        base(
            rules=[
                {
                    "id": "r",
                    "match": {"not": {"classifier": {"id": "topic", "label": "code"}}},
                    "route_to": "big",
                }
            ],
            classifiers=TOPIC,
        ),
        MODELS,
    )
    assert evaluate("auto", p, inp("x"), FakeClassifier(RuntimeError())).rule == "r"


# --------------------------------------------------------------------------------------------
# Validation errors name their path


@pytest.mark.parametrize(
    ("data", "path", "fragment"),
    [
        (base(candidates=["small", "small"]), "candidates[1]", "duplicate candidate 'small'"),
        (base(candidates=[]), "candidates", "empty"),
        (base(default="big-remote"), "default", "not one of the candidates"),
        (base(candidates=["small", "nope"]), "candidates[1]", "not a registered model"),
        (base(candidates=["small", "embed"]), "candidates[1]", "embedding"),
        (one_rule({"min_chars": 1}, route_to="judge"), "rules[0].route_to", "not one of"),
        (one_rule({"min_chars": 1}, id="bad id!"), "rules[0].id", "must match"),
        (one_rule({"min_chars": 1}, id="default"), "rules[0].id", "reserved"),
        (one_rule({"regex": "("}), "rules[0].match.regex", "does not compile"),
        (one_rule({"regex": ""}), "rules[0].match.regex", "non-empty"),
        (one_rule({"keywords_any": []}), "rules[0].match.keywords_any", "non-empty"),
        (one_rule({"keywords_all": ["a", ""]}), "rules[0].match.keywords_all[1]", "non-empty"),
        (one_rule({"min_chars": -1}), "rules[0].match.min_chars", ">= 0"),
        (one_rule({"max_chars": True}), "rules[0].match.max_chars", ">= 0"),
        (one_rule({"has_tools": "yes"}), "rules[0].match.has_tools", "true or false"),
        (one_rule({"any": []}), "rules[0].match.any", "non-empty"),
        (one_rule({"not": [{"has_tools": True}]}), "rules[0].match.not", "match object"),
        (one_rule({}), "rules[0].match", "empty"),
        (one_rule({"keyword_any": ["x"]}), "rules[0].match.keyword_any", "unknown match key"),
        (one_rule({"any": [{"bogus": 1}]}), "rules[0].match.any[0].bogus", "unknown"),
        (one_rule({"metadata": {"key": "k"}}), "rules[0].match.metadata", "exactly one"),
        (
            one_rule({"metadata": {"key": "k", "equals": "a", "exists": True}}),
            "rules[0].match.metadata",
            "exactly one",
        ),
        (one_rule({"metadata": {"key": "k", "equals": 3}}), "rules[0].match.metadata.equals", ""),
        (
            one_rule({"metadata": {"key": "k", "exists": 1, "x": 1}}),
            "rules[0].match.metadata.x",
            "",
        ),
        (
            one_rule({"classifier": {"id": "nope", "label": "code"}}),
            "rules[0].match.classifier.id",
            "not defined",
        ),
        (
            one_rule({"classifier": {"id": "topic", "label": "math"}}, classifiers=TOPIC),
            "rules[0].match.classifier.label",
            "not a label",
        ),
        (
            one_rule({"classifier": {"id": "topic"}}, classifiers=TOPIC),
            "rules[0].match.classifier.label",
            "required",
        ),
        (
            one_rule(
                {"classifier": {"id": "topic", "label": "code", "min_score": 0.9, "max_score": 0.1}}
            ),
            "rules[0].match.classifier.min_score",
            "greater than max_score",
        ),
        (
            one_rule({"classifier": {"id": "topic", "label": "code", "min_score": 1.5}}),
            "rules[0].match.classifier.min_score",
            "[0, 1]",
        ),
        (
            base(
                rules=[{"id": "r", "match": {"min_chars": 1}, "route_to": "big"}],
                router={"type": "llm", "model": "judge", "prompt": "p"},
            ),
            "router",
            "not both",
        ),
        (base(router={"type": "llm", "model": "ghost", "prompt": "p"}), "router.model", "not a"),
        (
            base(router={"type": "llm", "model": "big-remote", "prompt": "p"}),
            "router.model",
            "remote",
        ),
        (
            base(router={"type": "llm", "model": "embed", "prompt": "p"}),
            "router.model",
            "embedding",
        ),
        (base(router={"type": "llm", "model": "judge", "prompt": " "}), "router.prompt", "empty"),
        (base(router={"type": "rules", "model": "judge", "prompt": "p"}), "router.type", "llm"),
        (
            base(router={"type": "llm", "model": "judge", "prompt": "p", "max_tokens": 0}),
            "router.max_tokens",
            "",
        ),
        (
            base(classifiers={"t": {"model": "judge", "labels": []}}),
            "classifiers.t.labels",
            "empty",
        ),
        (
            base(classifiers={"t": {"model": "judge", "labels": ["a", "a"]}}),
            "classifiers.t.labels[1]",
            "duplicate",
        ),
        (base(classifiers={"t": {"model": "ghost", "labels": ["a"]}}), "classifiers.t.model", ""),
        (
            base(router={"type": "llm", "model": "judge", "prompt": "p"}, classifiers=TOPIC),
            "classifiers",
            "only by rules",
        ),
        (base(extra_key=1), "extra_key", "unknown key"),
        (
            base(rules=[{"id": "r", "match": {"min_chars": 1}, "route_to": "big", "x": 1}]),
            "rules[0].x",
            "unknown key",
        ),
    ],
)
def test_validation_error_names_path(data: dict[str, Any], path: str, fragment: str) -> None:
    found = problems(data)
    assert path in found, found
    assert fragment in found[path]


def test_duplicate_rule_id() -> None:
    rule = {"id": "r", "match": {"min_chars": 1}, "route_to": "big"}
    assert "duplicate rule id" in problems(base(rules=[rule, rule]))["rules[1].id"]


def test_every_problem_is_named_at_once() -> None:
    found = problems(
        {
            "candidates": ["small", "small", "ghost"],
            "default": "nope",
            "rules": [{"id": "r", "match": {"regex": r"(a)\1"}, "route_to": "zzz"}],
            "typo": True,
        }
    )
    assert set(found) >= {
        "candidates[1]",
        "candidates[2]",
        "default",
        "rules[0].route_to",
        "rules[0].match.regex",
        "typo",
    }


@pytest.mark.parametrize(
    ("name", "ok"),
    [("auto", True), ("team:coding-1.5", True), ("-auto", False), ("a b", False), ("small", False)],
)
def test_policy_name(name: str, ok: bool) -> None:
    if ok:
        parse_policy(name, base(), MODELS)
    else:
        assert "name" in problems(base(), name=name)


def _deep(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"has_tools": True}
    for _ in range(depth - 1):
        node = {"not": node}
    return node


def test_depth_64_accepted_65_rejected() -> None:
    p = rules_policy({"id": "r", "match": _deep(64), "route_to": "big"})
    # 63 nots over has_tools=true: an odd number of negations.
    assert evaluate("auto", p, inp(tools=False)).rule == "r"
    found = problems(one_rule(_deep(65)))
    assert any("deeper than 64" in msg for msg in found.values()), found


def test_direct_model_validate_also_checks_values() -> None:
    with pytest.raises(ValueError, match="duplicate candidate"):
        Policy.model_validate({"candidates": ["a", "a"], "default": "a"})


def test_policy_is_frozen() -> None:
    p = parse_policy("auto", base(), MODELS)
    with pytest.raises(ValueError):
        p.default = "big"  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Routing input


def test_from_chat_last_user_message_with_text_parts() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "answer"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "line one"},
                    {"type": "image_url", "image_url": {"url": "data:..."}},
                    {"type": "text", "text": "line two"},
                ],
            },
            {"role": "tool", "content": "tool output", "tool_call_id": "x"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "metadata": {"tier": "pro", "n": 3, "ok": True},
    }
    i = RoutingInput.from_chat(body)
    assert i.text == "line one\nline two"
    assert i.has_tools and i.has_images
    assert i.metadata == {"tier": "pro"}  # non-string values dropped


def test_from_chat_images_in_any_role_and_empty_tools() -> None:
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            {"role": "user", "content": "plain"},
        ],
        "tools": [],
    }
    i = RoutingInput.from_chat(body)
    assert (i.text, i.has_tools, i.has_images, i.metadata) == ("plain", False, True, {})


def test_from_chat_tolerates_missing_and_malformed() -> None:
    assert RoutingInput.from_chat({}) == RoutingInput("", False, False, {})
    i = RoutingInput.from_chat({"messages": ["junk", {"role": "user", "content": None}]})
    assert i.text == ""


def test_from_completion() -> None:
    i = RoutingInput.from_completion({"prompt": "hi there", "metadata": {"a": "b"}})
    assert i == RoutingInput("hi there", False, False, {"a": "b"})
    assert RoutingInput.from_completion({"prompt": ["a", "b"]}).text == "a\nb"
    assert RoutingInput.from_completion({"prompt": [1, 2, 3]}).text == ""


# --------------------------------------------------------------------------------------------
# LLM router

ROUTER = base(router={"type": "llm", "model": "judge", "prompt": "Pick the cheapest model."})


def router_policy() -> Policy:
    return parse_policy("auto", ROUTER, MODELS)


def test_router_messages() -> None:
    msgs = router_messages("auto", router_policy(), inp("what is 2+2"))
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"].startswith("Pick the cheapest model.")
    assert '"small", "big"' in msgs[0]["content"] and '"rationale"' in msgs[0]["content"]
    assert msgs[1]["content"] == "what is 2+2"


@pytest.mark.parametrize(
    "reply",
    [
        '{"model": "big", "rationale": "needs reasoning"}',
        '```json\n{"model": "big", "rationale": "needs reasoning"}\n```',
        '```\n{"model": "big", "rationale": "r"}\n```',
        '  {"rationale": "r", "model": "big"}\n',
    ],
)
def test_router_reply_accepted(reply: str) -> None:
    d = router_decision("auto", router_policy(), reply)
    assert (d.candidate, d.rule, d.used_default) == ("big", "router", False)
    assert d.trace["router"]["model"] == "judge" and d.trace["router"]["rationale"]
    assert "error" not in d.trace["router"]


@pytest.mark.parametrize(
    "reply",
    [
        '```json\n{"model": "big", "rationale": "r"}\n```\n```json\n{"model": "big"}\n```',
        '```json\n```json\n{"model": "big", "rationale": "r"}\n```\n```',
        '{"model": "big", "rationale": "r", "confidence": 0.9}',
        '{"model": "big"}',
        '{"model": "huge", "rationale": "r"}',
        '{"model": "BIG", "rationale": "r"}',
        '{"model": "big", "rationale": ""}',
        '{"model": "big", "rationale": "  "}',
        '{"model": "big", "rationale": 3}',
        '{"model": "big", "model": "small", "rationale": "r"}',
        "I choose big",
        'Sure: {"model": "big", "rationale": "r"}',
        '["big"]',
        "",
        None,
    ],
)
def test_router_reply_rejected_uses_default(reply: str | None) -> None:
    d = router_decision("auto", router_policy(), reply)
    assert (d.candidate, d.rule, d.used_default) == ("small", "default", True)
    assert d.trace["router"]["error"]
    assert d.trace["errors"]
    json.dumps(d.trace)


def test_router_transport_error_uses_default() -> None:
    d = router_decision("auto", router_policy(), None, error="timeout")
    assert d.used_default and d.trace["router"]["error"] == "timeout"


# --------------------------------------------------------------------------------------------
# Classifier helper replies

CLF = Classifier(model="judge", labels=["code", "chat"], prompt="Is this about code?")


def test_classifier_messages() -> None:
    msgs = pol.classifier_messages("topic", CLF, "def f()")
    assert msgs[0]["content"].startswith("Is this about code?")
    assert '"code", "chat"' in msgs[0]["content"] and msgs[1]["content"] == "def f()"


@pytest.mark.parametrize(
    "reply",
    ['{"scores": {"code": 0.9, "chat": 0}}', '```json\n{"scores": {"chat": 0, "code": 0.9}}\n```'],
)
def test_classifier_reply_ok(reply: str) -> None:
    assert pol.parse_classifier_reply(CLF, reply) == {"code": 0.9, "chat": 0.0}


@pytest.mark.parametrize(
    "reply",
    [
        '{"scores": {"code": 0.9}}',
        '{"scores": {"code": 0.9, "chat": 0.1, "math": 0}}',
        '{"scores": {"code": 1.5, "chat": 0.1}}',
        '{"scores": {"code": "high", "chat": 0.1}}',
        '{"scores": {"code": true, "chat": 0.1}}',
        '{"scores": {"code": 0.9, "chat": 0.1}, "why": "x"}',
        '{"scores": [0.9, 0.1]}',
        "not json",
    ],
)
def test_classifier_reply_bad(reply: str) -> None:
    with pytest.raises(ValueError):
        pol.parse_classifier_reply(CLF, reply)


# --------------------------------------------------------------------------------------------
# Candidate floor and helpers


def test_floor_is_union_not_sum() -> None:
    a = parse_policy("a", {"candidates": ["small", "big"], "default": "small"}, MODELS)
    b = parse_policy("b", {"candidates": ["big", "judge"], "default": "big"}, MODELS)
    f = candidate_floor({"a": a, "b": b}, MODELS)
    assert f.floor == 3  # small, big, judge; not 4
    assert f.per_policy == {"a": 2, "b": 2}
    assert f.unresolved == []


def test_floor_counts_a_duplicate_candidate_once() -> None:
    p = Policy.model_construct(candidates=["small", "small", "big"], default="small")
    f = candidate_floor({"p": p}, MODELS)
    assert (f.floor, f.per_policy) == (2, {"p": 2})


def test_floor_excludes_remote_and_embedding() -> None:
    p = Policy.model_construct(candidates=["small", "big-remote", "embed"], default="small")
    f = candidate_floor({"p": p}, MODELS)
    assert (f.floor, f.per_policy) == (1, {"p": 1})


def test_floor_counts_unresolved_and_lists_them() -> None:
    a = Policy.model_construct(candidates=["small", "gone", "gone"], default="small")
    b = Policy.model_construct(candidates=["gone", "big"], default="big")
    f = candidate_floor({"a": a, "b": b}, MODELS)
    assert f.floor == 3  # small, gone, big
    assert f.per_policy == {"a": 2, "b": 2}
    assert f.unresolved == [("a", "gone"), ("b", "gone")]


def test_floor_of_nothing() -> None:
    assert candidate_floor({}, MODELS) == pol.Floor(0, {}, [])


def test_helper_models() -> None:
    models = {**MODELS, "tagger": ModelInfo("llm")}
    r = parse_policy("r", ROUTER, models)
    c = parse_policy(
        "c",
        base(
            rules=[
                {"id": "x", "match": {"classifier": {"id": "t", "label": "a"}}, "route_to": "big"}
            ],
            classifiers={"t": {"model": "tagger", "labels": ["a"]}},
        ),
        models,
    )
    plain = parse_policy("p", base(), models)
    assert helper_models({"r": r, "c": c, "p": plain}) == {"judge", "tagger"}
    assert helper_models({}) == set()
