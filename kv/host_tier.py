"""The host-memory KV tier: full prefix blocks evicted from the device pool, by chain hash.

One buffer allocated at start-up (pinned when the device is a GPU, so copies to and from
it can run asynchronously), cut into slots of one block each:

    buffer : (num_slots, layers, 2, block_size, Hkv, D)
    slots  : {block hash -> slot}, least recently used first

A put into a full tier pushes out its least recently used blocks; the caller receives
them (hash and a copy of their KV) to hand to the tier below, or to drop. Lookups are
plain dict reads; a hit refreshes the block's recency.

Kept blocks (kv/retention.py): a paused session's blocks pushed off the device under
pressure are `protect`ed here: held apart from the ordinary LRU, pushed out only once no
ordinary block is left, at most `max_kept` of the slots (the oldest kept block beyond it
becomes the next ordinary one pushed out). A kept block that is read goes back to the
ordinary LRU (its session's turn holds it on the device again).
Single-threaded: only the engine's thread calls it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from kv.kv_cache import KVCacheSpec, raw_view


class HostTier:
    def __init__(self, spec: KVCacheSpec, num_slots: int, pin_memory: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        shape = (num_slots, spec.num_layers, spec.num_planes, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.buffer = torch.zeros(shape, dtype=spec.dtype, pin_memory=pin_memory)
        self._slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU first
        self._kept: OrderedDict[int, int] = OrderedDict()  # protected hash -> slot, LRU first
        self.max_kept = num_slots // 2  # the retention's share of the slots, once one is set
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @classmethod
    def for_budget(cls, spec: KVCacheSpec, budget_bytes: int, pin_memory: bool = False) -> HostTier:
        return cls(spec, budget_bytes // spec.bytes_per_block, pin_memory)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots or block_hash in self._kept

    def __len__(self) -> int:
        return len(self._slots) + len(self._kept)

    def hashes(self) -> list[int]:
        """Held block hashes in push-out order: ordinary ones LRU first, then kept ones."""
        return list(self._slots) + list(self._kept)

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` held hashes: kept ones, then ordinary ones, most recently used first."""
        out = []
        for held in (self._kept, self._slots):
            for block_hash in reversed(held):
                if len(out) >= limit:
                    return out
                out.append(block_hash)
        return out

    def protect(self, block_hashes: Sequence[int]) -> None:
        """Keep these held blocks (a paused session's) apart from the ordinary LRU."""
        for block_hash in block_hashes:
            slot = self._slots.pop(block_hash, None)
            if slot is None:
                continue  # not held (pushed out already), or kept already
            self._kept[block_hash] = slot
            while len(self._kept) > self.max_kept:  # the oldest kept block is pushed out next
                old, old_slot = self._kept.popitem(last=False)
                self._slots[old] = old_slot
                self._slots.move_to_end(old, last=False)

    def put(self, block_hashes: Sequence[int], kv: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Store blocks given as (layers, 2, n * block_size, Hkv, D), block i's hash at
        block_hashes[i]. A hash held already only has its recency refreshed. Returns the
        blocks pushed out to make room: (hash, (layers, 2, block_size, Hkv, D) copy)."""
        pushed: list[tuple[int, torch.Tensor]] = []
        blocks = self._split(kv, len(block_hashes))
        rows: list[int] = []  # which of the given blocks are new here
        slots: list[int] = []  # and the slot each goes to
        for i, block_hash in enumerate(block_hashes):
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)
                continue
            if block_hash in self._kept:
                self._kept.move_to_end(block_hash)
                continue
            if len(rows) == self.num_slots:  # more new blocks than slots: the earliest pass through
                j = rows.pop(0)
                self._slots.pop(block_hashes[j])
                self._free_slots.append(slots.pop(0))
                pushed.append((block_hashes[j], blocks[j].to(self.buffer.device, copy=True)))
            if not self._free_slots:  # ordinary blocks go first, kept ones once none is left
                old_hash, slot = (self._slots if self._slots else self._kept).popitem(last=False)
                pushed.append((old_hash, self.buffer[slot].clone()))
                self._free_slots.append(slot)
            slot = self._free_slots.pop()
            self._slots[block_hash] = slot
            rows.append(i)
            slots.append(slot)
        if rows:  # one copy for all of them (from the device too), not one per block
            picked = blocks if len(rows) == len(block_hashes) else blocks[torch.tensor(rows)]
            raw_view(self.buffer).index_copy_(0, torch.tensor(slots), raw_view(picked.to(self.buffer.device)))
        return pushed

    def get(self, block_hashes: Sequence[int]) -> torch.Tensor:
        """The blocks' KV as (layers, 2, n * block_size, Hkv, D) (every hash must be held);
        a read refreshes their recency."""
        slots = []
        for block_hash in block_hashes:
            slot = self._kept.pop(block_hash, None)
            if slot is not None:  # read back: its session's turn holds it on the device again
                self._slots[block_hash] = slot
            else:
                slot = self._slots[block_hash]
                self._slots.move_to_end(block_hash)
            slots.append(slot)
        index = torch.tensor(slots, dtype=torch.long)
        picked = self.buffer.index_select(0, index)  # (n, layers, 2, bs, H, D)
        return self._join(picked)

    def discard(self, block_hash: int) -> bool:
        slot = self._slots.pop(block_hash, None)
        if slot is None:
            slot = self._kept.pop(block_hash, None)
        if slot is None:
            return False
        self._free_slots.append(slot)
        return True

    def clear(self) -> None:
        self._free_slots.extend(self._slots.values())
        self._free_slots.extend(self._kept.values())
        self._slots.clear()
        self._kept.clear()

    # (layers, 2, n * bs, H, D) <-> (n, layers, 2, bs, H, D)
    def _split(self, kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
        layers, two, _, heads, dim = kv.shape
        return kv.reshape(layers, two, num_blocks, self.spec.block_size, heads, dim).permute(2, 0, 1, 3, 4, 5)

    def _join(self, blocks: torch.Tensor) -> torch.Tensor:
        n, layers, two, bs, heads, dim = blocks.shape
        return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * bs, heads, dim)
