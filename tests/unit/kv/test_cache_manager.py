"""KVCacheManager: block tables, prefix-cache lookups, registering computed blocks, stats, hashes."""
from __future__ import annotations

import pytest

from kv.block_hash import ROOT_HASH, hash_block, hash_full_blocks
from kv.cache_manager import KVCacheManager, cdiv
from kv.stats import KVStats

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def compute_all(m: KVCacheManager, rid: str, tokens: list[int], hits: list = ()) -> list[int]:
    """Admit `rid` with all its tokens and mark them computed (as the scheduler would)."""
    table = m.allocate(rid, len(tokens), hits)
    m.cache_computed(rid, tokens, len(tokens))
    return table


# ---------------------------------------------------------------- block tables


def test_cdiv_and_blocks_for_tokens() -> None:
    m = KVCacheManager(8, BS)
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert [m.blocks_for_tokens(n) for n in (1, 4, 5, 12, 13)] == [1, 1, 2, 3, 4]


def test_held_block_ids_is_the_table_when_it_holds_the_tokens() -> None:
    m = KVCacheManager(8, BS)
    assert m.held_block_ids("a", 1) is None  # no table yet
    table = m.allocate("a", 6)
    assert m.held_block_ids("a", 8) is table  # two blocks hold 8 tokens: no allocation needed
    assert m.held_block_ids("a", 9) is None  # a third block is needed
    assert m.holds("a", 8) and not m.holds("a", 9)  # the same answers as `holds`


def test_block_tables_exact_ids() -> None:
    m = KVCacheManager(8, BS)
    table_a = m.allocate("a", 10)
    assert table_a == [0, 1, 2]
    assert m.num_free_blocks == 5
    # Growing within the last block takes nothing; the table is the same list object.
    assert m.allocate("a", 12) is table_a
    assert table_a == [0, 1, 2]
    assert m.allocate("a", 13) is table_a
    assert table_a == [0, 1, 2, 3]
    assert m.allocate("b", 5) == [4, 5]
    assert m.block_ids("a") == [0, 1, 2, 3]
    assert m.block_ids("b") == [4, 5]
    assert m.block_ids("nobody") == []
    assert m.num_free_blocks == 2
    assert m.num_total_blocks == 8
    m.free("a")
    assert m.block_ids("a") == []
    # tail first: a's last block is evicted first
    assert m.pool.free_queue.block_ids() == [6, 7, 3, 2, 1, 0]
    m.free("b")
    assert m.pool.free_queue.block_ids() == [6, 7, 3, 2, 1, 0, 5, 4]
    assert m.num_free_blocks == 8
    m.free("b")  # freeing an unknown / already-freed request is a no-op
    assert m.num_free_blocks == 8


def test_can_allocate_plain() -> None:
    m = KVCacheManager(4, BS)
    assert m.can_allocate("a", 16)
    assert not m.can_allocate("a", 17)
    m.allocate("a", 8)  # 2 blocks
    assert m.can_allocate("a", 16)  # 2 more
    assert not m.can_allocate("a", 17)
    assert m.can_allocate("b", 8)
    assert not m.can_allocate("b", 9)


# ---------------------------------------------------------------- prefix cache lookups


def test_get_computed_blocks_longest_prefix_of_full_blocks() -> None:
    m = KVCacheManager(16, BS)
    prompt = toks(100, 12)  # 3 full blocks
    table = compute_all(m, "a", prompt)
    assert table == [0, 1, 2]
    assert len(m.pool.cached) == 3

    # Same 12 tokens: the last token must be computed, so only 2 blocks are hits.
    assert [b.block_id for b in m.get_computed_blocks("b1", prompt)] == [0, 1]
    # 13 tokens sharing all 3 blocks: 3 hits, 1 token left.
    assert [b.block_id for b in m.get_computed_blocks("b2", prompt + [7])] == [0, 1, 2]
    # 11 tokens: 2 full blocks.
    assert [b.block_id for b in m.get_computed_blocks("b3", prompt[:11])] == [0, 1]
    # 4 tokens exactly: one full block but one token must be left: no hits.
    assert m.get_computed_blocks("b4", prompt[:4]) == []
    # 5 tokens: 1 hit.
    assert [b.block_id for b in m.get_computed_blocks("b5", prompt[:5])] == [0]
    # Divergence in the second block: only the first block is a hit, and nothing after the
    # divergence matches even if later blocks' tokens are the same (the chain differs).
    other = prompt[:4] + [999] + prompt[5:] + [1]
    assert [b.block_id for b in m.get_computed_blocks("b6", other)] == [0]
    # Divergence in the first block: no hits at all.
    assert m.get_computed_blocks("b7", [0] + prompt[1:] + [1]) == []
    # Lookups take no references.
    assert [b.ref_count for b in m.pool.blocks[:3]] == [1, 1, 1]


def test_cache_computed_registers_only_fully_computed_blocks() -> None:
    m = KVCacheManager(8, BS)
    tokens = toks(0, 10)
    m.allocate("a", 10)
    m.cache_computed("a", tokens, 3)
    assert m.pool.cached == {}
    m.cache_computed("a", tokens, 6)  # block 0 full and computed, block 1 half
    assert len(m.pool.cached) == 1
    h0 = hash_block(ROOT_HASH, tokens[0:4])
    assert m.pool.cached[h0].block_id == 0
    m.cache_computed("a", tokens, 10)
    h1 = hash_block(h0, tokens[4:8])
    assert set(m.pool.cached) == {h0, h1}
    assert m.pool.cached[h1].block_id == 1
    assert m.pool.blocks[2].block_hash is None  # the partial last block
    # Decode fills the last block: it is registered once every token is computed.
    tokens += [10, 11]
    m.allocate("a", 12)
    m.cache_computed("a", tokens, 11)
    assert len(m.pool.cached) == 2
    m.cache_computed("a", tokens, 12)
    h2 = hash_block(h1, tokens[8:12])
    assert m.pool.cached[h2].block_id == 2
    assert len(m.pool.cached) == 3


def test_cache_computed_disabled() -> None:
    m = KVCacheManager(8, BS, enable_prefix_caching=False)
    tokens = toks(0, 12)
    compute_all(m, "a", tokens)
    assert m.pool.cached == {}
    assert m.get_computed_blocks("b", tokens + [1]) == []
    assert m.stats().num_cached_blocks == 0


def test_shared_prefix_shares_block_ids_and_ref_counts() -> None:
    m = KVCacheManager(10, BS)
    prefix = toks(50, 8)  # 2 full blocks
    a = prefix + [1, 2, 3]  # 11 tokens -> blocks 0, 1, 2
    assert compute_all(m, "a", a) == [0, 1, 2]

    b = prefix + [4, 5, 6, 7, 8]  # 13 tokens
    hits = m.get_computed_blocks("b", b)
    assert [h.block_id for h in hits] == [0, 1]
    assert m.can_allocate("b", len(b), hits)
    table_b = m.allocate("b", len(b), hits)
    assert table_b == [0, 1, 3, 4]
    refs = [blk.ref_count for blk in m.pool.blocks[:5]]
    assert refs == [2, 2, 1, 1, 1]
    assert m.num_free_blocks == 5
    m.cache_computed("b", b, len(b))
    assert m.pool.blocks[3].block_hash == hash_full_blocks(b, BS)[2]
    assert m.pool.blocks[4].block_hash is None

    m.free("a")
    assert [blk.ref_count for blk in m.pool.blocks[:5]] == [1, 1, 0, 1, 1]
    assert m.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2]
    m.free("b")
    assert [blk.ref_count for blk in m.pool.blocks[:5]] == [0, 0, 0, 0, 0]
    assert m.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2, 4, 3, 1, 0]
    assert m.num_free_blocks == 10


def test_same_block_computed_twice_keeps_first_copy() -> None:
    m = KVCacheManager(8, BS)
    tokens = toks(0, 8)
    # Two requests admitted before either computed anything: no hits, separate blocks.
    assert m.get_computed_blocks("a", tokens) == []
    assert m.get_computed_blocks("b", tokens) == []
    assert m.allocate("a", 8) == [0, 1]
    assert m.allocate("b", 8) == [2, 3]
    m.cache_computed("a", tokens, 8)
    m.cache_computed("b", tokens, 8)
    assert sorted(b.block_id for b in m.pool.cached.values()) == [0, 1]
    assert m.pool.blocks[2].block_hash is None
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 8
    assert len(m.pool.cached) == 2


def test_free_keep_hashes_for_preemption() -> None:
    m = KVCacheManager(8, BS)
    tokens = toks(0, 10)
    m.get_computed_blocks("a", tokens)
    compute_all(m, "a", tokens)
    known = list(m._hashes["a"])
    assert known == hash_full_blocks(tokens, BS)
    assert len(known) == 2

    m.free("a", keep_hashes=True)  # preempted
    assert m.block_ids("a") == []
    assert m._hashes["a"] == known
    assert m.num_free_blocks == 8
    # Its full blocks stay cached while free; the partial last block was never registered.
    assert m.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert len(m.pool.cached) == 2

    # Re-admission: the cached blocks come back as hits, same ids.
    hits = m.get_computed_blocks("a", tokens)
    assert [h.block_id for h in hits] == [0, 1]
    assert m.allocate("a", 10, hits) == [0, 1, 3]
    m.cache_computed("a", tokens, 10)
    assert len(m.pool.cached) == 2

    m.free("a")  # finished: hashes dropped too
    assert "a" not in m._hashes
    assert m.num_free_blocks == 8


def test_can_allocate_counts_free_cache_hits() -> None:
    m = KVCacheManager(4, BS)
    prefix = toks(0, 12)
    compute_all(m, "a", prefix)  # blocks 0, 1, 2 cached
    m.free("a")
    assert m.num_free_blocks == 4  # all free, 3 of them cached

    b = prefix + [1, 2, 3, 4]  # 16 tokens = 4 blocks: 3 hits (ref 0) + 1 new
    hits = m.get_computed_blocks("b", b)
    assert [h.block_id for h in hits] == [0, 1, 2]
    assert m.can_allocate("b", 16, hits)
    # 20 tokens = 5 blocks: 3 hits + 2 new. The hits sit in the free queue, so only 1 is
    # really left for new blocks: must be refused.
    c = prefix + toks(200, 8)
    hits_c = m.get_computed_blocks("c", c)
    assert len(hits_c) == 3
    assert not m.can_allocate("c", 20, hits_c)

    assert m.allocate("b", 16, hits) == [0, 1, 2, 3]
    assert m.num_free_blocks == 0

    # Hits already referenced by a running request do not use free blocks.
    m2 = KVCacheManager(4, BS)
    compute_all(m2, "a", prefix)  # holds 0, 1, 2; 1 free
    hits2 = m2.get_computed_blocks("b", b)
    assert [h.ref_count for h in hits2] == [1, 1, 1]
    assert m2.can_allocate("b", 16, hits2)  # 3 shared + 1 new
    assert not m2.can_allocate("b", 17, hits2)  # 3 shared + 2 new
    assert m2.allocate("b", 16, hits2) == [0, 1, 2, 3]
    assert [blk.ref_count for blk in m2.pool.blocks] == [2, 2, 2, 1]


# ---------------------------------------------------------------- stats


def test_stats_usage_and_hit_rate() -> None:
    m = KVCacheManager(10, BS)
    s = m.stats()
    assert s == KVStats(
        total_blocks=10, free_blocks=10, block_size=BS, prefix_cache_queries=0, prefix_cache_hits=0
    )
    assert s.usage == 0.0
    assert s.prefix_cache_hit_rate == 0.0

    m.allocate("a", 16)  # 4 blocks
    m.cache_computed("a", toks(0, 16), 16)
    m.record_admission(16, 0)
    m.record_admission(16, 12)
    s = m.stats()
    assert s.total_blocks == 10
    assert s.free_blocks == 6
    assert s.usage == pytest.approx(0.4)
    assert s.prefix_cache_queries == 32
    assert s.prefix_cache_hits == 12
    assert s.prefix_cache_hit_rate == pytest.approx(12 / 32)
    assert s.num_cached_blocks == 4
    d = s.to_dict()
    assert d["kv_usage"] == pytest.approx(0.4)
    assert d["free_blocks"] == 6
    assert d["num_cached_blocks"] == 4

    m.free("a")
    s = m.stats()
    assert s.usage == 0.0  # cached but unreferenced blocks count as free
    assert s.num_cached_blocks == 4
    assert KVStats(0, 0, 4, 0, 0).usage == 0.0


def test_cached_block_hashes_limit() -> None:
    m = KVCacheManager(8, BS)
    tokens = toks(0, 16)
    compute_all(m, "a", tokens)
    hashes = hash_full_blocks(tokens, BS)
    # most recently cached first
    assert m.cached_block_hashes(10) == hashes[::-1]
    assert m.cached_block_hashes(2) == [hashes[3], hashes[2]]


# ---------------------------------------------------------------- hashes


def test_hash_chain_depends_on_parent() -> None:
    block = [1, 2, 3, 4]
    h_root = hash_block(ROOT_HASH, block)
    h_other = hash_block(h_root, block)
    assert h_root != h_other
    # The same tokens in block 1 after different block-0 contents hash differently.
    a = hash_full_blocks([9, 9, 9, 9] + block, BS)
    b = hash_full_blocks([8, 8, 8, 8] + block, BS)
    assert a[0] != b[0]
    assert a[1] != b[1]
    # A chain is the fold of hash_block over the full blocks; the partial tail is ignored.
    tokens = toks(0, 11)
    h0 = hash_block(ROOT_HASH, tokens[0:4])
    h1 = hash_block(h0, tokens[4:8])
    assert hash_full_blocks(tokens, BS) == [h0, h1]
    # Token order matters.
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) != hash_block(ROOT_HASH, [2, 1, 3, 4])


def test_hash_full_blocks_extends_known_in_place() -> None:
    tokens = toks(0, 16)
    known = hash_full_blocks(tokens[:8], BS)
    assert len(known) == 2
    same = hash_full_blocks(tokens, BS, known)
    assert same is known
    assert known == hash_full_blocks(tokens, BS)
    assert len(known) == 4


def test_hash_stable_pinned_values() -> None:
    # blake2b over (parent as u64 LE, tokens as u32 LE); pinned so a change of the hash
    # (which routers compare across processes and versions) is noticed.
    assert hash_block(0, [1, 2, 3, 4]) == 658132497017838498
    assert hash_block(658132497017838498, [5, 6, 7, 8]) == 7641984106258271874
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS) == [658132497017838498, 7641984106258271874]
    # deterministic across calls
    assert hash_block(0, [1, 2, 3, 4]) == hash_block(0, (1, 2, 3, 4))
    assert all(0 <= h < 2**64 for h in hash_full_blocks(toks(0, 64), BS))


def test_adopted_block_hashes_are_used_as_the_prompts_chain() -> None:
    """A caller that hashed the prompt already (the simulator's router) hands the chain
    over: lookups use it as given, and the manager extends it for later blocks. Shown
    with the chain of another prompt, so the hit can only come from the adopted list."""
    m = KVCacheManager(8, BS)
    cached = toks(0, 9)
    assert compute_all(m, "a", cached) == [0, 1, 2]
    m.free("a")
    other = toks(100, 9)
    m.adopt_block_hashes("b", hash_full_blocks(cached, BS))
    assert [b.block_id for b in m.get_computed_blocks("b", other)] == [0, 1]
    # A second adoption does not replace the chain the manager already holds for "b".
    m.adopt_block_hashes("b", [1, 2])
    assert [b.block_id for b in m.get_computed_blocks("b", other)] == [0, 1]
    # The manager's own request without adoption: no hit for the other prompt.
    assert m.get_computed_blocks("c", other) == []
