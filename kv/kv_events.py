"""KV events: what a replica's KV cache did to which block, in order, so that a router can
keep an exact index of what each replica holds (router/routing/kv_index.py) instead of
guessing from periodic snapshots.

    stored(hashes, tier)          the tier now holds these chained block hashes
    removed(hashes, tier)         it no longer does (evicted, discarded, failed its checks)
    moved(hashes, source, dest)   one step took them out of `source` into `dest` (the
                                  device pool's evicted blocks copied down to the host tier)
    cleared()                     every tier forgot everything (a prefix-cache reset)

Tiers: DEVICE (the block pool), HOST (kv/host_tier.py), DISK (kv/disk_tier.py, the local
one; the shared store is never reported: every replica reads it alike).

Recording is one append per block (`KVEventLog`), on the thread that changed the block
(the engine's; the disk writer's for disk entries): a deque, whose appends and pops are
atomic, so the engine thread drains it without a lock. `drain()` folds consecutive
records of the same kind and tier into one event: a step that caches 40 blocks is one
`stored` event of 40 hashes. The replica numbers the drained events as one batch per
step (worker/kvcache/event_stream.py); the sequence number is the batch's, not the event's.

Pure Python: the router imports this module too.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass

DEVICE = "device"
HOST = "host"
DISK = "disk"
TIERS = (DEVICE, HOST, DISK)

STORED = "stored"
REMOVED = "removed"
MOVED = "moved"
CLEARED = "cleared"
KINDS = (STORED, REMOVED, MOVED, CLEARED)


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: str
    block_hashes: tuple[int, ...] = ()
    tier: str = DEVICE  # stored, removed: the tier; moved: where from; cleared: unused
    to_tier: str = ""  # moved: where to

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KV event kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != CLEARED and self.tier not in TIERS:
            raise ValueError(f"KV event tier must be one of {TIERS}, got {self.tier!r}")
        if self.kind == MOVED and (self.to_tier not in TIERS or self.to_tier == self.tier):
            raise ValueError(f"a moved event needs a destination tier other than {self.tier!r}")


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One step's events of one replica, `seq` = the previous batch's + 1 (from 1)."""

    seq: int
    events: tuple[KVEvent, ...]


class KVEventLog:
    """Where the block pool and the tiers record what they did; drained once per step."""

    def __init__(self) -> None:
        # (kind, tier, to_tier, block hash or None for cleared), in the order they happened.
        self._records: deque[tuple[str, str, str, int | None]] = deque()

    def __len__(self) -> int:
        return len(self._records)

    def stored(self, block_hash: int, tier: str) -> None:
        self._records.append((STORED, tier, "", block_hash))

    def removed(self, block_hash: int, tier: str) -> None:
        self._records.append((REMOVED, tier, "", block_hash))

    def moved(self, block_hash: int, source: str, dest: str) -> None:
        self._records.append((MOVED, source, dest, block_hash))

    def cleared(self) -> None:
        self._records.append((CLEARED, "", "", None))

    def evicted_to_host(self, evicted: list[tuple[int, int]], host: Container[int]) -> None:
        """Device blocks (hash, block id) the pool handed out again: each moves down to the
        host tier, or is only removed from the device where the host holds it already."""
        for block_hash, _ in evicted:
            if block_hash in host:
                self.removed(block_hash, DEVICE)
            else:
                self.moved(block_hash, DEVICE, HOST)

    def drain(self) -> list[KVEvent]:
        """Everything recorded so far, runs of one kind and tier folded into one event."""
        records = self._records
        events: list[KVEvent] = []
        key: tuple[str, str, str] | None = None
        hashes: list[int] = []
        for _ in range(len(records)):  # what is there now; later appends wait for the next drain
            kind, tier, to_tier, block_hash = records.popleft()
            if (kind, tier, to_tier) != key or kind == CLEARED:
                if key is not None:
                    events.append(_event(key, hashes))
                key, hashes = (kind, tier, to_tier), []
            if block_hash is not None:
                hashes.append(block_hash)
        if key is not None:
            events.append(_event(key, hashes))
        return events


def _event(key: tuple[str, str, str], hashes: list[int]) -> KVEvent:
    kind, tier, to_tier = key
    if kind == CLEARED:
        return KVEvent(CLEARED, (), DEVICE)
    return KVEvent(kind, tuple(hashes), tier, to_tier)
