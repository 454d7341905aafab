"""What a replica's KV tiers report about themselves, the same for the worker's tiers
(worker/kvcache/tiers.py TierManager) and the simulator's (cluster/sim/tiers.py): the tier
fields of KVStats, and the block hashes the router credits to each tier."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kv.host_tier import HostTier
    from kv.retention import SessionRetention


class RecentBlocks(Protocol):
    def __len__(self) -> int: ...

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` held block hashes, most recently used first."""
        ...


class TierReport:
    """Mixed into a tier manager that holds `host`, an optional `disk` and counts
    `num_loaded_blocks` (blocks brought back from any tier instead of recomputed)."""

    host: HostTier
    disk: RecentBlocks | None
    num_loaded_blocks: int
    # The pool's session retention (set by Engine.use_tiers; None: none).
    retention: SessionRetention | None = None

    def use_retention(self, retention: SessionRetention | None) -> None:
        """The pool's session retention: its blocks pushed down stay apart in the host tier,
        at most its share of the host tier's slots."""
        self.retention = retention
        if retention is not None:
            self.host.max_kept = int(retention.max_share * self.host.num_slots)

    def keep_retained(self) -> None:
        """After an offload: the paused sessions' blocks it moved down stay apart from the
        host tier's ordinary LRU (kv/host_tier.py protect)."""
        retention = self.retention
        if retention is not None and retention.moved_down:
            self.host.protect(retention.moved_down)
            retention.moved_down.clear()

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
