"""Rank <-> full-model KV layout for disaggregation under tensor parallelism
(worker/tp/kv_exchange.py) and the plan codec's KV messages. The collectives themselves
run in tests/integration/test_tensor_parallel.py (gloo over Ray actors)."""
from __future__ import annotations

import pytest
import torch

from kv.kv_cache import KVCacheSpec
from worker.tp.kv_exchange import assemble_heads, head_ranges, local_shape, split_heads
from worker.tp.plan_codec import OP_EXPORT_KV, OP_IMPORT_KV, KVOp, PlanDecoder, kv_message, stop_message


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "size", "expected"),
    [
        (4, 4, 2, [(0, 2), (2, 4)]),  # split
        (8, 2, 2, [(0, 1), (1, 2)]),  # GQA, split
        (4, 1, 2, [(0, 1), (0, 1)]),  # MQA: every rank holds the one head
        (8, 2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # replicated: each head on two ranks
    ],
)
def test_head_ranges(num_heads: int, num_kv_heads: int, size: int, expected: list[tuple[int, int]]) -> None:
    assert head_ranges(num_heads, num_kv_heads, size) == expected


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "size"), [(4, 4, 2), (8, 2, 4), (4, 1, 2)])
def test_split_then_assemble_is_the_identity(num_heads: int, num_kv_heads: int, size: int) -> None:
    kv = torch.randn(3, 2, 32, num_kv_heads, 8)
    ranges = head_ranges(num_heads, num_kv_heads, size)
    parts = split_heads(kv, ranges)
    assert all(p.is_contiguous() and p.shape[3] == hi - lo for p, (lo, hi) in zip(parts, ranges))
    assert torch.equal(assemble_heads(parts, ranges, num_kv_heads), kv)


def test_assemble_places_each_rank_at_its_heads() -> None:
    parts = [torch.full((1, 2, 4, 2, 3), float(rank)) for rank in range(2)]
    full = assemble_heads(parts, [(0, 2), (2, 4)], 4)
    assert full[..., :2, :].eq(0).all() and full[..., 2:, :].eq(1).all()


def test_local_shape_is_one_ranks_share() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype=torch.bfloat16)
    assert local_shape(spec, 3) == (2, 2, 48, 1, 8)


def test_kv_messages_round_trip_through_the_decoder() -> None:
    decoder = PlanDecoder()
    assert decoder.decode(kv_message(OP_EXPORT_KV, [7, 3, 9])) == KVOp(OP_EXPORT_KV, [7, 3, 9])
    assert decoder.decode(kv_message(OP_IMPORT_KV, [1])) == KVOp(OP_IMPORT_KV, [1])
    assert decoder.decode(stop_message()) is None
    with pytest.raises(ValueError, match="malformed"):
        decoder.decode(torch.tensor([OP_EXPORT_KV, 3, 0, 1, 2], dtype=torch.long))
