"""What a replica's KV tiers report about themselves, the same for the worker's tiers
(worker/kvcache/tiers.py TierManager) and the simulator's (cluster/sim/tiers.py): the tier
fields of KVStats, and the block hashes the router credits to each tier."""
from __future__ import annotations

from typing import Protocol


class RecentBlocks(Protocol):
    def __len__(self) -> int: ...

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` held block hashes, most recently used first."""
        ...


class TierReport:
    """Mixed into a tier manager that holds `host`, an optional `disk` and counts
    `num_loaded_blocks` (blocks brought back from any tier instead of recomputed)."""

    host: RecentBlocks
    disk: RecentBlocks | None
    num_loaded_blocks: int

    def stats(self) -> dict[str, int]:
        """KVStats' tier fields."""
        return {
            "num_host_blocks": len(self.host),
            "num_disk_blocks": len(self.disk) if self.disk is not None else 0,
            "num_tier_loaded_blocks": self.num_loaded_blocks,
        }

    def routing_hashes(self, limit: int) -> tuple[list[int], list[int]]:
        """What the router credits (RoutingStats' host and disk hashes): up to `limit`
        hashes of the host tier and of the local disk, most recent first. A shared store
        is left out: every replica reads it alike, so it tells replicas apart by nothing."""
        disk = self.disk.recent_hashes(limit) if self.disk is not None else []
        return self.host.recent_hashes(limit), disk
