"""The memory ledger of one decision pass: what each device holds and may hold, in bytes and in
models, updated as the pass plans loads and evictions.

Pure: built from a snapshot's values by ``residency.pool.decide``. A device without a budget (its
total memory unknown and no ``[worker] device_budget_mb``) takes any load: only the count
limits bound it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Where = tuple[str, str]  # (host, device)


@dataclass
class Room:
    budgets: dict[Where, int | None] = field(default_factory=dict)
    # Bytes of each resident (loading, ready or draining) and of each load planned in this pass.
    held: dict[Where, dict[str, int]] = field(default_factory=dict)
    # Residents on their way out (draining, or chosen for eviction in this pass): their bytes
    # are still held, but will be free without evicting anyone else.
    going: set[str] = field(default_factory=set)
    per_host: dict[str, int] = field(default_factory=dict)

    def device(self, host: str, device: str, budget: int | None) -> None:
        self.budgets[(host, device)] = budget
        self.held.setdefault((host, device), {})

    def add(self, host: str, device: str, model: str, n_bytes: int) -> None:
        self.held.setdefault((host, device), {})[model] = n_bytes
        self.per_host[host] = self.per_host.get(host, 0) + 1

    def release(self, model: str) -> None:
        """``model`` leaves (its eviction was planned, or it drains): its bytes free soon."""
        self.going.add(model)

    def used(self, where: Where) -> int:
        return sum(self.held.get(where, {}).values())

    def freeing(self, where: Where) -> int:
        return sum(b for m, b in self.held.get(where, {}).items() if m in self.going)

    def free(self, where: Where) -> int | None:
        """Bytes a load may take there now; None: no byte limit."""
        budget = self.budgets.get(where)
        return None if budget is None else budget - self.used(where)

    def fits(self, where: Where, need: int) -> bool:
        free = self.free(where)
        return free is None or need <= free

    def choose(
        self,
        candidates: Iterable[Where],
        need: Callable[[str], int],
        prefer: Where | None = None,
    ) -> Where | None:
        """Where a load goes: a device whose free bytes hold ``need(device)``. The device the
        model was last on first (its measured footprint and page cache are there), then the
        host and device with the fewest models, then the most free bytes."""
        fitting = [w for w in candidates if self.fits(w, need(w[1]))]
        if not fitting:
            return None

        def key(w: Where) -> tuple[Any, ...]:
            free = self.free(w)
            return (
                w != prefer,
                self.per_host.get(w[0], 0),
                len(self.held.get(w, {})),
                -(free if free is not None else 1 << 62),
                w,
            )

        return min(fitting, key=key)

    def report(self) -> list[dict[str, Any]]:
        """Each device's ledger, for ``/health``."""
        out = []
        for (host, device), budget in sorted(self.budgets.items()):
            held = self.held.get((host, device), {})
            used = sum(held.values())
            out.append(
                {
                    "host": host,
                    "device": device,
                    "budget_bytes": budget,
                    "used_bytes": used,
                    "free_bytes": None if budget is None else budget - used,
                    "models": dict(sorted(held.items())),
                }
            )
        return out
