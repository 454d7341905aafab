"""BlockPool and FreeBlockQueue: exact block ids, LRU eviction order, ref counts, prefix cache."""
from __future__ import annotations

import time

import pytest

from kv.block_pool import Block, BlockPool, FreeBlockQueue


def ids(blocks: list[Block]) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------- FreeBlockQueue


def test_free_queue_order_and_counts() -> None:
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 5
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.pop_front().block_id == 0
    assert q.block_ids() == [1, 2, 3, 4]
    q.remove(blocks[3])  # from the middle
    assert q.block_ids() == [1, 2, 4]
    assert q.num_free == 3
    q.append(blocks[0])  # tail
    q.append(blocks[3])
    assert q.block_ids() == [1, 2, 4, 0, 3]
    assert q.num_free == 5
    q.remove(blocks[1])  # head
    q.remove(blocks[3])  # tail
    assert q.block_ids() == [2, 4, 0]
    assert [q.pop_front().block_id for _ in range(3)] == [2, 4, 0]
    assert q.num_free == 0
    assert q.block_ids() == []


def test_free_queue_pop_empty_raises() -> None:
    q = FreeBlockQueue([])
    assert q.num_free == 0
    with pytest.raises(RuntimeError, match="no free blocks"):
        q.pop_front()


def test_free_queue_remove_of_block_not_in_queue_asserts() -> None:
    blocks = [Block(0), Block(1)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[0])
    with pytest.raises(AssertionError, match="is not free"):
        q.remove(blocks[0])
    assert q.num_free == 1
    assert q.block_ids() == [1]


# ---------------------------------------------------------------- allocation and free


def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_initial_allocation_order() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8
    a = pool.allocate(3)
    assert ids(a) == [0, 1, 2]
    assert all(b.ref_count == 1 for b in a)
    b = pool.allocate(2)
    assert ids(b) == [3, 4]
    assert pool.num_free_blocks == 3
    assert pool.free_queue.block_ids() == [5, 6, 7]


def test_free_goes_to_tail_in_given_order() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # 0, 1, 2
    pool.free([a[1], a[0], a[2]])
    assert pool.free_queue.block_ids() == [3, 4, 5, 1, 0, 2]
    assert all(blk.ref_count == 0 for blk in a)
    # Fresh blocks first, then the freed ones in the order they were freed.
    assert ids(pool.allocate(6)) == [3, 4, 5, 1, 0, 2]
    assert pool.num_free_blocks == 0


def test_allocate_beyond_free_raises_and_leaves_pool_unchanged() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    assert pool.can_allocate(1)
    assert not pool.can_allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    # check-then-act: the failed call took nothing
    assert pool.num_free_blocks == 1
    assert pool.free_queue.block_ids() == [3]
    assert ids(pool.allocate(1)) == [3]
    assert not pool.can_allocate(1)
    assert pool.can_allocate(0)
    assert pool.allocate(0) == []


def test_double_free_asserts() -> None:
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([blk])
    assert blk.ref_count == 0
    assert pool.num_free_blocks == 2


def test_ref_counts_with_sharing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0, 1
    assert pool.cache_block(a[0], 111)
    assert pool.cache_block(a[1], 222)
    # A second request hits both cached blocks while the first still holds them.
    hits = [pool.lookup(111), pool.lookup(222)]
    assert ids(hits) == [0, 1]
    pool.touch(hits)
    assert [b.ref_count for b in a] == [2, 2]
    assert pool.num_free_blocks == 2  # in-use blocks were never in the queue
    pool.free(reversed(a))
    assert [b.ref_count for b in a] == [1, 1]
    assert pool.num_free_blocks == 2
    assert pool.free_queue.block_ids() == [2, 3]
    pool.free(reversed(hits))
    assert [b.ref_count for b in a] == [0, 0]
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    # still cached while free
    assert pool.lookup(111) is a[0]
    assert pool.lookup(222) is a[1]


# ---------------------------------------------------------------- prefix cache


def test_cache_block_duplicate_hash_returns_false() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 42) is True
    assert pool.cache_block(b, 42) is False  # another block already holds that hash
    assert b.block_hash is None
    assert pool.cached == {42: a}
    assert pool.cache_block(a, 43) is False  # a block is cached under one hash only
    assert a.block_hash == 42
    assert pool.cached == {42: a}


def test_lru_eviction_order_tail_blocks_first() -> None:
    pool = BlockPool(6)
    seq1 = pool.allocate(3)  # 0, 1, 2
    seq2 = pool.allocate(3)  # 3, 4, 5
    for i, blk in enumerate(seq1):
        assert pool.cache_block(blk, 100 + i)
    for i, blk in enumerate(seq2):
        assert pool.cache_block(blk, 200 + i)
    # seq1 finishes first, then seq2; each frees tail-first.
    pool.free(reversed(seq1))
    pool.free(reversed(seq2))
    assert pool.free_queue.block_ids() == [2, 1, 0, 5, 4, 3]
    assert len(pool.cached) == 6
    # Handing out blocks evicts the least recently used first, a sequence's tail first.
    got = pool.allocate(2)
    assert ids(got) == [2, 1]
    assert pool.num_evictions == 2
    assert sorted(pool.cached) == [100, 200, 201, 202]
    assert got[0].block_hash is None and got[1].block_hash is None
    assert pool.lookup(102) is None
    assert pool.lookup(101) is None
    assert pool.lookup(100) is seq1[0]
    got2 = pool.allocate(2)
    assert ids(got2) == [0, 5]
    assert pool.num_evictions == 4
    assert sorted(pool.cached) == [200, 201]


def test_touch_removes_free_cached_block_from_queue() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0, 1
    pool.cache_block(a[0], 7)
    pool.cache_block(a[1], 8)
    pool.free(reversed(a))
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    hit = pool.lookup(7)
    assert hit is a[0]
    pool.touch([hit])
    assert hit.ref_count == 1
    assert pool.free_queue.block_ids() == [2, 3, 1]
    assert pool.num_free_blocks == 3
    # The touched block is not handed out again, and stays cached.
    assert ids(pool.allocate(3)) == [2, 3, 1]
    assert pool.cached == {7: a[0]}
    assert pool.num_evictions == 1
    assert not pool.can_allocate(1)
    pool.free([hit])
    assert pool.free_queue.block_ids() == [0]
    assert pool.lookup(7) is hit


def test_evicting_removes_from_cached() -> None:
    pool = BlockPool(1)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, 5)
    pool.free([blk])
    assert pool.cached == {5: blk}
    (again,) = pool.allocate(1)
    assert again is blk
    assert pool.cached == {}
    assert blk.block_hash is None
    assert pool.lookup(5) is None
    assert pool.num_evictions == 1
    # Now it can be cached under a new hash.
    assert pool.cache_block(blk, 6)
    assert pool.cached == {6: blk}


def test_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    a = pool.allocate(3)
    for i, blk in enumerate(a):
        pool.cache_block(blk, i + 1)
    pool.free(a[:2])
    pool.reset_prefix_cache()
    assert pool.cached == {}
    assert all(b.block_hash is None for b in a)
    assert pool.num_free_blocks == 2
    assert a[2].ref_count == 1


def test_prefix_caching_disabled() -> None:
    pool = BlockPool(3, enable_prefix_caching=False)
    a = pool.allocate(2)
    assert pool.cache_block(a[0], 9) is False
    assert a[0].block_hash is None
    assert pool.cached == {}
    assert pool.lookup(9) is None
    pool.free(reversed(a))
    assert pool.free_queue.block_ids() == [2, 1, 0]
    assert ids(pool.allocate(3)) == [2, 1, 0]
    assert pool.num_evictions == 0


def test_invariant_every_block_in_use_or_free() -> None:
    pool = BlockPool(10)
    a = pool.allocate(4)
    b = pool.allocate(3)
    pool.free(a[1:3])
    in_queue = set(pool.free_queue.block_ids())
    for blk in pool.blocks:
        assert (blk.ref_count > 0) != (blk.block_id in in_queue)
    assert len(in_queue) == pool.num_free_blocks == 5
    pool.free(b)
    pool.free([a[0], a[3]])
    assert pool.num_free_blocks == 10
    assert sorted(pool.free_queue.block_ids()) == list(range(10))


def test_many_alloc_free_cycles_are_fast() -> None:
    """O(1) per block: 100k cycles on a large pool take well under a second or two.
    A list scan per operation (num_blocks = 10k) would take far longer."""
    pool = BlockPool(10_000)
    start = time.perf_counter()
    held: list[Block] = []
    for i in range(100_000):
        blocks = pool.allocate(1)
        if i % 3 == 0:
            pool.cache_block(blocks[0], i)
        held.extend(blocks)
        if len(held) >= 8:
            pool.free(reversed(held))
            held = []
    pool.free(held)
    elapsed = time.perf_counter() - start
    assert pool.num_free_blocks == 10_000
    assert elapsed < 5.0, elapsed


def test_untouched_blocks_are_made_on_first_hand_out() -> None:
    """A pool links no block up front: the never-used ones are the queue's head, in id order,
    and `blocks` (tests, debugging) makes them without handing them out."""
    pool = BlockPool(6)
    assert pool.num_free_blocks == 6 and pool.free_queue.block_ids() == [0, 1, 2, 3, 4, 5]
    a = pool.allocate(2)
    pool.free(reversed(a))  # freed blocks go behind the untouched ones
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    every = pool.blocks  # makes 2..5; they stay free and untouched
    assert [b.block_id for b in every] == [0, 1, 2, 3, 4, 5] and all(b.ref_count == 0 for b in every)
    b = pool.allocate(5)
    assert ids(b) == [2, 3, 4, 5, 1]
    assert b[0] is every[2]  # the same objects `blocks` made
    assert pool.num_free_blocks == 1 and pool.free_queue.block_ids() == [0]


# ---------------------------------------------------------------- evictions recorded for the tiers


def test_evicted_blocks_are_recorded_in_eviction_order_and_clear_is_not() -> None:
    pool = BlockPool(3)
    pool.evicted = []
    a, b, c = pool.allocate(3)
    assert [pool.cache_block(blk, h) for blk, h in ((a, 10), (b, 11), (c, 12))] == [True, True, True]
    pool.free([c, a, b])  # free queue: 2, 0, 1
    assert pool.evicted == []
    got = pool.allocate(2)  # hands out 2 then 0: both cached, both recorded
    assert ids(got) == [2, 0]
    assert pool.evicted == [(12, 2), (10, 0)]
    assert set(pool.cached) == {11}
    pool.reset_prefix_cache()  # a clear: nothing moves down
    assert pool.evicted == [(12, 2), (10, 0)]
    assert pool.cached == {}


def test_evictions_not_recorded_without_tiers() -> None:
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5)
    pool.free([a])
    pool.allocate(1)
    assert pool.evicted is None and pool.num_evictions == 1
