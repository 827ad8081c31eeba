"""Residency: how many local LLMs the policies need resident at once (the candidate floor), and
which routing helpers they reference."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from residency.policies.schema import ModelInfo, Policy


@dataclass(frozen=True)
class Floor:
    floor: int  # distinct local llm candidates over all policies (union, not sum)
    per_policy: dict[str, int]  # per policy: its distinct local candidates
    unresolved: list[tuple[str, str]]  # (policy, candidate) not registered: counted as local
    candidates: frozenset[str] = frozenset()  # the union itself (what preload_candidates warms)


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
    return Floor(len(union), per, unresolved, frozenset(union))


def helper_models(policies: Mapping[str, Policy]) -> set[str]:
    """Every routing helper (router and classifier models) that any policy references."""
    out: set[str] = set()
    for policy in policies.values():
        if policy.router is not None:
            out.add(policy.router.model)
        out.update(c.model for c in policy.classifiers.values())
    return out
