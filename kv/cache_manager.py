"""Request-level KV bookkeeping on top of the block pool: which blocks hold which
request's tokens, prefix-cache lookups, and registering computed blocks.

Block table of a request (block_size = 4 in this picture):

    tokens:     t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block_ids:  [    17     ,     3       ,   42  ]
    hashes:     [    h0     ,     h1      ]          h1 = hash(h0, t4..t7); the partial
                                                     last block has no hash yet
Token i lives in slot block_ids[i // 4] * 4 + i % 4. Only full blocks whose tokens are
all computed are registered in the prefix cache.

A model whose layers keep KV in several groups (kv/kv_groups.py: full attention beside
sliding windows) has one such table per group, all the same length, drawn from the one
pool; a sliding group's entries behind its window name the null block once released.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kv.block_hash import ROOT_HASH, hash_full_blocks
from kv.block_pool import Block, BlockPool
from kv.group_hits import group_key, longest_hit
from kv.kv_groups import FULL_ATTENTION, KVGroupSpec, KVLayout, cdiv
from kv.retention import SessionRetention
from kv.stats import KVStats

__all__ = ["BlockIds", "GroupHits", "KVCacheManager", "cdiv"]


class BlockIds(list):
    """A table's block ids (a list that grows in place), with the mark a reader that
    mirrors it needs (worker/runner/block_table.py): `rewrite_from`, the lowest length
    the list has been cut back to since the reader last cleared the mark (None: only
    appended since). The cache manager lowers it; the one reader clears it."""

    rewrite_from: int | None = None


class GroupHits(list):
    """Cache hits of a model with several KV groups: the list is group 0's hit blocks (its
    length is the hit's length in blocks, as for one group); `by_group` has every group's."""

    by_group: list[list[Block]]


class KVCacheManager:
    """Block tables per request over one block pool, one table per KV group
    (kv/kv_groups.py). With one group a request's table is a list of block ids; with
    several it is a list of such lists, one per group, all the same length (a sliding
    group's released entries name the null block). Either way the table object the
    runner gets stays the same for the request's lifetime and grows in place (cut back
    only by `shrink`, which marks it: BlockIds.rewrite_from)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 layout: KVLayout | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.layout = layout
        self.groups: tuple[KVGroupSpec, ...] = layout.groups if layout is not None else (KVGroupSpec(FULL_ATTENTION, ()),)
        self._multi = len(self.groups) > 1
        self._sliding = [gi for gi, g in enumerate(self.groups) if g.frees_blocks]
        # Released sliding-window entries point at the null block: never handed out, never
        # freed, never cached; the backends mask the positions it stands for.
        self.null_block: Block | None = self.pool.allocate(1)[0] if self._sliding else None
        self._blocks: dict[str, list[list[Block]]] = {}  # per group
        self._group_ids: dict[str, list[list[int]]] = {}  # same blocks, as ids
        self._tables: dict[str, list[int] | list[list[int]]] = {}  # what the runner gets
        self._released: dict[str, list[int]] = {}  # per group: leading entries given back
        self._hashes: dict[str, list[int]] = {}  # kept across preemption: tokens do not change
        self._num_registered: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_total_blocks(self) -> int:
        """Blocks requests can hold (the null block is not one)."""
        return self.pool.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    # -- sessions' KV kept across pauses (kv/retention.py) ---------------------------------
    def enable_retention(self, ttl_s: float, max_share: float, clock: Callable[[], float]) -> SessionRetention:
        """Keep finished session turns' cached blocks for `ttl_s`, at most `max_share` of the pool."""
        if not self.pool.enable_prefix_caching:
            raise ValueError("session KV retention needs the prefix cache (enable_prefix_caching)")
        self.pool.retention = SessionRetention(self.pool, ttl_s, max_share, clock)
        return self.pool.retention

    @property
    def retention(self) -> SessionRetention | None:
        return self.pool.retention

    def expire_retention(self) -> None:
        """Release the sessions whose TTL has ended (the scheduler calls it every step)."""
        if self.pool.retention is not None:
            self.pool.retention.expire()

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_for(self, num_tokens: int, chunk_tokens: int = 1) -> int:
        """Blocks of the pool one sequence of `num_tokens` tokens holds at most, over its
        groups, computing up to `chunk_tokens` a step."""
        return sum(g.max_live_blocks(num_tokens, self.block_size, chunk_tokens) for g in self.groups)

    # -- prefix cache ----------------------------------------------------------------
    def get_computed_blocks(self, request_id: str, token_ids: list[int], root: int = ROOT_HASH) -> list[Block]:
        """The longest cached prefix that starts the sequence, as blocks (GroupHits with
        several groups; see kv/group_hits.py). At least one token is always left to
        compute: its logits are needed to sample. `root`: the request's hash-chain root
        (kv.block_hash.root_hash of its extra keys)."""
        if not self.pool.enable_prefix_caching:
            return []
        hashes = hash_full_blocks(token_ids, self.block_size, self._hashes.setdefault(request_id, []), root)
        max_blocks = (len(token_ids) - 1) // self.block_size
        lookup = self.pool.cached.get  # pool.lookup without a call per block (prompts of 1k+ blocks)
        if not self._sliding:
            hits: list[Block] = []
            for block_hash in hashes[:max_blocks]:
                block = lookup(block_hash)
                if block is None:
                    break
                hits.append(block)
            return hits

        def keys_of(group: int) -> list[int]:
            return hashes if group == 0 else [group_key(h, group) for h in hashes[:max_blocks]]

        by_group = longest_hit(self.groups, keys_of, lookup, max_blocks, self.block_size, self.null_block)
        if not self._multi:
            return by_group[0]
        out = GroupHits(by_group[0])
        out.by_group = by_group
        return out

    def _hits_by_group(self, computed_blocks: Sequence[Block]) -> list[Sequence[Block]]:
        if not computed_blocks:
            return [()] * len(self.groups)
        return computed_blocks.by_group if self._multi else [computed_blocks]  # type: ignore[attr-defined]

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
        table = self._tables.get(request_id)
        if table is not None and len(table[0] if self._multi else table) * self.block_size >= num_tokens:
            return table  # type: ignore[return-value]
        return None

    def can_allocate(self, request_id: str, num_tokens: int, computed_blocks: Sequence[Block] = ()) -> bool:
        """Can the request hold `num_tokens` tokens (computed prefix included)? Every group
        grows its table by the same number of entries, each a new block."""
        ids = self._group_ids.get(request_id)
        have = (len(ids[0]) if ids is not None else 0) + len(computed_blocks)
        need = max(self.blocks_for_tokens(num_tokens) - have, 0) * len(self.groups)
        # Cache hits nobody references sit in the free queue; taking them uses it up too.
        null = self.null_block
        num_free_hits = sum(1 for hits in self._hits_by_group(computed_blocks)
                            for b in hits if b.ref_count == 0 and b is not null)
        return need + num_free_hits <= self.pool.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int, computed_blocks: Sequence[Block] = ()) -> list[int]:
        """Grow the request's block tables to hold `num_tokens` tokens; returns the table
        (a list that stays the same object for the request's lifetime)."""
        if request_id not in self._tables:
            self._new_tables(request_id)
        blocks, ids = self._blocks[request_id], self._group_ids[request_id]
        if computed_blocks:
            assert not ids[0], "cache hits only at admission"
            null = self.null_block
            for gi, hits in enumerate(self._hits_by_group(computed_blocks)):
                self.pool.touch(b for b in hits if b is not null)
                blocks[gi].extend(hits)
                ids[gi].extend(b.block_id for b in hits)
                if null is not None:
                    self._released[request_id][gi] = sum(1 for b in hits if b is null)
            self._num_registered[request_id] = len(computed_blocks)
        need = self.blocks_for_tokens(num_tokens) - len(ids[0])
        if need > 0:
            for gi in range(len(self.groups)):
                new = self.pool.allocate(need)
                blocks[gi].extend(new)
                ids[gi].extend(b.block_id for b in new)
        return self._tables[request_id]  # type: ignore[return-value]

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Give back the table's trailing blocks beyond what `num_tokens` tokens need, in
        every group: lookahead blocks that only rejected draft tokens wrote (speculative
        decoding, worker/spec/). None of them holds a registered block: registration covers
        computed full blocks only, and computed tokens stay below `num_tokens`."""
        ids = self._group_ids.get(request_id)
        keep = self.blocks_for_tokens(num_tokens)
        if ids is None or len(ids[0]) <= keep:
            return
        assert self._num_registered.get(request_id, 0) <= keep
        blocks = self._blocks[request_id]
        for row, row_ids in zip(blocks, ids):
            gone = row[keep:]
            del row[keep:], row_ids[keep:]  # in place: the runner's table is this list
            mark = getattr(row_ids, "rewrite_from", None)
            row_ids.rewrite_from = keep if mark is None else min(mark, keep)  # type: ignore[attr-defined]
            self.pool.free(reversed(gone))

    def _new_tables(self, request_id: str) -> None:
        ids: list[list[int]] = [BlockIds() for _ in self.groups]
        self._blocks[request_id] = [[] for _ in self.groups]
        self._group_ids[request_id] = ids
        self._tables[request_id] = ids if self._multi else ids[0]
        if self._sliding:
            self._released[request_id] = [0] * len(self.groups)

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_computed(self, request_id: str, token_ids: list[int], num_computed_tokens: int, root: int = ROOT_HASH) -> None:
        """Register the request's full blocks whose every token is now in the KV cache,
        then give back the sliding-window blocks no later query reads (registered first:
        a released block stays findable in the cache until it is handed out again)."""
        if self.pool.enable_prefix_caching:
            self._register(request_id, token_ids, num_computed_tokens, root)
        if self._sliding and request_id in self._blocks:
            self._release_outside_window(request_id, num_computed_tokens)

    def _register(self, request_id: str, token_ids: list[int], num_computed_tokens: int, root: int) -> None:
        num_full = num_computed_tokens // self.block_size
        done = self._num_registered.get(request_id, 0)
        if num_full <= done:
            return
        hashes = hash_full_blocks(
            token_ids[: num_full * self.block_size], self.block_size, self._hashes.setdefault(request_id, []), root
        )
        null, cache_block = self.null_block, self.pool.cache_block
        for gi, blocks in enumerate(self._blocks[request_id]):
            for i in range(done, num_full):
                if blocks[i] is not null:
                    cache_block(blocks[i], group_key(hashes[i], gi), gi > 0)
        self._num_registered[request_id] = num_full

    def _release_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Sliding groups: blocks before the first one a query at num_computed_tokens or
        later can read go back to the pool; their table entries name the null block."""
        null = self.null_block
        assert null is not None
        released = self._released[request_id]
        blocks, ids = self._blocks[request_id], self._group_ids[request_id]
        for gi in self._sliding:
            first = self.groups[gi].first_needed_block(num_computed_tokens, self.block_size)
            done = released[gi]
            if first <= done:
                continue
            row, row_ids = blocks[gi], ids[gi]
            first = min(first, len(row))
            gone = [b for b in row[done:first] if b is not null]
            row[done:first] = [null] * (first - done)
            row_ids[done:first] = [null.block_id] * (first - done)
            released[gi] = first
            self.pool.free(gone)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table (group 0's ids; with several groups use `tables`)."""
        ids = self._group_ids.get(request_id)
        return ids[0] if ids is not None else []

    def table_prefix(self, request_id: str, num_blocks: int) -> list[int] | list[list[int]]:
        """The first `num_blocks` entries of the request's table (as the runner gets it)."""
        ids = self._group_ids.get(request_id, [[] for _ in self.groups])
        return [row[:num_blocks] for row in ids] if self._multi else ids[0][:num_blocks]

    def tables(self, request_id: str) -> list[list[int]]:
        """The request's block ids, one list per group."""
        return self._group_ids.get(request_id, [[] for _ in self.groups])

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks of the pool the request holds now, per group (null entries not counted)."""
        null = self.null_block
        return [sum(1 for b in row if b is not null) for row in self._blocks.get(request_id, [[] for _ in self.groups])]

    def free(self, request_id: str, keep_hashes: bool = False, session_id: str | None = None) -> None:
        """Release the request's blocks (tail first, so its last blocks are evicted first).
        `keep_hashes` for preemption: the tokens stay the same, the hashes stay valid.
        `session_id`: a finished turn of that session; with retention on, its cached blocks
        are retained for the session's next turn (kv/retention.py) as they are freed."""
        retention = self.pool.retention
        if session_id is not None and retention is not None and request_id in self._blocks:
            null = self.null_block
            retention.retain(session_id, (b for row in self._blocks[request_id] for b in row if b is not null))
        blocks = self._blocks.pop(request_id, None)
        self._group_ids.pop(request_id, None)
        self._tables.pop(request_id, None)
        self._released.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not keep_hashes:
            self._hashes.pop(request_id, None)
        if blocks:
            null = self.null_block
            for row in blocks:
                self.pool.free(b for b in reversed(row) if b is not null)

    def pin(self, request_id: str) -> list[Block]:
        """Take one more reference on each of the request's blocks, so that they outlive
        `free(request_id)` (an exported request's blocks stay put until the decode side has
        them). Give them back with `unpin`. Every group's blocks (not the null block)."""
        null = self.null_block
        blocks = [b for row in self._blocks.get(request_id, ()) for b in row if b is not null]
        self.pool.touch(blocks)
        return blocks

    def unpin(self, blocks: list[Block]) -> None:
        self.pool.free(reversed(blocks))

    def stats(self) -> KVStats:
        return KVStats(
            total_blocks=self.num_total_blocks,
            free_blocks=self.pool.num_free_blocks,
            block_size=self.block_size,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_cached_blocks=len(self.pool.cached),
            retained_blocks=self.pool.retention.queue.num_free if self.pool.retention is not None else 0,
        )

    def cached_block_hashes(self, limit: int) -> list[int]:
        """Up to `limit` cached block hashes (for routing on prefix overlap): those retained
        for paused sessions first (newest session first), then the rest, most recently
        cached first. Call it from the thread that owns the pool."""
        retention = self.pool.retention
        out = retention.recent_hashes(limit) if retention is not None else []
        private = self.pool.private
        seen = set(out) if out else ()
        for block_hash in reversed(self.pool.cached):
            if len(out) >= limit:
                break
            if block_hash in seen:
                continue
            if private and block_hash in private:
                continue  # another group's key: no prefix the router can look up
            out.append(block_hash)
            if len(out) >= limit:
                break
        return out
