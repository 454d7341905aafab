"""Request-level KV bookkeeping on top of the block pool: which blocks hold which
request's tokens, prefix-cache lookups, and registering computed blocks.

Block table of a request (block_size = 4 in this picture):

    tokens:     t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block_ids:  [    17     ,     3       ,   42  ]
    hashes:     [    h0     ,     h1      ]          h1 = hash(h0, t4..t7); the partial
                                                     last block has no hash yet
Token i lives in slot block_ids[i // 4] * 4 + i % 4. Only full blocks whose tokens are
all computed are registered in the prefix cache.
"""
from __future__ import annotations

from collections.abc import Sequence

from kv.block_hash import ROOT_HASH, hash_full_blocks
from kv.block_pool import Block, BlockPool
from kv.stats import KVStats


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[Block]] = {}
        self._block_ids: dict[str, list[int]] = {}  # same blocks, as ids for the runner
        self._hashes: dict[str, list[int]] = {}  # kept across preemption: tokens do not change
        self._num_registered: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache ----------------------------------------------------------------
    def get_computed_blocks(self, request_id: str, token_ids: list[int], root: int = ROOT_HASH) -> list[Block]:
        """The longest run of cached full blocks that starts the sequence. At least one
        token is always left to compute: its logits are needed to sample. `root`: the
        request's hash-chain root (kv.block_hash.root_hash of its extra keys)."""
        if not self.pool.enable_prefix_caching:
            return []
        hashes = hash_full_blocks(token_ids, self.block_size, self._hashes.setdefault(request_id, []), root)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[Block] = []
        lookup = self.pool.cached.get  # pool.lookup without a call per block (prompts of 1k+ blocks)
        for block_hash in hashes[:max_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def block_hashes(self, request_id: str) -> list[int]:
        """The request's full-block hashes computed so far (by get_computed_blocks)."""
        return self._hashes.get(request_id, [])

    def adopt_block_hashes(self, request_id: str, block_hashes: Sequence[int]) -> None:
        """Take the hashes of the request's leading full blocks from a caller that computed
        them already with kv.block_hash at this block size (the simulator's router hashed
        the same prompt): hashing is then done once per prompt, not once per component.
        They must be exactly that chain, or prefix lookups go wrong: never pass hashes
        that crossed a process boundary from an untrusted side."""
        if self.pool.enable_prefix_caching and request_id not in self._hashes:
            self._hashes[request_id] = list(block_hashes)

    # -- allocation (check, then act) ------------------------------------------------
    def holds(self, request_id: str, num_tokens: int) -> bool:
        """Does the request's block table already hold `num_tokens` tokens? (Then it needs
        no check and no allocation: most decode steps of most requests.)"""
        return self.held_block_ids(request_id, num_tokens) is not None or num_tokens <= 0

    def held_block_ids(self, request_id: str, num_tokens: int) -> list[int] | None:
        """The request's block table if it already holds `num_tokens` tokens, else None
        (`holds` and `block_ids` in one lookup: the scheduler asks for every running
        sequence every step)."""
        block_ids = self._block_ids.get(request_id)
        if block_ids is not None and len(block_ids) * self.block_size >= num_tokens:
            return block_ids
        return None

    def can_allocate(self, request_id: str, num_tokens: int, computed_blocks: list[Block] = ()) -> bool:
        """Can the request hold `num_tokens` tokens (computed prefix included)?"""
        have = len(self._blocks.get(request_id, ())) + len(computed_blocks)
        need = self.blocks_for_tokens(num_tokens) - have
        # Cache hits nobody references sit in the free queue; taking them uses it up too.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_count == 0)
        return max(need, 0) + num_free_hits <= self.pool.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int, computed_blocks: list[Block] = ()) -> list[int]:
        """Grow the request's block table to hold `num_tokens` tokens; returns the table
        (a list that stays the same object for the request's lifetime)."""
        blocks = self._blocks.setdefault(request_id, [])
        block_ids = self._block_ids.setdefault(request_id, [])
        if computed_blocks:
            assert not blocks, "cache hits only at admission"
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            block_ids.extend(b.block_id for b in computed_blocks)
            self._num_registered[request_id] = len(computed_blocks)
        need = self.blocks_for_tokens(num_tokens) - len(blocks)
        if need > 0:
            new = self.pool.allocate(need)
            blocks.extend(new)
            block_ids.extend(b.block_id for b in new)
        return block_ids

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_computed(self, request_id: str, token_ids: list[int], num_computed_tokens: int, root: int = ROOT_HASH) -> None:
        """Register the request's full blocks whose every token is now in the KV cache."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        done = self._num_registered.get(request_id, 0)
        if num_full <= done:
            return
        hashes = hash_full_blocks(
            token_ids[: num_full * self.block_size], self.block_size, self._hashes.setdefault(request_id, []), root
        )
        blocks = self._blocks[request_id]
        for i in range(done, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_registered[request_id] = num_full

    def block_ids(self, request_id: str) -> list[int]:
        return self._block_ids.get(request_id, [])

    def free(self, request_id: str, keep_hashes: bool = False) -> None:
        """Release the request's blocks (tail first, so its last blocks are evicted first).
        `keep_hashes` for preemption: the tokens stay the same, the hashes stay valid."""
        blocks = self._blocks.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not keep_hashes:
            self._hashes.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def pin(self, request_id: str) -> list[Block]:
        """Take one more reference on each of the request's blocks, so that they outlive
        `free(request_id)` (an exported request's blocks stay put until the decode side has
        them). Give them back with `unpin`."""
        blocks = list(self._blocks.get(request_id, ()))
        self.pool.touch(blocks)
        return blocks

    def unpin(self, blocks: list[Block]) -> None:
        self.pool.free(reversed(blocks))

    def stats(self) -> KVStats:
        return KVStats(
            total_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free_blocks,
            block_size=self.block_size,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_cached_blocks=len(self.pool.cached),
        )

    def cached_block_hashes(self, limit: int) -> list[int]:
        """Up to `limit` cached block hashes, most recently cached first (for routing on
        prefix overlap). Call it from the thread that owns the pool."""
        out = []
        for block_hash in reversed(self.pool.cached):
            out.append(block_hash)
            if len(out) >= limit:
                break
        return out
