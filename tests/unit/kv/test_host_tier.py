"""HostTier: exact slots, LRU push-out with the pushed blocks' KV, recency on reads."""
from __future__ import annotations

import pytest
import torch

from kv.host_tier import HostTier
from kv.kv_cache import KVCacheSpec

SHAPE_ONE = (2, 2, 4, 1, 2)  # one block: (layers, 2, block_size, H, D)
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype=torch.float32)


def blocks(*values: float) -> torch.Tensor:
    """(layers, 2, n * block_size, H, D), block i filled with values[i]."""
    parts = [torch.full((2, 2, 4, 1, 2), v) for v in values]
    return torch.cat(parts, dim=2)


def test_put_get_roundtrip_and_exact_slots() -> None:
    tier = HostTier(SPEC, num_slots=3)
    assert tier.put([7, 8], blocks(1.0, 2.0)) == []
    assert tier._slots == {7: 0, 8: 1}
    assert torch.equal(tier.get([8, 7]), blocks(2.0, 1.0))
    assert 7 in tier and 9 not in tier and len(tier) == 2


def test_full_tier_pushes_out_least_recently_used_with_its_kv() -> None:
    tier = HostTier(SPEC, num_slots=2)
    tier.put([1, 2], blocks(1.0, 2.0))
    tier.get([1])  # 2 is now the least recently used
    pushed = tier.put([3], blocks(3.0))
    assert [h for h, _ in pushed] == [2]
    assert torch.equal(pushed[0][1], blocks(2.0)[:, :, :, :, :].reshape(2, 2, 4, 1, 2))
    assert tier.hashes() == [1, 3]
    assert tier._slots[3] == 1  # 2's slot, reused
    assert torch.equal(tier.get([3]), blocks(3.0))


def test_put_of_held_hash_only_refreshes() -> None:
    tier = HostTier(SPEC, num_slots=2)
    tier.put([1, 2], blocks(1.0, 2.0))
    assert tier.put([1], blocks(9.0)) == []
    assert tier.hashes() == [2, 1]
    assert torch.equal(tier.get([1]), blocks(1.0))  # first copy kept: same hash, same KV


def test_discard_clear_and_budget() -> None:
    tier = HostTier.for_budget(SPEC, 5 * SPEC.bytes_per_block + 1)
    assert tier.num_slots == 5
    tier.put([1, 2], blocks(1.0, 2.0))
    assert tier.discard(1) and not tier.discard(1)
    tier.clear()
    assert len(tier) == 0 and len(tier._free_slots) == 5
    with pytest.raises(ValueError, match="at least one block"):
        HostTier(SPEC, 0)


def test_more_new_blocks_than_slots_keeps_the_latest() -> None:
    tier = HostTier(SPEC, num_slots=2)
    tier.put([1], blocks(1.0))
    pushed = tier.put([2, 3, 4], blocks(2.0, 3.0, 4.0))
    assert [h for h, _ in pushed] == [1, 2]  # 1 held before, 2 passes straight through
    assert torch.equal(pushed[1][1], blocks(2.0).reshape(SHAPE_ONE))
    assert tier.hashes() == [3, 4]
    assert torch.equal(tier.get([3, 4]), blocks(3.0, 4.0))


def test_kept_blocks_are_pushed_out_after_every_ordinary_one() -> None:
    tier = HostTier(SPEC, num_slots=4)  # max_kept 2
    tier.put([1, 2, 3], blocks(1.0, 2.0, 3.0))
    tier.protect([1, 9])  # 9 is not held: ignored
    assert tier._kept == {1: 0} and tier.hashes() == [2, 3, 1]
    pushed = tier.put([4, 5], blocks(4.0, 5.0))  # one free slot, then the ordinary LRU head
    assert [h for h, _ in pushed] == [2]
    assert tier.hashes() == [3, 4, 5, 1]
    assert tier.recent_hashes(2) == [1, 5]  # kept first, as the router should see them
    # Beyond max_kept the oldest kept block is the next ordinary one pushed out.
    tier.protect([3, 4])
    assert list(tier._kept) == [3, 4] and tier.hashes() == [1, 5, 3, 4]
    assert [h for h, _ in tier.put([6], blocks(6.0))] == [1]
    # A kept block read back is an ordinary one again, most recently used.
    assert torch.equal(tier.get([3]), blocks(3.0))
    assert list(tier._kept) == [4] and tier.hashes() == [5, 6, 3, 4]
    # With no ordinary block left, kept ones go, oldest first.
    tier.protect([5, 6])  # 5 kept, then 4 demoted to the front of the ordinary LRU
    assert tier.hashes() == [4, 3, 5, 6]
    assert tier.discard(6) and 6 not in tier and len(tier) == 3
    tier.clear()
    assert len(tier) == 0 and tier.put([7, 8, 9, 10], blocks(7.0, 8.0, 9.0, 10.0)) == []
