"""KV groups (kv/kv_groups.py) and the cache manager's per-group tables: sliding-window
groups give blocks outside the window back, full groups keep everything, prefix hits need
what every group reads, with exact block ids."""
from __future__ import annotations

import pytest

from kv.cache_manager import GroupHits, KVCacheManager
from kv.group_hits import _sliding_best, group_key
from kv.kv_groups import FULL_ATTENTION, SLIDING_WINDOW, KVGroupSpec, cdiv, full_layout, layout_for_windows

BS = 4
W = 8  # a query at p reads keys p-7..p: two blocks behind a block boundary


def _tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# -- layouts ----------------------------------------------------------------------------------

def test_gemma_like_layout_cuts_layers_in_equal_groups() -> None:
    windows = [W, W, W, W, W, None] * 2
    layout = layout_for_windows(windows)
    assert layout.layers_per_group == 2
    assert [g.kind for g in layout.groups] == [FULL_ATTENTION] + [SLIDING_WINDOW] * 5
    assert [g.layer_ids for g in layout.groups] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert layout.place(11) == (0, 1) and layout.place(4) == (3, 0)
    assert layout.num_layers == 12 and layout.frees_blocks


def test_one_kind_is_one_group() -> None:
    assert layout_for_windows([None] * 3) == full_layout(3)
    mistral = layout_for_windows([W] * 4)
    assert mistral.num_groups == 1 and mistral.layers_per_group == 4 and mistral.groups[0].sliding_window == W


def test_alternating_layers_make_one_group_each() -> None:
    layout = layout_for_windows([W, None, W, None])  # gpt-oss: sliding, full, ...
    assert layout.layers_per_group == 2
    assert [g.layer_ids for g in layout.groups] == [(1, 3), (0, 2)]


def test_a_spec_refuses_what_it_cannot_be() -> None:
    with pytest.raises(ValueError, match="unknown KV cache kind"):
        KVGroupSpec("latent_v2", (0,))
    with pytest.raises(ValueError, match="needs its window"):
        KVGroupSpec(SLIDING_WINDOW, (0,))


def test_first_needed_block_follows_the_window() -> None:
    spec = KVGroupSpec(SLIDING_WINDOW, (0,), W)
    # a query at 12 reads 5..12: block 1 on
    assert [spec.first_needed_block(c, BS) for c in (0, 7, 8, 11, 12, 16)] == [0, 0, 0, 1, 1, 2]
    assert spec.max_live_blocks(1000, BS) == cdiv(W - 1, BS) + 2
    assert spec.max_live_blocks(5, BS) == 2


# -- one sliding group (Mistral) ------------------------------------------------------------------

def test_sliding_group_releases_blocks_behind_the_window() -> None:
    kv = KVCacheManager(20, BS, layout=layout_for_windows([W, W]))
    assert kv.null_block is not None and kv.null_block.block_id == 0
    assert kv.num_total_blocks == 19 and kv.num_free_blocks == 19
    toks = _tokens(40)
    assert kv.allocate("a", 12) == [1, 2, 3]
    kv.cache_computed("a", toks[:12], 12)  # next query at 12 reads from 5: block 0 is done
    assert kv.block_ids("a") == [0, 2, 3]
    assert kv.num_held_blocks("a") == [2] and kv.num_free_blocks == 17
    assert kv.allocate("a", 13) == [0, 2, 3, 4]
    kv.cache_computed("a", toks[:16], 16)
    assert kv.block_ids("a") == [0, 0, 3, 4]
    kv.free("a")
    assert kv.num_free_blocks == kv.num_total_blocks


def test_long_decode_holds_the_window_only() -> None:
    kv = KVCacheManager(64, BS, layout=layout_for_windows([W]))
    toks = _tokens(400)
    held = []
    kv.allocate("a", 1)
    for n in range(1, 400):  # decode: the step computing token n-1 runs with n tokens held
        if not kv.holds("a", n + 1):
            assert kv.can_allocate("a", n + 1)
            kv.allocate("a", n + 1)
        if n % BS == 0:
            kv.cache_computed("a", toks[:n], n)
        held.append(kv.num_held_blocks("a")[0])
    assert max(held) == cdiv(W - 1, BS) + 1 <= kv.groups[0].max_live_blocks(400, BS)
    assert len(kv.block_ids("a")) == cdiv(400, BS)  # the table still spans every position


# -- full + sliding groups (Gemma 3, gpt-oss) --------------------------------------------------------

def _mixed(num_blocks: int = 20, prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, prefix_caching, layout=layout_for_windows([None, W]))


def test_mixed_tables_grow_together_and_only_sliding_releases() -> None:
    kv = _mixed()
    toks = _tokens(40)
    assert kv.allocate("a", 12) == [[1, 2, 3], [4, 5, 6]]
    kv.cache_computed("a", toks[:12], 12)
    assert kv.tables("a") == [[1, 2, 3], [0, 5, 6]]
    assert kv.held_block_ids("a", 12) is kv.allocate("a", 12)  # one table object for life
    assert kv.held_block_ids("a", 13) is None
    assert kv.can_allocate("a", 13)
    assert kv.allocate("a", 13) == [[1, 2, 3, 7], [0, 5, 6, 8]]  # block 4 sits in the free queue's tail
    assert kv.num_held_blocks("a") == [4, 3]
    kv.free("a")
    assert kv.num_free_blocks == kv.num_total_blocks == 19


def test_mixed_prefix_hit_takes_the_window_blocks_and_nulls_before() -> None:
    kv = _mixed()
    toks = _tokens(40)
    kv.allocate("a", 12)
    kv.cache_computed("a", toks[:12], 12)  # blocks 1 2 3 | 4 5 6 cached, 4 released
    hits = kv.get_computed_blocks("b", toks[:16])
    assert isinstance(hits, GroupHits) and len(hits) == 3
    assert [[b.block_id for b in row] for row in hits.by_group] == [[1, 2, 3], [0, 5, 6]]
    assert kv.can_allocate("b", 16, hits)
    assert kv.allocate("b", 16, hits) == [[1, 2, 3, 7], [0, 5, 6, 8]]
    kv.record_admission(16, 12)
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 19


def test_mixed_group_keys_keep_groups_apart() -> None:
    kv = _mixed()
    toks = _tokens(12)
    kv.allocate("a", 12)
    kv.cache_computed("a", toks, 12)
    h = kv.block_hashes("a")
    assert kv.pool.cached[h[1]].block_id == 2  # group 0: the plain hash
    assert kv.pool.cached[group_key(h[1], 1)].block_id == 5
    assert group_key(h[1], 1) != h[1]


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    kv = _mixed()
    toks = _tokens(20)
    kv.allocate("a", 20)
    kv.cache_computed("a", toks, 20)
    assert kv.tables("a") == [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]]
    kv.free("a", keep_hashes=True)  # preemption: recompute, prefix cache permitting
    assert kv.num_free_blocks == 19
    hits = kv.get_computed_blocks("a", toks + [7])
    assert [[b.block_id for b in row] for row in hits.by_group] == [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]]
    assert kv.allocate("a", 21, hits) == [[1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12]]


def test_sliding_hit_shrinks_when_window_blocks_are_gone() -> None:
    spec = KVGroupSpec(SLIDING_WINDOW, (0,), W)  # two blocks behind a boundary
    def lookup_of(present: set[int]):  # noqa: ANN202
        return lambda k: object() if k in present else None
    keys = list(range(6))
    assert _sliding_best(spec, keys, lookup_of({3, 4, 5}), 6, BS) == 6
    assert _sliding_best(spec, keys, lookup_of({2, 4}), 6, BS) == 0
    assert _sliding_best(spec, keys, lookup_of({1, 2, 4}), 6, BS) == 3
    assert _sliding_best(spec, keys, lookup_of({0}), 6, BS) == 1


def test_evicted_window_block_shortens_the_mixed_hit() -> None:
    kv = _mixed(num_blocks=13)
    toks = _tokens(20)
    kv.allocate("a", 20)  # group 0: 1..5, group 1: 6..10
    kv.cache_computed("a", toks, 20)
    kv.free("a")
    # free order: never used 11, 12; released early 6, 7, 8; then a's blocks tail first,
    # group by group: 5 4 3 2 1, 10 9
    taken = kv.pool.allocate(5)
    assert [b.block_id for b in taken] == [11, 12, 6, 7, 8]
    hits = kv.get_computed_blocks("b", toks + [1])
    assert len(hits) == 5 and [b.block_id for b in hits.by_group[1]] == [0, 0, 0, 9, 10]
    more = kv.pool.allocate(1)  # evicts full block 5: the full run is 4 blocks, and a
    assert [b.block_id for b in more] == [5]  # query at 16 reads sliding blocks 2, 3 (8 is gone)
    hits = kv.get_computed_blocks("b", toks + [1])
    assert len(hits) == 0
    kv.pool.free(taken + more)


def test_request_limit_counts_every_group() -> None:
    kv = _mixed()
    assert kv.max_blocks_for(400) == cdiv(400, BS) + cdiv(W - 1, BS) + 2


def test_other_groups_keys_stay_private() -> None:
    """Group 0's hashes are the prefix the router and the KV events see; the salted keys of
    other groups are looked up by this pool only."""
    kv = _mixed()
    toks = _tokens(12)
    kv.allocate("a", 12)
    kv.cache_computed("a", toks, 12)
    h = kv.block_hashes("a")
    assert kv.cached_block_hashes(10) == list(reversed(h))
    assert kv.pool.private == {group_key(x, 1) for x in h}
    kv.free("a")
    kv.pool.allocate(19)  # evicts everything: the private keys go with their blocks
    assert not kv.pool.private and not kv.pool.cached


def test_the_longest_sequence_a_pool_holds_counts_every_group() -> None:
    from kv.kv_geometry import KVGeometry

    gemma = KVGeometry.from_layout(layout_for_windows([None, W, W]), BS)  # 1 full + 2 sliding groups
    n = gemma.max_sequence_tokens(100, 10_000)
    assert gemma.blocks_for_tokens(n) <= 100 < gemma.blocks_for_tokens(n + 1)
    assert n == (100 - 2 * (cdiv(W - 1, BS) + 2)) * BS
    mistral = KVGeometry(BS, 0, (W,))
    assert mistral.max_sequence_tokens(10, 10_000) == 10_000  # a window never outgrows the pool
