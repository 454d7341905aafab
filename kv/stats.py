"""The headroom signal a worker reports: what its KV pool can still take."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVStats:
    total_blocks: int
    free_blocks: int  # includes cached blocks nobody references (evictable on demand)
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached
    num_cached_blocks: int = 0
    # KV tiers below the device (docs/kv-tiers.md): blocks held in the host tier and on the
    # local disk now, and blocks loaded back from any tier so far (0 without tiers).
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    num_tier_loaded_blocks: int = 0
    # Free blocks retained for paused sessions (kv/retention.py): part of free_blocks (they
    # are evicted, last, when a request needs them), so they take no headroom away.
    retained_blocks: int = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "total_blocks": self.total_blocks,
            "free_blocks": self.free_blocks,
            "block_size": self.block_size,
            "kv_usage": self.usage,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_cached_blocks": self.num_cached_blocks,
            "num_host_blocks": self.num_host_blocks,
            "num_disk_blocks": self.num_disk_blocks,
            "num_tier_loaded_blocks": self.num_tier_loaded_blocks,
            "retained_blocks": self.retained_blocks,
        }
