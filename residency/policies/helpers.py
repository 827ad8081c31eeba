"""Routing helpers, the small local LLMs a policy may ask: the prompts sent to an LLM router and
to LLM classifiers, and the strict parsing of their JSON replies (anything else falls back)."""

from __future__ import annotations

import json
import re
from typing import Any

from residency.policies.match import Decision, make_trace
from residency.policies.routing_input import RoutingInput
from residency.policies.schema import DEFAULT_RULE, ROUTER_RULE, Classifier, Policy, is_number


def router_messages(name: str, policy: Policy, inp: RoutingInput) -> list[dict[str, str]]:
    """The chat messages for the routing helper. The caller sends them with temperature 0,
    ``max_tokens=policy.router.max_tokens`` and ``response_format={"type": "json_object"}``."""
    if policy.router is None:
        raise ValueError(f"policy {name!r} has no LLM router")
    names = ", ".join(json.dumps(c) for c in policy.candidates)
    if policy.choose == "fastest":
        # A list lets the box take whichever of equally good candidates answers soonest.
        contract = (
            "Answer with exactly one JSON object and nothing else, of the form "
            '{"model": <name or list of names>, "rationale": <reason>}. "model" must be '
            f"exactly one of these names: {names}, or, when several fit equally well, a list "
            'of them in preference order. "rationale" is a short, non-empty reason for the '
            "choice."
        )
    else:
        contract = (
            "Answer with exactly one JSON object and nothing else, of the form "
            '{"model": <name>, "rationale": <reason>}. "model" must be exactly one of these '
            f'names: {names}. "rationale" is a short, non-empty reason for the choice.'
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


def _parse_router_reply(policy: Policy, reply_text: str) -> tuple[tuple[str, ...], str]:
    """The candidates the reply lists (a name is a list of one) and its rationale. A list is
    taken whatever ``choose`` says (a ``first`` policy takes its first): a helper that hedges
    still answered."""
    obj = _json_object(reply_text)
    if set(obj) != {"model", "rationale"}:
        raise ValueError(f"expected exactly the keys model and rationale, got {sorted(obj)}")
    model, rationale = obj["model"], obj["rationale"]
    if isinstance(model, list) and model:
        listed = tuple(model)
    elif isinstance(model, str):
        listed = (model,)
    else:
        raise ValueError(f"model {model!r} is not a candidate name or a non-empty list of them")
    for m in listed:
        if not isinstance(m, str) or m not in policy.candidates:
            raise ValueError(f"model {m!r} is not one of the candidates")
    if len(set(listed)) != len(listed):
        raise ValueError(f"model {model!r} lists a candidate twice")
    if not isinstance(rationale, str) or not rationale.strip():
        raise ValueError("rationale must be a non-empty string")
    return listed, rationale


def router_decision(
    name: str, policy: Policy, reply_text: str | None, error: str | None = None
) -> Decision:
    """The decision from the routing helper's reply. Anything but an exact
    ``{"model", "rationale"}`` object naming a candidate (or a list of distinct ones) falls
    back to the default."""
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
            listed, rationale = _parse_router_reply(policy, reply_text)
        except ValueError as e:
            error = f"bad reply: {e}"
        else:
            info["rationale"] = rationale
            trace = make_trace(name, listed[0], ROUTER_RULE, False, listed=listed, router=info)
            return Decision(listed[0], ROUTER_RULE, False, trace, listed)
    info["error"] = error
    listed = policy.default_listed
    trace = make_trace(
        name,
        listed[0],
        DEFAULT_RULE,
        True,
        listed=listed,
        router=info,
        errors=[{"router": policy.router.model, "error": error}],
    )
    return Decision(listed[0], DEFAULT_RULE, True, trace, listed)


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
        if not is_number(v) or not 0.0 <= v <= 1.0:
            raise ValueError(f"score of {lab!r} must be a number in [0, 1], got {v!r}")
        out[lab] = float(v)
    return out
