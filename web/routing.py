"""Routing a request for a policy (a virtual model name) to one of its candidates.

The decision itself is pure (``residency.policies``); this module supplies what it needs from
the outside — calls to routing-helper models (an LLM router, classifiers) through the same bus
as any request — and records what was decided (metrics, the conversation-switch counter).

A helper call is part of its request: it runs only once the request was admitted against its
caller's quotas (a caller refused 429 makes no helper generate), and as the caller's — counted
under its user and API key (usage, tokens per day), with its fair-queueing weight and within
the request's deadline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import Counter

from residency import keys, policies, prompt_size, route_view, route_wait
from residency.auth import ANONYMOUS, Principal
from residency.errors import ApiError
from residency.messages import Kind
from residency.policy_store import PolicyEntry
from residency.registry import Entry
from residency.settings import Settings
from web import bus
from web.state import State

log = logging.getLogger(__name__)

#: A helper call is part of one request's routing, so it gets a shorter leash than a request.
HELPER_TIMEOUT_S = 60.0

DECISIONS = Counter(
    "residency_routing_decisions_total",
    "Routing decisions by policy and matched rule (or default, router)",
    ["policy", "rule"],
)
SWITCHES = Counter(
    "residency_routing_switches_total",
    "Conversations whose routed candidate changed since their previous turn",
    ["policy"],
)
CHOICES = Counter(
    "residency_routing_choices_total",
    "Candidates chosen among a rule's listed ones, by policy, candidate and why it won",
    ["policy", "candidate", "reason"],
)


@dataclass(frozen=True)
class Routed:
    """A routed request: the policy's decision (its ``candidate`` the one chosen among those
    listed), how the choice was made (None when nothing local was listed to predict), and what
    the choice measured of the request (its conversation digest and prompt bytes), which
    ``record`` keeps."""

    decision: policies.Decision
    choice: route_wait.Choice | None = None
    digest: str | None = None
    prompt_bytes: int = 0

    @property
    def prediction(self) -> route_wait.Prediction | None:
        return self.choice.chosen() if self.choice is not None else None


def call_helper(
    st: State,
    s: Settings,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    caller: Principal = ANONYMOUS,
    deadline_at: float = 0.0,
) -> str:
    """Ask a routing helper (a local LLM in the helper pool) and return its reply text. The
    call is the request's ``caller``'s: counted under its user and key, queued with its
    weight, finished by the request's deadline (``deadline_at``, 0 = none), and without its
    ``may_load`` it never loads a helper that is not resident (the routing then falls back as
    for any failure)."""
    call = bus.submit(
        st.r,
        st.scripts,
        kind=Kind.CHAT,
        model=model,
        params={
            "messages": messages,
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "response_format": {"type": "json_object"},
        },
        stream=False,
        bound=s.pool.max_queue_per_model,
        timeout_s=min(HELPER_TIMEOUT_S, s.server.request_timeout_s),
        deadline_at=deadline_at,
        fair=s.pool.fair_queues,
        user=caller.user or "",
        key=caller.key_id or "",
        may_load=caller.may_load,
        weight=caller.weight,
        cache_scope=s.cache.scope,
    )
    out = call.result()
    return str(out["choices"][0]["message"].get("content") or "")


def routing_input(kind: Kind, body: Mapping[str, Any]) -> policies.RoutingInput:
    if kind is Kind.CHAT:
        return policies.RoutingInput.from_chat(body)
    return policies.RoutingInput.from_completion(body)


def decide(
    st: State,
    s: Settings,
    name: str,
    policy: policies.Policy,
    inp: policies.RoutingInput,
    *,
    caller: Principal = ANONYMOUS,
    deadline_at: float = 0.0,
) -> policies.Decision:
    """The candidate for this request. A failing helper never fails the request: the router
    falls back to the default, and a failing classifier leaf counts as no match."""
    if policy.router is not None:
        router = policy.router
        try:
            reply = call_helper(
                st,
                s,
                router.model,
                policies.router_messages(name, policy, inp),
                router.max_tokens,
                caller=caller,
                deadline_at=deadline_at,
            )
        except ApiError as e:
            return policies.router_decision(name, policy, None, error=e.message)
        return policies.router_decision(name, policy, reply)

    def classify(clf_id: str, text: str) -> Mapping[str, float]:
        clf = policy.classifiers[clf_id]
        messages = policies.classifier_messages(clf_id, clf, text)
        reply = call_helper(st, s, clf.model, messages, 256, caller=caller, deadline_at=deadline_at)
        return policies.parse_classifier_reply(clf, reply)

    return policies.evaluate(name, policy, inp, classify)


def conversation_digest(body: Mapping[str, Any]) -> str | None:
    """A conversation is its system prompt plus its first user message (what stays the same
    from turn to turn); None for requests without messages."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return None
    system = next((m for m in msgs if isinstance(m, dict) and m.get("role") == "system"), {})
    first = next((m for m in msgs if isinstance(m, dict) and m.get("role") == "user"), None)
    if first is None:
        return None
    raw = json.dumps([system.get("content"), first.get("content")], sort_keys=True, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def choose(
    st: State,
    s: Settings,
    name: str,
    policy: policies.Policy,
    decision: policies.Decision,
    body: Mapping[str, Any],
    *,
    caller: Principal,
    candidates: Mapping[str, Entry] | None = None,
) -> Routed:
    """Pick among the decision's listed candidates by the policy's ``choose``, predicting each
    local one's wait from one read of the pool (``residency.route_view``). ``candidates``: the
    policy's registry entries when the caller read them already (else they are read here)."""
    listed = decision.listed or (decision.candidate,)
    if candidates is None:
        candidates = st.entries(list(listed))
    specs = [(n, e.spec if (e := candidates.get(n)) else None) for n in listed]
    digest = conversation_digest(body)
    if not any(spec is not None and not spec.remote for _, spec in specs):
        # A remote or an unregistered candidate: nothing to predict.
        return Routed(decision, digest=digest)
    size = prompt_size.prompt_bytes(body)
    read = route_view.read(
        st.scripts,
        specs,
        user=caller.user or "",
        fair=s.pool.fair_queues,
        prefix_key=keys.route_prefix(caller.subject, digest or "-"),
        prompt_bytes=size,
        now=time.time(),
        caller=route_view.Caller(caller.may_use_model, caller.may_load),
        slot_cache=s.cache.disk_mb > 0,
    )
    choice = route_wait.choose(
        policy.choose,
        read.views,
        size,
        evict_penalty_s=policy.evict_penalty_s,
        max_wait_s=policy.max_wait_s,
    )
    trace = dict(decision.trace)
    trace["candidate"] = choice.candidate
    trace["choose"] = {
        "mode": policy.choose,
        "reason": choice.reason,
        "predictions": [p.trace() for p in choice.predictions],
    }
    chosen = replace(decision, candidate=choice.candidate, trace=trace)
    return Routed(chosen, choice, digest=digest, prompt_bytes=size)


def record(st: State, policy: str, routed: Routed, *, subject: str = keys.ANONYMOUS) -> None:
    """Count the decision, and remember who served this conversation: the switch counter, the
    policy's choices, and the prefix the chosen candidate now holds for this caller. One round
    trip."""
    decision = routed.decision
    DECISIONS.labels(policy, decision.rule).inc()
    reason = routed.choice.reason if routed.choice is not None else "first"
    CHOICES.labels(policy, decision.candidate, reason).inc()
    now = time.time()
    digest = routed.digest
    pipe = st.r.pipeline(transaction=False)
    field = f"{int(now // 60)}|{decision.candidate}|{reason}"
    pipe.hincrby(keys.route_choices(policy), field, 1)
    pipe.expire(keys.route_choices(policy), keys.ROUTE_SAMPLES_TTL_S)
    if digest is not None:
        pipe.set(
            keys.conversation(digest), decision.candidate, ex=keys.CONVERSATION_TTL_S, get=True
        )
        if routed.choice is not None:
            pipe.set(
                keys.route_prefix(subject, digest),
                json.dumps({decision.candidate: [now, routed.prompt_bytes]}),
                ex=keys.CONVERSATION_TTL_S,
            )
    res = pipe.execute()
    previous = res[2] if digest is not None else None
    if previous is not None and previous != decision.candidate:
        SWITCHES.labels(policy).inc()


def route(
    st: State,
    s: Settings,
    entry: PolicyEntry,
    kind: Kind,
    body: Mapping[str, Any],
    *,
    caller: Principal = ANONYMOUS,
    deadline_at: float = 0.0,
    candidates: Mapping[str, Entry] | None = None,
) -> Routed:
    """The candidate for a request of ``caller`` (already admitted against its quotas);
    ``candidates``: the policy's registry entries, when the caller read them already."""
    try:
        policy = policies.Policy.model_validate(entry.spec)
    except ValueError as e:
        log.error("policy %s does not parse: %s", entry.name, e)
        raise ApiError(500, f"policy '{entry.name}' is invalid", type="server_error") from e
    decision = decide(
        st,
        s,
        entry.name,
        policy,
        routing_input(kind, body),
        caller=caller,
        deadline_at=deadline_at,
    )
    routed = choose(st, s, entry.name, policy, decision, body, caller=caller, candidates=candidates)
    record(st, entry.name, routed, subject=caller.subject)
    return routed


def route_header(policy: str, routed: Routed) -> str:
    """``policy:rule:candidate``; a ``fastest`` choice among several listed candidates adds,
    after a ``;``, why the candidate won and each one's predicted wait (seconds; ``remote`` and
    excluded ones unpredicted)."""
    d = routed.decision
    head = f"{policy}:{d.rule}:{d.candidate}"
    choice = routed.choice
    if choice is None or choice.reason == "first" or len(choice.predictions) < 2:
        return head  # choose = "first": the header as it always was
    waits = " ".join(_header_wait(p) for p in choice.predictions)
    return f"{head}; {choice.reason}; {waits}"


def _header_wait(p: route_wait.Prediction) -> str:
    if p.excluded:
        return f"{p.name}=excluded({p.excluded})"
    if p.wait_s is None:
        return f"{p.name}=remote"
    extra = "+evicts" if p.penalty_s else ""
    return f"{p.name}={p.wait_s:.3f}s{extra}"
