"""Policy schema and validation: what a policy is, and every problem of one named by its path.

A policy is a virtual model name (clients send ``"model": "auto"``) that picks one of its
candidates per request, either by ordered rules over the request (first match wins, no match
means the default) or by asking a small local "routing helper" LLM. ``parse_policy`` checks a
policy against the model registry and names every problem by its dotted path
(``rules[1].match.regex``), so one answer lists them all.

A rule's ``route_to``, the ``default`` and an LLM router's answer name one candidate or a list
of equivalent ones in preference order; ``choose`` says how the list is used (``first``: its
first, as with a single name; ``fastest``: the least predicted wait, ``residency.route_wait``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)

from residency.policies.regex import MAX_POLICY_REGEX_PROGRAM, program_size, regex_problem

POLICY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
RULE_ID_RE = re.compile(r"^[A-Za-z0-9._-]+$")
#: Classifier ids follow the rule-id alphabet: both appear in traces and metric labels.
CLASSIFIER_ID_RE = RULE_ID_RE

MAX_DEPTH = 64
ROUTER_MAX_TOKENS_LIMIT = 4096

DEFAULT_RULE = "default"
ROUTER_RULE = "router"

LEAVES = (
    "keywords_any",
    "keywords_all",
    "regex",
    "min_chars",
    "max_chars",
    "has_tools",
    "has_images",
    "metadata",
    "classifier",
)
COMBINATORS = ("any", "all", "not")
MATCH_KEYS = COMBINATORS + LEAVES

Choose = Literal["first", "fastest"]
CHOOSE: tuple[Choose, ...] = ("first", "fastest")
DEFAULT_EVICT_PENALTY_S = 10.0


class PolicyError(ValueError):
    """A bad policy; ``problems`` maps each dotted path (``rules[1].match.regex``) to what is
    wrong there, so one answer names every problem."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = problems
        lines = "; ".join(f"{k}: {v}" for k, v in problems.items())
        super().__init__(f"invalid policy: {lines}")


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about a registered model."""

    type: str  # "llm" | "embedding" | "rerank"
    remote: bool = False  # a remote (base_url) model: forwarded, never loaded here


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def as_listed(targets: str | Sequence[str]) -> tuple[str, ...]:
    """The candidates a ``route_to`` or ``default`` names, in preference order."""
    return (targets,) if isinstance(targets, str) else tuple(targets)


def _one_shape_error(v: Any, handler: Callable[[Any], Any]) -> Any:
    # Pydantic reports a union once per member ("route_to.str", "route_to.list[str][1]");
    # one problem at the field itself reads better, and _check names the exact entry.
    try:
        return handler(v)
    except ValidationError:
        raise ValueError("must be a candidate name or a non-empty list of them") from None


#: One candidate, or several equivalent ones in preference order.
Targets = Annotated[str | list[str], WrapValidator(_one_shape_error)]


class Rule(_Frozen):
    id: str
    match: dict[str, Any]
    route_to: Targets

    @property
    def listed(self) -> tuple[str, ...]:
        return as_listed(self.route_to)


class Router(_Frozen):
    type: Literal["llm"]
    model: str
    prompt: str
    max_tokens: int = Field(256, ge=1, le=ROUTER_MAX_TOKENS_LIMIT)


class Classifier(_Frozen):
    model: str
    labels: list[str]
    prompt: str = ""


# Set by parse_policy so that the model validator does not report again what parse_policy's
# own pass (which also knows the registry and tolerates wrong types) already reported.
_SKIP_CHECKS = "residency.policies.skip_checks"


class Policy(_Frozen):
    """A validated policy. Pydantic checks the shapes (types, unknown keys); the values and the
    cross-references are checked by :func:`_check` so that errors carry precise paths."""

    candidates: list[str]
    default: Targets
    rules: list[Rule] = []
    router: Router | None = None
    classifiers: dict[str, Classifier] = {}
    # Show the chosen candidate's load as reasoning (``[models.X] show_loading``); None: as
    # the candidate says.
    show_loading: bool | None = None
    # Among the candidates a rule, the default or the router lists: the first, or the one with
    # the least predicted wait. Strict numbers: a quoted "5" is a typo to report, not to coerce.
    choose: Choose = "first"
    # With "fastest": past this predicted wait on every local listed candidate, the first listed
    # remote one; 0 = never.
    max_wait_s: float = Field(0.0, strict=True, allow_inf_nan=False)
    # With "fastest": seconds added to a candidate whose load would evict a model in use.
    evict_penalty_s: float = Field(DEFAULT_EVICT_PENALTY_S, strict=True, allow_inf_nan=False)

    @property
    def default_listed(self) -> tuple[str, ...]:
        return as_listed(self.default)

    @model_validator(mode="after")
    def _values(self, info: ValidationInfo) -> Policy:
        if isinstance(info.context, dict) and info.context.get(_SKIP_CHECKS):
            return self
        problems = _check(self.model_dump(), None)
        if problems:
            raise ValueError("; ".join(f"{k}: {v}" for k, v in problems.items()))
        return self


# --------------------------------------------------------------------------------------------
# Validation


def parse_policy(name: str, data: Mapping[str, Any], models: Mapping[str, ModelInfo]) -> Policy:
    """Validate ``data`` as policy ``name`` against the registry; raise PolicyError naming every
    problem, or return the frozen Policy."""
    problems: dict[str, str] = {}
    if not isinstance(name, str) or not POLICY_NAME_RE.match(name):
        problems["name"] = (
            f"policy name {name!r} must match {POLICY_NAME_RE.pattern} "
            "(letters, digits, '.', '_', ':', '-'; at most 128)"
        )
    elif name in models:
        problems["name"] = f"{name!r} is already a registered model name"
    if not isinstance(data, Mapping):
        problems["(root)"] = "expected an object"
        raise PolicyError(problems)
    problems.update(_check(data, models))
    try:
        policy = Policy.model_validate(dict(data), context={_SKIP_CHECKS: True})
    except ValidationError as e:
        for path, msg in _pydantic_problems(e).items():
            # _check already described this path or an entry under it (usually better, with
            # the registry in mind): "route_to[1]" says more than "route_to".
            if not any(k == path or k.startswith((f"{path}[", f"{path}.")) for k in problems):
                problems[path] = msg
        raise PolicyError(problems) from None
    if problems:
        raise PolicyError(problems)
    return policy


def _loc(parts: tuple[int | str, ...]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out or "(root)"


def _pydantic_problems(err: ValidationError) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in err.errors():
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        out.setdefault(_loc(tuple(e["loc"])), msg.removeprefix("Value error, "))
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check(data: Mapping[str, Any], models: Mapping[str, ModelInfo] | None) -> dict[str, str]:
    """Every value and cross-reference problem of raw policy data, by dotted path. Tolerates
    wrong types (pydantic reports those); ``models`` None skips the registry checks."""
    p: dict[str, str] = {}

    candidates = data.get("candidates")
    cand_set: set[str] = set()
    if not isinstance(candidates, list):
        p["candidates"] = "required: a non-empty list of model names"
    elif not candidates:
        p["candidates"] = "must not be empty"
    else:
        seen: set[str] = set()
        for i, c in enumerate(candidates):
            if not isinstance(c, str) or not c:
                p[f"candidates[{i}]"] = "must be a non-empty model name"
                continue
            if c in seen:
                p[f"candidates[{i}]"] = f"duplicate candidate {c!r}"
                continue
            seen.add(c)
            if models is not None:
                info = models.get(c)
                if info is None:
                    p[f"candidates[{i}]"] = f"{c!r} is not a registered model"
                elif info.type != "llm":
                    p[f"candidates[{i}]"] = f"{c!r} is a {info.type} model; candidates must be llm"
        cand_set = seen

    known = cand_set if isinstance(candidates, list) else None
    _check_targets("default", data.get("default"), known, p)
    _check_choice(data, p)

    classifiers = data.get("classifiers") or {}
    labels_of: dict[str, set[str]] = {}
    if isinstance(classifiers, Mapping):
        for cid, clf in classifiers.items():
            labels_of[str(cid)] = _check_classifier(str(cid), clf, models, p)

    rules = data.get("rules") or []
    router = data.get("router")
    if rules and router is not None:
        p["router"] = "set either rules or router, not both"
    if router is not None and classifiers:
        p["classifiers"] = "classifiers are used only by rules; remove them or the router"
    if isinstance(rules, list):
        ids: set[str] = set()
        regexes: list[tuple[str, str]] = []
        for i, rule in enumerate(rules):
            if isinstance(rule, Mapping):
                _check_rule(f"rules[{i}]", rule, ids, known, labels_of, regexes, p)
        _check_regex_budget(regexes, p)
    if isinstance(router, Mapping):
        prompt = router.get("prompt")
        if isinstance(prompt, str) and not prompt.strip():
            p["router.prompt"] = "must not be empty"
        _check_helper("router.model", router.get("model"), models, p)
    return p


def _check_targets(path: str, v: Any, known: set[str] | None, p: dict[str, str]) -> None:
    """A ``route_to`` or ``default``: a candidate, or a non-empty list of distinct ones.
    ``known`` None: the candidates are broken themselves, so membership is not checked."""
    if isinstance(v, str) and v:
        if known is not None and v not in known:
            p[path] = f"{v!r} is not one of the candidates"
        return
    if not isinstance(v, list):
        p[path] = "required: one of the candidates, or a non-empty list of them"
        return
    if not v:
        p[path] = "must not be empty: list at least one candidate"
        return
    seen: set[str] = set()
    for i, c in enumerate(v):
        ip = f"{path}[{i}]"
        if not isinstance(c, str) or not c:
            p[ip] = f"must be a candidate name, got {c!r}"
        elif c in seen:
            p[ip] = f"duplicate entry {c!r}"
        elif known is not None and c not in known:
            p[ip] = f"{c!r} is not one of the candidates"
        if isinstance(c, str):
            seen.add(c)


def _check_choice(data: Mapping[str, Any], p: dict[str, str]) -> None:
    """``choose``, ``max_wait_s`` and ``evict_penalty_s``."""
    choose = data.get("choose", "first")
    if not isinstance(choose, str) or choose not in CHOOSE:
        p["choose"] = f'must be "first" or "fastest", got {choose!r}'
    for key in ("max_wait_s", "evict_penalty_s"):
        v = data.get(key, 0.0)
        if not is_number(v) or v < 0:
            p[key] = f"must be a finite number of seconds >= 0, got {v!r}"
    wait = data.get("max_wait_s", 0.0)
    if choose == "first" and "max_wait_s" not in p and wait > 0:
        # Silently ignoring it would hide a forgotten ``choose = "fastest"``.
        p["max_wait_s"] = 'only used with choose = "fastest"'


def _check_helper(
    path: str, model: Any, models: Mapping[str, ModelInfo] | None, p: dict[str, str]
) -> None:
    if not isinstance(model, str) or not model:
        p[path] = "required: a registered local llm model"
        return
    if models is None:
        return
    info = models.get(model)
    if info is None:
        p[path] = f"{model!r} is not a registered model"
    elif info.type != "llm":
        p[path] = f"{model!r} is a {info.type} model; a routing helper must be llm"
    elif info.remote:
        # Helpers run in their own local pool; a remote one would put a network round trip and
        # someone else's availability in front of every routed request.
        p[path] = f"{model!r} is a remote model; a routing helper must be local"


def _check_classifier(
    cid: str, clf: Any, models: Mapping[str, ModelInfo] | None, p: dict[str, str]
) -> set[str]:
    base = f"classifiers.{cid}"
    if not CLASSIFIER_ID_RE.match(cid):
        p[base] = f"classifier id must match {CLASSIFIER_ID_RE.pattern}"
    if not isinstance(clf, Mapping):
        return set()
    _check_helper(f"{base}.model", clf.get("model"), models, p)
    labels = clf.get("labels")
    out: set[str] = set()
    if not isinstance(labels, list):
        return out
    if not labels:
        p[f"{base}.labels"] = "must not be empty"
    for i, lab in enumerate(labels):
        if not isinstance(lab, str) or not lab:
            p[f"{base}.labels[{i}]"] = "must be a non-empty string"
        elif lab in out:
            p[f"{base}.labels[{i}]"] = f"duplicate label {lab!r}"
        else:
            out.add(lab)
    return out


def _check_rule(
    base: str,
    rule: Mapping[str, Any],
    ids: set[str],
    known: set[str] | None,
    labels_of: Mapping[str, set[str]],
    regexes: list[tuple[str, str]],
    p: dict[str, str],
) -> None:
    rid = rule.get("id")
    if not isinstance(rid, str) or not RULE_ID_RE.match(rid):
        p[f"{base}.id"] = f"rule id must match {RULE_ID_RE.pattern}"
    elif rid in (DEFAULT_RULE, ROUTER_RULE):
        # The route header and metrics use these words for "no rule matched" / "the LLM chose".
        p[f"{base}.id"] = f"rule id {rid!r} is reserved"
    elif rid in ids:
        p[f"{base}.id"] = f"duplicate rule id {rid!r}"
    else:
        ids.add(rid)
    _check_targets(f"{base}.route_to", rule.get("route_to"), known, p)
    if "match" not in rule:
        p[f"{base}.match"] = "required"
    else:
        _check_node(f"{base}.match", rule["match"], 1, labels_of, regexes, p)


def _check_node(
    path: str,
    node: Any,
    depth: int,
    labels_of: Mapping[str, set[str]],
    regexes: list[tuple[str, str]],
    p: dict[str, str],
) -> None:
    if depth > MAX_DEPTH:
        p[path] = f"match tree is deeper than {MAX_DEPTH}"
        return
    if not isinstance(node, Mapping):
        p[path] = "must be a match object"
        return
    if not node:
        p[path] = "must not be empty (an empty match would match everything silently)"
        return
    for key, v in node.items():
        kp = f"{path}.{key}"
        if key in ("any", "all"):
            if not isinstance(v, list) or not v:
                p[kp] = "must be a non-empty list of match objects"
                continue
            for i, child in enumerate(v):
                _check_node(f"{kp}[{i}]", child, depth + 1, labels_of, regexes, p)
        elif key == "not":
            _check_node(kp, v, depth + 1, labels_of, regexes, p)
        elif key in ("keywords_any", "keywords_all"):
            if not isinstance(v, list) or not v:
                p[kp] = "must be a non-empty list of non-empty strings"
                continue
            for i, kw in enumerate(v):
                if not isinstance(kw, str) or not kw:
                    p[f"{kp}[{i}]"] = "must be a non-empty string"
        elif key == "regex":
            problem = regex_problem(v)
            if problem:
                p[kp] = problem
            else:
                regexes.append((kp, v))
        elif key in ("min_chars", "max_chars"):
            if not _is_int(v) or v < 0:
                p[kp] = f"must be an integer >= 0 (UTF-8 bytes), got {v!r}"
        elif key in ("has_tools", "has_images"):
            if not isinstance(v, bool):
                p[kp] = f"must be true or false, got {v!r}"
        elif key == "metadata":
            _check_metadata(kp, v, p)
        elif key == "classifier":
            _check_classifier_leaf(kp, v, labels_of, p)
        else:
            p[kp] = f"unknown match key; expected one of {', '.join(MATCH_KEYS)}"


def _check_metadata(path: str, v: Any, p: dict[str, str]) -> None:
    if not isinstance(v, Mapping):
        p[path] = "must be an object {key, equals | any | exists}"
        return
    for k in v:
        if k not in ("key", "equals", "any", "exists"):
            p[f"{path}.{k}"] = "unknown key; expected key, equals, any or exists"
    key = v.get("key")
    if not isinstance(key, str) or not key:
        p[f"{path}.key"] = "required: a non-empty string"
    tests = [t for t in ("equals", "any", "exists") if t in v]
    if len(tests) != 1:
        p[path] = "needs exactly one of equals, any, exists"
        return
    t = tests[0]
    val = v[t]
    if t == "equals" and not isinstance(val, str):
        p[f"{path}.equals"] = "must be a string (metadata values are strings)"
    elif t == "any":
        if not isinstance(val, list) or not val or not all(isinstance(x, str) for x in val):
            p[f"{path}.any"] = "must be a non-empty list of strings"
    elif t == "exists" and not isinstance(val, bool):
        p[f"{path}.exists"] = "must be true or false"


def _check_classifier_leaf(
    path: str, v: Any, labels_of: Mapping[str, set[str]], p: dict[str, str]
) -> None:
    if not isinstance(v, Mapping):
        p[path] = "must be an object {id, label, min_score?, max_score?}"
        return
    for k in v:
        if k not in ("id", "label", "min_score", "max_score"):
            p[f"{path}.{k}"] = "unknown key; expected id, label, min_score or max_score"
    cid = v.get("id")
    if not isinstance(cid, str) or not cid:
        p[f"{path}.id"] = "required: the id of a classifier of this policy"
    elif cid not in labels_of:
        p[f"{path}.id"] = f"{cid!r} is not defined in this policy's classifiers"
    label = v.get("label")
    # A label is required: a score without a label has no meaning for multi-label classifiers.
    if not isinstance(label, str) or not label:
        p[f"{path}.label"] = "required: one of the classifier's labels"
    elif isinstance(cid, str) and cid in labels_of and label not in labels_of[cid]:
        p[f"{path}.label"] = f"{label!r} is not a label of classifier {cid!r}"
    bounds: dict[str, float] = {}
    for b in ("min_score", "max_score"):
        if b in v:
            x = v[b]
            if not is_number(x) or not 0.0 <= x <= 1.0:
                p[f"{path}.{b}"] = f"must be a number in [0, 1], got {x!r}"
            else:
                bounds[b] = float(x)
    if len(bounds) == 2 and bounds["min_score"] > bounds["max_score"]:
        p[f"{path}.min_score"] = "must not be greater than max_score"


def _check_regex_budget(regexes: list[tuple[str, str]], p: dict[str, str]) -> None:
    """A request's worst-case regex work grows with the policy's total RE2 program size (see
    residency.policies.regex), so the total is capped, not only each pattern."""
    total = 0
    for path, pattern in regexes:
        total += program_size(pattern)
        if total > MAX_POLICY_REGEX_PROGRAM:
            p[path] = (
                f"the policy's regexes compile to {total} RE2 instructions up to here, more "
                f"than the {MAX_POLICY_REGEX_PROGRAM} allowed together; simplify them or use "
                "keywords_any"
            )
            return
