"""Rule evaluation: a rules policy and a routing input into a decision with a JSON-able trace.

Calling a classifier helper model is the caller's job: ``evaluate`` takes a ``classify``
callable, and a failing classifier makes its leaf false, never the request fail.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from residency.policies import regex
from residency.policies.routing_input import RoutingInput
from residency.policies.schema import DEFAULT_RULE, Policy, Rule, is_number

# Only A-Z fold to a-z: Lemonade folds ASCII only, and full Unicode case folding would make
# matching locale-like and surprising ("ß" vs "ss", Turkish dotless i). Non-ASCII letters
# therefore compare exactly: "É" does not match "é".
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def ascii_lower(s: str) -> str:
    """Lowercase A-Z only; every other character is left as it is."""
    return s.translate(_ASCII_LOWER)


Classify = Callable[[str, str], Mapping[str, float]]  # (classifier id, text) -> {label: score}


@dataclass(frozen=True)
class Decision:
    candidate: str  # the first listed: what ``choose = "first"`` takes
    rule: str  # the matched rule id, "router", or "default"
    used_default: bool
    trace: dict[str, Any]
    # The candidates the rule, the default or the router named, in preference order (what
    # ``choose = "fastest"`` picks among); left out, just ``candidate``.
    listed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "listed", tuple(self.listed) or (self.candidate,))


class _Eval:
    """One evaluate() call: the input, the classifier cache, and what the trace collects."""

    def __init__(self, inp: RoutingInput, classify: Classify | None) -> None:
        self.inp = inp
        self.classify = classify
        self._folded: str | None = None
        self._capped: bytes | None = None
        self._scores: dict[str, dict[str, Any] | None] = {}
        self.errors: list[dict[str, Any]] = []
        self.conditions: list[dict[str, Any]] = []
        self.rule = ""

    @property
    def folded(self) -> str:
        if self._folded is None:
            self._folded = ascii_lower(self.inp.text)
        return self._folded

    @property
    def capped(self) -> bytes:
        """The text as regex leaves see it, encoded and capped once per evaluation."""
        if self._capped is None:
            self._capped = regex.subject(self.inp.text)
        return self._capped

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
            ok = regex.search(v, self.capped)
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
        if not is_number(raw) or not 0.0 <= raw <= 1.0:
            err = f"no score in [0, 1] for label {label!r} (got {raw!r})"
            self.errors.append({"rule": self.rule, "path": path, "classifier": cid, "error": err})
            rec["error"] = err
            return False
        score = float(raw)
        rec["score"] = score
        return lo <= score <= hi


def make_trace(
    name: str,
    candidate: str,
    rule: str,
    used_default: bool,
    *,
    listed: Sequence[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    t: dict[str, Any] = {
        "policy": name,
        "candidate": candidate,
        "listed": list(listed) or [candidate],
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
        listed, rid, used_default = policy.default_listed, DEFAULT_RULE, True
    else:
        listed, rid, used_default = chosen.listed, chosen.id, False
    cand = listed[0]
    trace = make_trace(
        name, cand, rid, used_default, listed=listed, rules=rules_trace, errors=ev.errors
    )
    return Decision(cand, rid, used_default, trace, listed)
