"""KV kept across tool pauses: a finished turn of a session keeps its prefix blocks, for a
bounded time and a bounded share of the pool, so that the session's next turn hits them.

A retained block is a cached, unreferenced block of the block pool (kv/block_pool.py) that
sits in this queue instead of the pool's LRU free queue:

    pool.free_queue      ordinary free blocks, LRU first: handed out first
    retention.queue      retained blocks, oldest retained first: handed out only when the
                         free queue is empty (pressure); each is then evicted as any cached
                         block is, so with KV tiers its KV moves down to the host tier
                         (kv/block_pool.py `evicted`, worker/kvcache/tiers.py offload)

Both queues are free blocks: `BlockPool.num_free_blocks` counts both, so admission and
the routing report's free blocks treat a retained block exactly as an evictable cached
one (retention never takes headroom away from a request; it only decides what is evicted
last). A block carries the entry that retains it in `Block.retained`.

Invariants:
- a free block is in `retention.queue` iff `block.retained` is set, else in the pool's
  free queue; a referenced block may carry a tag too (it joins `queue` when freed);
- `num_tagged` == number of blocks whose `retained` is an entry of `_held`, and never
  exceeds `max_blocks` (the share bound, checked before tagging);
- `_held` is ordered by retention time, so by expiry (one TTL for all): expiry and the
  share bound release its head first. A free block released by the TTL goes to the front
  of the pool's free queue (evicted first), its last blocks first; one released by the
  share bound, or by its session's next turn, to the tail (it was used lately);
- a block whose session's TTL ran out is in `expired` until it is handed out or hit: its
  eviction then drops it instead of moving it down a tier (the session did not come back
  within the TTL; a host tier keeps its room for blocks that may still be read). A block
  the share bound released is in `displaced` likewise: evicted, it moves down and is kept
  apart in the host tier as a retained block is (its session is still live).
Every operation is O(1) per block.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kv.block_pool import FreeBlockQueue

if TYPE_CHECKING:
    from kv.block_pool import Block, BlockPool


class RetainedTurn:
    """One session's retained blocks (its last finished turn's cached blocks, prefix order)."""

    __slots__ = ("session_id", "expires", "blocks")

    def __init__(self, session_id: str, expires: float, blocks: list[Block]) -> None:
        self.session_id = session_id
        self.expires = expires
        self.blocks = blocks


class SessionRetention:
    def __init__(self, pool: BlockPool, ttl_s: float, max_share: float,
                 clock: Callable[[], float]) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session KV retention needs a TTL > 0 s, got {ttl_s}")
        if not 0.0 < max_share <= 1.0:
            raise ValueError(f"session KV retention's pool share must be in (0, 1], got {max_share}")
        self.pool = pool
        self.ttl_s = ttl_s
        self.max_share = max_share
        self.max_blocks = int(max_share * pool.num_blocks)
        self.clock = clock  # the engine's (time.monotonic), or the simulator's virtual clock
        self.queue = FreeBlockQueue(())
        self.expired: set[int] = set()  # block ids (see the invariants)
        self.displaced: set[int] = set()  # block ids released by the share bound, free
        # Hashes of retained blocks evicted under pressure while the pool moves evicted
        # blocks down a tier: the tier manager keeps them in the host tier
        # (kv/tier_report.py keep_retained, kv/host_tier.py protect) and clears this.
        self.moved_down: list[int] = []
        self._held: OrderedDict[str, RetainedTurn] = OrderedDict()
        self.num_tagged = 0
        # Counters: turns retained, blocks released by TTL / by the share bound, and blocks
        # handed out from the retained queue under pressure (evicted, moved down a tier).
        self.num_retained_turns = 0
        self.num_expired_blocks = 0
        self.num_displaced_blocks = 0
        self.num_pressure_evictions = 0

    @property
    def num_sessions(self) -> int:
        return len(self._held)

    def sessions(self) -> list[str]:
        """Retained sessions, oldest first."""
        return list(self._held)

    def retained_block_ids(self, session_id: str) -> list[int]:
        """The session's blocks still retained (tests, debugging)."""
        turn = self._held.get(session_id)
        return [] if turn is None else [b.block_id for b in turn.blocks if b.retained is turn]

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` hashes of retained blocks, the newest session's first."""
        out: list[int] = []
        private = self.pool.private  # another KV group's keys: no prefix a router looks up
        for turn in reversed(self._held.values()):
            for block in turn.blocks:
                if len(out) >= limit:
                    return out
                if block.retained is turn and block.block_hash is not None and block.block_hash not in private:
                    out.append(block.block_hash)
        return out

    # -- check, then act ------------------------------------------------------------------
    def retain(self, session_id: str, blocks: Iterable[Block]) -> int:
        """Keep a finished turn's cached blocks (prefix order) for the session until the TTL
        ends; they replace its previous turn's. Call it before the blocks are freed. Only
        the leading `max_blocks` are kept; older sessions are released to make room.
        Returns the number of blocks retained."""
        self.release(session_id)
        keep = [b for b in blocks if b.block_hash is not None][: self.max_blocks]
        if not keep:
            return 0
        stolen = sum(1 for b in keep if b.retained is not None)  # another session's: moves over
        while self.num_tagged - stolen + len(keep) > self.max_blocks and self._held:
            oldest = next(iter(self._held))
            stolen -= self._count_own(oldest, keep)
            self.num_displaced_blocks += self._release(oldest, displaced=True)
        turn = RetainedTurn(session_id, self.clock() + self.ttl_s, keep)
        for block in keep:
            self._tag(block, turn)
        self._held[session_id] = turn
        self.num_retained_turns += 1
        return len(keep)

    def _count_own(self, session_id: str, keep: list[Block]) -> int:
        """Blocks of `keep` the session's entry retains (released with it: no longer stolen)."""
        turn = self._held[session_id]
        return sum(1 for b in keep if b.retained is turn)

    def _tag(self, block: Block, turn: RetainedTurn) -> None:
        self.expired.discard(block.block_id)
        self.displaced.discard(block.block_id)
        if block.retained is None:
            self.num_tagged += 1
            if block.ref_count == 0:  # free in the pool's queue: it moves here
                self.pool.free_queue.remove(block)
                self.queue.append(block)
        block.retained = turn  # a block another session retained moves to this one

    def release(self, session_id: str) -> int:
        """Stop retaining the session's blocks (they become ordinary cached blocks)."""
        return self._release(session_id) if session_id in self._held else 0

    def _release(self, session_id: str, expired: bool = False, displaced: bool = False) -> int:
        turn = self._held.pop(session_id)
        n = 0
        for block in turn.blocks:  # expired: each pushed to the front, so its last block is evicted first
            if block.retained is not turn:
                continue
            block.retained = None
            self.num_tagged -= 1
            n += 1
            if block.ref_count == 0:
                self.queue.remove(block)
                if expired:
                    self.pool.free_queue.push_front(block)
                    self.expired.add(block.block_id)
                else:  # displaced by the share bound: an ordinary cached block, used at its turn's end
                    self.pool.free_queue.append(block)
                    if displaced:
                        self.displaced.add(block.block_id)
        return n

    def expire(self) -> int:
        """Release every session whose TTL has ended; returns the blocks released."""
        now = self.clock()
        n = 0
        while self._held:
            turn = next(iter(self._held.values()))
            if turn.expires > now:
                break
            n += self._release(turn.session_id, expired=True)
        self.num_expired_blocks += n
        return n

    def pop_for_pressure(self) -> Block:
        """The pool's free queue is empty: hand out the oldest retained block (the caller
        evicts it, so it moves down a tier where there is one)."""
        block = self.queue.pop_front()
        if self.pool.evicted is not None and block.block_hash is not None:
            self.moved_down.append(block.block_hash)
        block.retained = None
        self.num_tagged -= 1
        self.num_pressure_evictions += 1
        return block

    def handed_out(self, block: Block) -> bool:
        """`block` leaves the free queue to be evicted: True when its session's TTL had run
        out (the eviction drops it: no move down a tier); a block the share bound displaced
        moves down and is kept in the host tier (`moved_down`), as a retained one is."""
        block_id = block.block_id
        if block_id in self.expired:
            self.expired.discard(block_id)
            return True
        if block_id in self.displaced:
            self.displaced.discard(block_id)
            if self.pool.evicted is not None and block.block_hash is not None:
                self.moved_down.append(block.block_hash)
        return False

    def hit(self, block: Block) -> None:
        """`block` leaves the free queue as a cache hit: an ordinary block again."""
        self.expired.discard(block.block_id)
        self.displaced.discard(block.block_id)

    def clear(self) -> None:
        """Release every session (a prefix-cache reset)."""
        for session_id in list(self._held):
            self._release(session_id)
        self.expired.clear()
        self.displaced.clear()
