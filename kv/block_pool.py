"""The block pool: fixed-size KV blocks, reference counts and an LRU prefix cache.

Pure bookkeeping (no torch): block ids index the KV tensors owned elsewhere.

Invariants:
- every block is either in use (ref_count > 0) or free (ref_count == 0): in the free queue,
  or, retained for a session (block.retained set), in the retention's queue, which is
  handed out only once the free queue is empty (kv/retention.py);
- a free block may still hold a cached full block (block_hash set); it stays findable
  through `cached` until it is handed out again, which evicts it;
- the free queue is ordered by eviction priority: the head is evicted first. Freed blocks
  go to the tail, so the least recently used cached block is evicted first;
- blocks never handed out are the queue's head, in id order, and exist only as a count
  until handed out (a pool of tens of thousands of blocks is built per engine, and per
  simulated replica in every simulator run: linking them all up front would be work
  proportional to the pool at every build, for blocks a short run may never touch).
All operations are O(1) per block (doubly linked free queue, dict for the cache).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from typing import TYPE_CHECKING

from kv.kv_events import DEVICE, KVEventLog

if TYPE_CHECKING:
    from kv.retention import RetainedTurn, SessionRetention


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "prev", "next", "retained")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        # The session turn that retains it (kv/retention.py's RetainedTurn), or None.
        self.retained: RetainedTurn | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop-front, append and remove-from-middle,
    behind a head of `num_untouched` blocks never handed out (ids first_untouched.., made
    by `make_block` when popped; they are never removed from the middle: only cached
    blocks are, and an untouched block caches nothing)."""

    def __init__(self, blocks: Iterable[Block], num_untouched: int = 0, first_untouched: int = 0,
                 make_block: Callable[[int], Block] = Block) -> None:
        self._head = Block(-1)  # sentinels: never handed out
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)
        self.num_untouched = num_untouched
        self._next_untouched = first_untouched
        self._make_block = make_block
        self.num_free += num_untouched

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def push_front(self, block: Block) -> None:
        """Insert `block` where it is evicted next (after the untouched blocks)."""
        first = self._head.next
        assert first is not None
        self._head.next = block
        block.prev = self._head
        block.next = first
        first.prev = block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not free"
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def pop_front(self) -> Block:
        if self.num_untouched:
            block = self._make_block(self._next_untouched)
            self._next_untouched += 1
            self.num_untouched -= 1
            self.num_free -= 1
            return block
        block = self._head.next
        if block is None or block is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        """Eviction order, head first (for tests and debugging; O(n))."""
        ids = list(range(self._next_untouched, self._next_untouched + self.num_untouched))
        node = self._head.next
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: list[Block] = []  # handed out at least once, in id order
        self.free_queue = FreeBlockQueue((), num_untouched=num_blocks, make_block=self._make_block)
        self.cached: dict[int, Block] = {}  # block hash -> block holding that KV
        # Cache keys kept from the router, the tiers and the KV events: a KV group's salted
        # keys (kv/group_hits.py), which name one group's pages, not a prefix anyone else
        # can look up. Always a subset of `cached`'s keys.
        self.private: set[int] = set()
        self.num_evictions = 0
        # With KV tiers below the device (kv/host_tier.py): every cached block handed out
        # again is recorded here as (block hash, block id), in eviction order, so that its
        # KV can be copied down before the step that overwrites it runs. The owner drains
        # it after each schedule; None records nothing.
        self.evicted: list[tuple[int, int]] | None = None
        # With a store shared by replicas: every block newly registered in the cache, as
        # (block hash, block id), for the owner to publish once its KV is computed.
        self.stored: list[tuple[int, int]] | None = None
        # KV events for the router's index (kv/kv_events.py): blocks cached, evicted and
        # the cache cleared. An evicted block recorded in `evicted` is reported by the
        # tiers instead (moved down, or removed when the host tier has it already).
        self.events: KVEventLog | None = None
        # Sessions' retained blocks (kv/retention.py): a second free queue, handed out only
        # when `free_queue` is empty. None: no retention.
        self.retention: SessionRetention | None = None

    def _make_block(self, block_id: int) -> Block:
        if block_id < len(self._blocks):  # made already by `blocks`
            return self._blocks[block_id]
        assert block_id == len(self._blocks), "untouched blocks are handed out in id order"
        block = Block(block_id)
        self._blocks.append(block)
        return block

    @property
    def blocks(self) -> list[Block]:
        """Every block, by id (tests and debugging: it makes the untouched ones; they
        stay untouched in the free queue)."""
        while len(self._blocks) < self.num_blocks:
            self._blocks.append(Block(len(self._blocks)))
        return self._blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included
        (retained ones too: kv/retention.py)."""
        retention = self.retention
        return self.free_queue.num_free + (retention.queue.num_free if retention is not None else 0)

    # -- allocation ------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[Block]:
        """Hand out `num_blocks` fresh blocks (evicting cached ones, LRU first)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        queue, retention = self.free_queue, self.retention
        for _ in range(num_blocks):
            # Retained blocks go last: only when no ordinary free block is left.
            block = queue.pop_front() if queue.num_free or retention is None else retention.pop_for_pressure()
            # A block whose session's TTL ran out is dropped, not moved down (kv/retention.py).
            drop = retention is not None and (retention.expired or retention.displaced) and retention.handed_out(block)
            self._evict(block, move_down=not drop)
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free queue's
        tail in the given order (so pass a sequence's blocks tail-first: its last blocks,
        the least likely to be shared, are then evicted first)."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.retained is not None:
                    self.retention.queue.append(block)  # type: ignore[union-attr]
                else:
                    self.free_queue.append(block)

    # -- prefix cache ----------------------------------------------------------------
    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits (a free cached block leaves the free queue)."""
        for block in blocks:
            if block.ref_count == 0:
                if block.retained is not None:
                    self.retention.queue.remove(block)  # type: ignore[union-attr]
                else:
                    self.free_queue.remove(block)
                    retention = self.retention
                    if retention is not None and (retention.expired or retention.displaced):
                        retention.hit(block)  # hit after its TTL or displacement: an ordinary block again
            block.ref_count += 1

    def cache_block(self, block: Block, block_hash: int, private: bool = False) -> bool:
        """Register a full, computed block under its hash. Returns False when another
        block already holds that hash (two sequences computed the same block at once):
        the first stays the cached copy, this one is freed normally later. `private`: a
        key only this pool looks up (no event, never reported or moved down a tier)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if private:
            self.private.add(block_hash)
            return True
        if self.stored is not None:
            self.stored.append((block_hash, block.block_id))
        if self.events is not None:
            self.events.stored(block_hash, DEVICE)
        return True

    def _evict(self, block: Block, record: bool = True, move_down: bool = True) -> None:
        if block.block_hash is not None:
            if self.private and block.block_hash in self.private:
                self.private.discard(block.block_hash)
                record = False
            if record and move_down and self.evicted is not None:
                self.evicted.append((block.block_hash, block.block_id))
            elif record and self.events is not None:
                self.events.removed(block.block_hash, DEVICE)
            del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (a clear, not an eviction: nothing moves down)."""
        if self.retention is not None:
            self.retention.clear()
        for block in list(self.cached.values()):
            self._evict(block, record=False)
        self.private.clear()
        if self.events is not None:
            self.events.cleared()
