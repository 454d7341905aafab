"""The router's own approximate record of which prompt prefixes it sent where.

SGLang's cache-aware router keeps a radix tree per worker of the text it routed there, and
llm-d's approximate prefix scorer an LRU index of block hashes per pod: neither asks the
engine. This is the same idea on kvserve's chained block hashes (kv.block_hash): block i's
hash names the whole prefix up to the end of block i, so a leading run of hashes present for
a replica is a prefix match, exactly as in a radix tree at block granularity.

Eviction is LRU per replica with a cap in blocks (SGLang: max_tree_size, evicting leaves
first). A chain is touched leaf-first, parent-last, so the parents of a live chain are
always newer than its leaves and eviction takes leaves first: a surviving hash always has
its whole prefix present.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from router.routing.types import ReplicaKey


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int) -> None:
        if max_blocks_per_replica <= 0:
            raise ValueError(f"max_blocks_per_replica must be > 0, got {max_blocks_per_replica}")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._by_replica: dict[ReplicaKey, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[ReplicaKey]] = {}

    def size(self, replica: ReplicaKey) -> int:
        """Blocks recorded for `replica` (SGLang: the worker's tree size)."""
        lru = self._by_replica.get(replica)
        return len(lru) if lru is not None else 0

    def insert(self, replica: ReplicaKey, hashes: Sequence[int]) -> None:
        """Record that `replica` now holds this chain (touching it if it already did)."""
        lru = self._by_replica.setdefault(replica, OrderedDict())
        for h in reversed(hashes):  # leaf first, root last: the root is the newest
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(replica)
        while len(lru) > self.max_blocks_per_replica:
            old, _ = lru.popitem(last=False)
            holders = self._holders[old]
            holders.discard(replica)
            if not holders:
                del self._holders[old]

    def match(self, hashes: Sequence[int], replicas: Sequence[ReplicaKey]) -> dict[ReplicaKey, int]:
        """Leading blocks of `hashes` recorded for each of `replicas` (0 if none)."""
        depth = dict.fromkeys(replicas, 0)
        live = set(replicas)
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            live &= holders
            if not live:
                break
            for r in live:
                depth[r] = i + 1
        return depth

    def forget(self, replica: ReplicaKey) -> None:
        """The replica is gone: drop everything recorded for it."""
        lru = self._by_replica.pop(replica, None)
        for h in lru or ():
            holders = self._holders[h]
            holders.discard(replica)
            if not holders:
                del self._holders[h]
