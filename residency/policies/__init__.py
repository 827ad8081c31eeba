"""Router policies: the policy language, one module per concern.

- ``schema``: what a policy is, and validation naming every problem by its dotted path;
- ``regex``: regex leaves on RE2 (linear-time matching), their limits and the capped text;
- ``routing_input``: what rules see of a request;
- ``match``: evaluating rules into a decision with a JSON-able trace;
- ``helpers``: the LLM router and LLM classifier prompts, and parsing their replies;
- ``floor``: the candidate floor and the set of routing helpers the policies reference.

It is pure on purpose (no Redis, no HTTP, no clock, no threads): the web tier, the coordinator
and the admin ``validate`` endpoint must all reach the same decision for the same input, and the
rules are then testable exhaustively without a running box. Calling a helper model is the
caller's job: ``evaluate`` takes a ``classify`` callable, and for an LLM-router policy the caller
sends ``router_messages`` to the helper and hands the reply to ``router_decision``.
"""

from residency.policies.floor import Floor, candidate_floor, helper_models
from residency.policies.helpers import (
    classifier_messages,
    parse_classifier_reply,
    router_decision,
    router_messages,
)
from residency.policies.match import Classify, Decision, ascii_lower, evaluate
from residency.policies.regex import (
    MAX_POLICY_REGEX_PROGRAM,
    MAX_REGEX_LEN,
    REGEX_INPUT_CAP,
    regex_problem,
)
from residency.policies.routing_input import RoutingInput
from residency.policies.schema import (
    CHOOSE,
    CLASSIFIER_ID_RE,
    COMBINATORS,
    DEFAULT_EVICT_PENALTY_S,
    DEFAULT_RULE,
    LEAVES,
    MATCH_KEYS,
    MAX_DEPTH,
    POLICY_NAME_RE,
    ROUTER_MAX_TOKENS_LIMIT,
    ROUTER_RULE,
    RULE_ID_RE,
    Choose,
    Classifier,
    ModelInfo,
    Policy,
    PolicyError,
    Router,
    Rule,
    as_listed,
    parse_policy,
)

__all__ = [
    "CHOOSE",
    "CLASSIFIER_ID_RE",
    "COMBINATORS",
    "DEFAULT_EVICT_PENALTY_S",
    "DEFAULT_RULE",
    "LEAVES",
    "MATCH_KEYS",
    "MAX_DEPTH",
    "MAX_POLICY_REGEX_PROGRAM",
    "MAX_REGEX_LEN",
    "POLICY_NAME_RE",
    "REGEX_INPUT_CAP",
    "ROUTER_MAX_TOKENS_LIMIT",
    "ROUTER_RULE",
    "RULE_ID_RE",
    "Choose",
    "Classifier",
    "Classify",
    "Decision",
    "Floor",
    "ModelInfo",
    "Policy",
    "PolicyError",
    "Router",
    "RoutingInput",
    "Rule",
    "as_listed",
    "ascii_lower",
    "candidate_floor",
    "classifier_messages",
    "evaluate",
    "helper_models",
    "parse_classifier_reply",
    "parse_policy",
    "regex_problem",
    "router_decision",
    "router_messages",
]
