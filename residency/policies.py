"""Router policies: validation, the match language, routing decisions and the candidate floor.

A policy is a virtual model name (clients send ``"model": "auto"``) that picks one of its
candidates per request, either by ordered rules over the request (first match wins, no match
means the default) or by asking a small local "routing helper" LLM. This module owns the pure
part of that: parsing a policy against the model registry and naming every problem by its dotted
path, building the routing input from a request body, evaluating rules into a decision with a
JSON-able trace, building the helper prompts and parsing their replies, and computing how many
local LLMs the policies need resident at once (the candidate floor).

It is pure on purpose (no Redis, no HTTP, no clock, no threads): the web tier, the coordinator
and the admin ``validate`` endpoint must all reach the same decision for the same input, and the
rules are then testable exhaustively without a running box. Calling a helper model is the
caller's job: ``evaluate`` takes a ``classify`` callable, and for an LLM-router policy the caller
sends ``router_messages`` to the helper and hands the reply to ``router_decision``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

POLICY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
RULE_ID_RE = re.compile(r"^[A-Za-z0-9._-]+$")
#: Classifier ids follow the rule-id alphabet: both appear in traces and metric labels.
CLASSIFIER_ID_RE = RULE_ID_RE

MAX_DEPTH = 64
#: Regex leaves see at most this many UTF-8 bytes of the text, so one huge prompt cannot make
#: matching cost unbounded time even with a safe pattern.
REGEX_INPUT_CAP = 1 << 20
#: Longest accepted regex source; a guard against pathological compile times, far above any
#: hand-written rule.
MAX_REGEX_LEN = 4096
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

# Only A-Z fold to a-z: Lemonade folds ASCII only, and full Unicode case folding would make
# matching locale-like and surprising ("ß" vs "ss", Turkish dotless i). Non-ASCII letters
# therefore compare exactly: "É" does not match "é".
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def ascii_lower(s: str) -> str:
    """Lowercase A-Z only; every other character is left as it is."""
    return s.translate(_ASCII_LOWER)


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

    type: str  # "llm" | "embedding"
    remote: bool = False  # a remote (base_url) model: forwarded, never loaded here


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Rule(_Frozen):
    id: str
    match: dict[str, Any]
    route_to: str


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
    default: str
    rules: list[Rule] = []
    router: Router | None = None
    classifiers: dict[str, Classifier] = {}

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
            # _check already described this path (usually better, with the registry in mind).
            problems.setdefault(path, msg)
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


def _is_number(v: Any) -> bool:
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

    default = data.get("default")
    if not isinstance(default, str) or not default:
        p["default"] = "required: one of the candidates"
    elif isinstance(candidates, list) and default not in cand_set:
        p["default"] = f"{default!r} is not one of the candidates"

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
        for i, rule in enumerate(rules):
            if isinstance(rule, Mapping):
                _check_rule(f"rules[{i}]", rule, ids, cand_set, candidates, labels_of, p)
    if isinstance(router, Mapping):
        prompt = router.get("prompt")
        if isinstance(prompt, str) and not prompt.strip():
            p["router.prompt"] = "must not be empty"
        _check_helper("router.model", router.get("model"), models, p)
    return p


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
    cand_set: set[str],
    candidates: Any,
    labels_of: Mapping[str, set[str]],
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
    route_to = rule.get("route_to")
    if not isinstance(route_to, str) or not route_to:
        p[f"{base}.route_to"] = "required: one of the candidates"
    elif isinstance(candidates, list) and route_to not in cand_set:
        p[f"{base}.route_to"] = f"{route_to!r} is not one of the candidates"
    if "match" not in rule:
        p[f"{base}.match"] = "required"
    else:
        _check_node(f"{base}.match", rule["match"], 1, labels_of, p)


def _check_node(
    path: str, node: Any, depth: int, labels_of: Mapping[str, set[str]], p: dict[str, str]
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
                _check_node(f"{kp}[{i}]", child, depth + 1, labels_of, p)
        elif key == "not":
            _check_node(kp, v, depth + 1, labels_of, p)
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
            if not _is_number(x) or not 0.0 <= x <= 1.0:
                p[f"{path}.{b}"] = f"must be a number in [0, 1], got {x!r}"
            else:
                bounds[b] = float(x)
    if len(bounds) == 2 and bounds["min_score"] > bounds["max_score"]:
        p[f"{path}.min_score"] = "must not be greater than max_score"


def regex_problem(pattern: Any) -> str | None:
    """Why ``pattern`` is not an acceptable regex leaf, or None."""
    if not isinstance(pattern, str) or not pattern:
        return "must be a non-empty string"
    if len(pattern) > MAX_REGEX_LEN:
        return f"longer than {MAX_REGEX_LEN} characters"
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError, ValueError) as e:
        return f"does not compile: {e}"
    try:
        nested = _has_nested_unbounded(pattern)
    except Exception:  # the private parser changed shape; be safe, not permissive
        return "could not be checked for catastrophic backtracking"
    if nested:
        return (
            "nested unbounded quantifiers (like (x+)+) can backtrack catastrophically; "
            "rewrite without repeating a repeated group"
        )
    return None


def _has_nested_unbounded(pattern: str) -> bool:
    """True when an unbounded repeat (``*``, ``+``, ``{n,}``) contains another unbounded repeat.

    Walks the stdlib's own parse tree rather than scanning text, so escapes, classes, verbose
    mode and comments cannot hide a nested repeat. Conservative: ``(a+b)+`` is rejected too,
    and atomic groups and possessive repeats get no exemption.
    """
    from re import _constants as c  # type: ignore[attr-defined]
    from re import _parser as sre  # type: ignore[attr-defined]

    repeats = (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT))
    found_nested = False

    def walk(sub: Any) -> bool:
        nonlocal found_nested
        unbounded = False
        for op, av in sub:
            if op in repeats:
                _lo, hi, body = av
                inner = walk(body)
                if hi == c.MAXREPEAT:
                    if inner:
                        found_nested = True
                    unbounded = True
                unbounded = unbounded or inner
            elif op == c.SUBPATTERN:
                unbounded = walk(av[-1]) or unbounded
            elif op == c.BRANCH:
                for branch in av[1]:
                    unbounded = walk(branch) or unbounded
            elif op in (c.ASSERT, c.ASSERT_NOT):
                unbounded = walk(av[1]) or unbounded
            elif op == getattr(c, "ATOMIC_GROUP", None):
                unbounded = walk(av) or unbounded
            elif op == c.GROUPREF_EXISTS:
                for branch in av[1:]:
                    if branch is not None:
                        unbounded = walk(branch) or unbounded
        return unbounded

    walk(sre.parse(pattern))
    return found_nested


# --------------------------------------------------------------------------------------------
# Routing input


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            part["text"]
            for part in content
            if isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ]
        return "\n".join(parts)
    return ""


def _string_metadata(body: Mapping[str, Any]) -> dict[str, str]:
    md = body.get("metadata")
    if not isinstance(md, Mapping):
        return {}
    return {k: v for k, v in md.items() if isinstance(k, str) and isinstance(v, str)}


@dataclass(frozen=True)
class RoutingInput:
    """What rules see of a request."""

    text: str  # text of the last user message: string content, or text parts joined by "\n"
    has_tools: bool  # the request has non-empty "tools" (or legacy "functions")
    has_images: bool  # any message (any role) has an image_url part
    metadata: dict[str, str] = field(default_factory=dict)  # OpenAI "metadata", strings only

    @property
    def byte_length(self) -> int:
        return len(self.text.encode("utf-8"))

    @classmethod
    def from_chat(cls, body: Mapping[str, Any]) -> RoutingInput:
        """From a /v1/chat/completions body; tolerant of malformed parts (they count as
        absent), since request validation is the web tier's job, not routing's."""
        messages = body.get("messages")
        msgs = [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []
        text = ""
        for m in reversed(msgs):
            if m.get("role") == "user":
                text = _text_of(m.get("content"))
                break
        has_images = any(
            isinstance(part, Mapping) and part.get("type") == "image_url"
            for m in msgs
            if isinstance(m.get("content"), list)
            for part in m["content"]
        )
        tools = body.get("tools")
        functions = body.get("functions")
        has_tools = bool(isinstance(tools, list) and tools) or bool(
            isinstance(functions, list) and functions
        )
        return cls(text, has_tools, has_images, _string_metadata(body))

    @classmethod
    def from_completion(cls, body: Mapping[str, Any]) -> RoutingInput:
        """From a /v1/completions body: the prompt string (a list of strings is joined by
        newlines; token-id prompts have no text)."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(x, str) for x in prompt):
            text = "\n".join(prompt)
        else:
            text = ""
        return cls(text, False, False, _string_metadata(body))


# --------------------------------------------------------------------------------------------
# Rule evaluation

Classify = Callable[[str, str], Mapping[str, float]]  # (classifier id, text) -> {label: score}


@dataclass(frozen=True)
class Decision:
    candidate: str
    rule: str  # the matched rule id, "router", or "default"
    used_default: bool
    trace: dict[str, Any]


@lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _regex_subject(text: str) -> str:
    # A str of n characters is at most 4n UTF-8 bytes: skip the encode for the common case.
    if len(text) * 4 <= REGEX_INPUT_CAP:
        return text
    raw = text.encode("utf-8")
    if len(raw) <= REGEX_INPUT_CAP:
        return text
    # Cut at a byte boundary and drop a split trailing character rather than fail.
    return raw[:REGEX_INPUT_CAP].decode("utf-8", errors="ignore")


class _Eval:
    """One evaluate() call: the input, the classifier cache, and what the trace collects."""

    def __init__(self, inp: RoutingInput, classify: Classify | None) -> None:
        self.inp = inp
        self.classify = classify
        self._folded: str | None = None
        self._scores: dict[str, dict[str, Any] | None] = {}
        self.errors: list[dict[str, Any]] = []
        self.conditions: list[dict[str, Any]] = []
        self.rule = ""

    @property
    def folded(self) -> str:
        if self._folded is None:
            self._folded = ascii_lower(self.inp.text)
        return self._folded

    def node(self, path: str, node: Mapping[str, Any]) -> bool:
        # Several keys in one object mean all of them; stop at the first false one.
        for key, v in node.items():
            kp = f"{path}.{key}"
            if key == "any":
                ok = any(self.node(f"{kp}[{i}]", child) for i, child in enumerate(v))
            elif key == "all":
                ok = all(self.node(f"{kp}[{i}]", child) for i, child in enumerate(v))
            elif key == "not":
                ok = not self.node(kp, v)
            else:
                ok = self.leaf(kp, key, v)
            if not ok:
                return False
        return True

    def leaf(self, path: str, key: str, v: Any) -> bool:
        rec: dict[str, Any] = {"path": path, "leaf": key}
        inp = self.inp
        if key in ("keywords_any", "keywords_all"):
            hits = [kw for kw in v if ascii_lower(kw) in self.folded]
            ok = bool(hits) if key == "keywords_any" else len(hits) == len(v)
            rec["hits"] = hits
        elif key == "regex":
            ok = _compiled(v).search(_regex_subject(inp.text)) is not None
            rec["pattern"] = v
        elif key in ("min_chars", "max_chars"):
            n = inp.byte_length
            ok = n >= v if key == "min_chars" else n <= v
            rec.update(value=n, threshold=v)
        elif key == "has_tools":
            ok = inp.has_tools == v
            rec["value"] = inp.has_tools
        elif key == "has_images":
            ok = inp.has_images == v
            rec["value"] = inp.has_images
        elif key == "metadata":
            ok = self.metadata(v, rec)
        elif key == "classifier":
            ok = self.classifier(path, v, rec)
        else:  # validated policies never get here; a hand-built one matches nothing
            ok = False
            self.errors.append({"rule": self.rule, "path": path, "error": "unknown match key"})
        rec["result"] = ok
        self.conditions.append(rec)
        return ok

    def metadata(self, v: Mapping[str, Any], rec: dict[str, Any]) -> bool:
        key = v["key"]
        present = key in self.inp.metadata
        value = self.inp.metadata.get(key)
        rec.update(key=key, present=present)
        if "equals" in v:
            return present and value == v["equals"]
        if "any" in v:
            return present and value in v["any"]
        return present == bool(v.get("exists"))

    def scores(self, cid: str) -> dict[str, Any] | None:
        # One call per classifier id per evaluation, failures included: a helper that just
        # failed would most likely fail again, and each call costs a helper-model round trip.
        if cid in self._scores:
            return self._scores[cid]
        got: dict[str, Any] | None = None
        if self.classify is None:
            self.errors.append({"rule": self.rule, "classifier": cid, "error": "no classifier"})
        else:
            try:
                got = dict(self.classify(cid, self.inp.text))
            except Exception as e:
                self.errors.append(
                    {"rule": self.rule, "classifier": cid, "error": f"{type(e).__name__}: {e}"}
                )
        self._scores[cid] = got
        return got

    def classifier(self, path: str, v: Mapping[str, Any], rec: dict[str, Any]) -> bool:
        cid, label = v["id"], v["label"]
        lo = v.get("min_score")
        hi = v.get("max_score")
        if lo is None and hi is None:
            lo = 0.5
        lo = 0.0 if lo is None else float(lo)
        hi = 1.0 if hi is None else float(hi)
        rec.update(classifier=cid, label=label, min_score=lo, max_score=hi)
        scores = self.scores(cid)
        if scores is None:
            rec["error"] = "classifier failed"
            return False  # on_error: match_false
        raw: Any = scores.get(label)
        if not _is_number(raw) or not 0.0 <= raw <= 1.0:
            err = f"no score in [0, 1] for label {label!r} (got {raw!r})"
            self.errors.append({"rule": self.rule, "path": path, "classifier": cid, "error": err})
            rec["error"] = err
            return False
        score = float(raw)
        rec["score"] = score
        return lo <= score <= hi


def _trace(
    name: str, candidate: str, rule: str, used_default: bool, **extra: Any
) -> dict[str, Any]:
    t: dict[str, Any] = {
        "policy": name,
        "candidate": candidate,
        "rule": rule,
        "used_default": used_default,
        "rules": [],
        "errors": [],
    }
    t.update(extra)
    return t


def evaluate(
    name: str, policy: Policy, inp: RoutingInput, classify: Classify | None = None
) -> Decision:
    """Rules in order, first match wins; no match means the default. A failing classifier makes
    its leaf false (and is listed in ``trace["errors"]``), never the whole request fail."""
    if policy.router is not None:
        raise ValueError(
            f"policy {name!r} uses an LLM router: call router_messages and router_decision"
        )
    ev = _Eval(inp, classify)
    rules_trace: list[dict[str, Any]] = []
    chosen: Rule | None = None
    for rule in policy.rules:
        ev.rule = rule.id
        ev.conditions = []
        matched = ev.node("match", rule.match)
        rules_trace.append({"id": rule.id, "matched": matched, "conditions": ev.conditions})
        if matched:
            chosen = rule
            break
    if chosen is None:
        cand, rid, used_default = policy.default, DEFAULT_RULE, True
    else:
        cand, rid, used_default = chosen.route_to, chosen.id, False
    trace = _trace(name, cand, rid, used_default, rules=rules_trace, errors=ev.errors)
    return Decision(cand, rid, used_default, trace)


# --------------------------------------------------------------------------------------------
# Helper models: the LLM router and LLM classifiers


def router_messages(name: str, policy: Policy, inp: RoutingInput) -> list[dict[str, str]]:
    """The chat messages for the routing helper. The caller sends them with temperature 0,
    ``max_tokens=policy.router.max_tokens`` and ``response_format={"type": "json_object"}``."""
    if policy.router is None:
        raise ValueError(f"policy {name!r} has no LLM router")
    names = ", ".join(json.dumps(c) for c in policy.candidates)
    contract = (
        "Answer with exactly one JSON object and nothing else, of the form "
        '{"model": <name>, "rationale": <reason>}. "model" must be exactly one of these names: '
        f'{names}. "rationale" is a short, non-empty reason for the choice.'
    )
    return [
        {"role": "system", "content": f"{policy.router.prompt.rstrip()}\n\n{contract}"},
        {"role": "user", "content": inp.text},
    ]


_FENCE_RE = re.compile(r"```(?:json|JSON)?[ \t]*\r?\n?(.*?)\r?\n?[ \t]*```", re.S)


def _unfence(reply: str) -> str:
    """The reply without one surrounding code fence; more than one fence is an error."""
    s = reply.strip()
    if not s.startswith("```"):
        return s
    m = _FENCE_RE.fullmatch(s)
    if m is None or "```" in m.group(1):
        raise ValueError("expected at most one surrounding code fence")
    return m.group(1).strip()


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _json_object(reply: str) -> dict[str, Any]:
    text = _unfence(reply)
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    return obj


def _parse_router_reply(policy: Policy, reply_text: str) -> tuple[str, str]:
    obj = _json_object(reply_text)
    if set(obj) != {"model", "rationale"}:
        raise ValueError(f"expected exactly the keys model and rationale, got {sorted(obj)}")
    model, rationale = obj["model"], obj["rationale"]
    if not isinstance(model, str) or model not in policy.candidates:
        raise ValueError(f"model {model!r} is not one of the candidates")
    if not isinstance(rationale, str) or not rationale.strip():
        raise ValueError("rationale must be a non-empty string")
    return model, rationale


def router_decision(
    name: str, policy: Policy, reply_text: str | None, error: str | None = None
) -> Decision:
    """The decision from the routing helper's reply. Anything but an exact
    ``{"model", "rationale"}`` object naming a candidate falls back to the default."""
    if policy.router is None:
        raise ValueError(f"policy {name!r} has no LLM router")
    info: dict[str, Any] = {"model": policy.router.model}
    if reply_text is not None:
        info["reply"] = reply_text[:1000]  # enough to debug a prompt, bounded for the trace
    if error is None and reply_text is None:
        error = "no reply from the routing helper"
    if error is None:
        assert reply_text is not None
        try:
            cand, rationale = _parse_router_reply(policy, reply_text)
        except ValueError as e:
            error = f"bad reply: {e}"
        else:
            info["rationale"] = rationale
            trace = _trace(name, cand, ROUTER_RULE, False, router=info)
            return Decision(cand, ROUTER_RULE, False, trace)
    info["error"] = error
    trace = _trace(
        name,
        policy.default,
        DEFAULT_RULE,
        True,
        router=info,
        errors=[{"router": policy.router.model, "error": error}],
    )
    return Decision(policy.default, DEFAULT_RULE, True, trace)


def classifier_messages(classifier_id: str, clf: Classifier, text: str) -> list[dict[str, str]]:
    """The chat messages for a classifier helper (send like the router's: temperature 0, JSON
    mode)."""
    names = ", ".join(json.dumps(lab) for lab in clf.labels)
    contract = (
        "Classify the user message. Answer with exactly one JSON object and nothing else, of "
        'the form {"scores": {<label>: <number from 0 to 1>, ...}}, with one score for each of '
        f"these labels and no others: {names}."
    )
    head = clf.prompt.strip() or f"You are the {classifier_id!r} classifier."
    return [
        {"role": "system", "content": f"{head}\n\n{contract}"},
        {"role": "user", "content": text},
    ]


def parse_classifier_reply(clf: Classifier, reply_text: str) -> dict[str, float]:
    """``{"scores": {label: number in [0, 1]}}`` with exactly the classifier's labels; raise
    ValueError otherwise."""
    obj = _json_object(reply_text)
    if set(obj) != {"scores"}:
        raise ValueError(f"expected exactly the key scores, got {sorted(obj)}")
    scores = obj["scores"]
    if not isinstance(scores, dict):
        raise ValueError("scores must be an object")
    missing = [lab for lab in clf.labels if lab not in scores]
    extra = sorted(set(scores) - set(clf.labels))
    if missing or extra:
        raise ValueError(f"labels do not match: missing {missing}, unexpected {extra}")
    out: dict[str, float] = {}
    for lab in clf.labels:
        v = scores[lab]
        if not _is_number(v) or not 0.0 <= v <= 1.0:
            raise ValueError(f"score of {lab!r} must be a number in [0, 1], got {v!r}")
        out[lab] = float(v)
    return out


# --------------------------------------------------------------------------------------------
# Residency


@dataclass(frozen=True)
class Floor:
    floor: int  # distinct local llm candidates over all policies (union, not sum)
    per_policy: dict[str, int]  # per policy: its distinct local candidates
    unresolved: list[tuple[str, str]]  # (policy, candidate) not registered: counted as local


def candidate_floor(policies: Mapping[str, Policy], models: Mapping[str, ModelInfo]) -> Floor:
    """How many local LLMs must be resident at once for every policy to have all its candidates
    loaded. Remote and embedding candidates count toward nothing. A candidate that is not (or no
    longer) registered is counted as local: shrinking the floor silently would let the pool
    evict what a policy is about to need; it is listed so the operator sees it."""
    union: set[str] = set()
    per: dict[str, int] = {}
    unresolved: list[tuple[str, str]] = []
    for pname, policy in policies.items():
        mine: set[str] = set()
        for cand in policy.candidates:
            info = models.get(cand)
            if info is None:
                if cand not in mine:
                    unresolved.append((pname, cand))
            elif info.remote or info.type != "llm":
                continue
            mine.add(cand)
        per[pname] = len(mine)
        union |= mine
    return Floor(len(union), per, unresolved)


def helper_models(policies: Mapping[str, Policy]) -> set[str]:
    """Every routing helper (router and classifier models) that any policy references."""
    out: set[str] = set()
    for policy in policies.values():
        if policy.router is not None:
            out.add(policy.router.model)
        out.update(c.model for c in policy.classifiers.values())
    return out
