"""One GPU budget shared by every model's pools.

Each pool asks for `wanted` replicas of `gpus_per_replica` GPUs each (tensor parallelism)
and keeps at least `minimum`. When all that is wanted fits the budget, every pool gets it.
When it does not:

  1. every pool gets its minimum (a minimum is never cut, even past the budget);
  2. priority levels are served highest first: a level whose extra replicas all fit gets
     them all, and the rest of the budget moves to the next level;
  3. inside the first level that does not fit, replicas go one at a time to the pool whose
     granted / wanted fraction is lowest (ties: the pool listed first), while one fits, so
     the pools of a level, and a disaggregated model's prefill and decode pools, are cut by
     the same fraction and keep their ratio;
  4. levels below get their minimum only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolDemand:
    model: str
    role: str
    wanted: int
    minimum: int = 0
    gpus_per_replica: float = 1.0
    priority: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.role


def share_budget(demands: Sequence[PoolDemand], budget_gpus: float | None) -> dict[tuple[str, str], int]:
    """Replicas granted to each pool ((model, role) -> replicas)."""
    granted = {d.key: max(d.wanted, d.minimum) for d in demands}
    if budget_gpus is None or sum(granted[d.key] * d.gpus_per_replica for d in demands) <= budget_gpus + 1e-9:
        return granted
    granted = {d.key: d.minimum for d in demands}
    left = budget_gpus - sum(d.minimum * d.gpus_per_replica for d in demands)
    for priority in sorted({d.priority for d in demands}, reverse=True):
        level = [d for d in demands if d.priority == priority and d.wanted > d.minimum]
        extra = sum((d.wanted - d.minimum) * d.gpus_per_replica for d in level)
        if extra <= left + 1e-9:
            for d in level:
                granted[d.key] = d.wanted
            left -= extra
            continue
        while True:
            open_pools = [d for d in level if granted[d.key] < d.wanted and d.gpus_per_replica <= left + 1e-9]
            if not open_pools:
                break
            pick = min(open_pools, key=lambda d: granted[d.key] / d.wanted)
            granted[pick.key] += 1
            left -= pick.gpus_per_replica
        break  # the budget is spent: lower levels keep their minimum
    return granted


class FleetBudget:
    """The latest demand of every planned pool sharing one budget (one per Serve controller
    process, one per simulated fleet), and what the budget grants each as it asks."""

    def __init__(self, budget_gpus: float | None = None) -> None:
        self.budget_gpus = budget_gpus
        self.demands: dict[tuple[str, str], PoolDemand] = {}

    def grant(self, demand: PoolDemand, budget_gpus: float | None = None) -> int:
        """Replicas granted to `demand`'s pool, the others' latest demands standing;
        `budget_gpus` (the pool's own setting) wins over the fleet's."""
        self.demands[demand.key] = demand
        budget = budget_gpus if budget_gpus is not None else self.budget_gpus
        return share_budget(list(self.demands.values()), budget)[demand.key]
