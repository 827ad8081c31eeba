"""What ``llm_pool_autosize`` does to the LLM limit, and how that is told (pure).

Autosize raises the LLM limit to the router policies' local candidate floor so a policy that
alternates between its candidates never reloads on every switch. That lifts the memory cap an
admin set with ``max_loaded_models``, so it is always visible (/health, metrics, this advisory)
and reversible (``llm_pool_autosize=false`` or ``auto_evict=true``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from residency.policies import Floor
from residency.pool.decide import effective_limit
from residency.settings import Settings

#: Version of the config semantics: 2 = autosize raises the LLM pool to the candidate floor.
#: A data dir last run with an older version gets a one-time notice when it starts in the risky
#: state (see Coordinator.on_lead).
CONFIG_VERSION = 2


@dataclass(frozen=True)
class Autosize:
    enabled: bool
    configured: int
    floor: Floor
    effective: int
    auto_evict: bool

    @property
    def exceeds(self) -> bool:
        """The effective LLM limit is above what the admin configured."""
        return self.configured != -1 and self.effective > self.configured

    @property
    def risky(self) -> bool:
        """Above the configured cap with no memory backstop: the state that is warned about."""
        return self.exceeds and not self.auto_evict

    def advisory(self) -> str | None:
        if not self.exceeds:
            return None
        return (
            f"LLM pool is above max_loaded_models={self.configured}: llm_pool_autosize raises "
            f"it to {self.effective}, the number of distinct local candidates of the router "
            "policies, so switching between them never reloads; this can use more memory than "
            "max_loaded_models allows. Set llm_pool_autosize=false to restore a hard cap, or "
            "auto_evict=true for a memory backstop."
        )

    def health(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "candidate_floor": self.floor.floor,
            "policies": dict(sorted(self.floor.per_policy.items())),
            "exceeds_max_loaded_models": self.exceeds,
            "advisory": self.advisory(),
        }


def autosize(s: Settings, floor: Floor) -> Autosize:
    configured = s.pool.max_loaded_models
    eff = effective_limit(configured, s.pool.llm_pool_autosize, floor.floor)
    return Autosize(s.pool.llm_pool_autosize, configured, floor, eff, s.pool.auto_evict)
