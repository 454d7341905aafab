"""Tensor-parallel (Megatron-style) layers for the Llama family.

With `tp.size == 1` every layer is the plain single-device layer (same parameters, same
matmuls, no collective), so the single-device path costs nothing extra.

Sharding over N ranks (rank r):

    ColumnParallelLinear  weight rows = the output features; a fused projection is a list
                          of *parts* (q, k, v or gate, up) and rank r holds its row range
                          of every part, concatenated:  [q_r ; k_r ; v_r]  /  [gate_r ; up_r].
                          Output stays sharded (no collective). The model builds the two
                          fused ones by their full sizes: QKVParallelLinear (by heads) and
                          MergedColumnParallelLinear (even split), which work out the shard.
    RowParallelLinear     weight cols = the input features; rank r holds cols
                          [r*in/N, (r+1)*in/N); partial outputs are summed (one all_reduce).
    VocabParallelEmbedding rank r holds vocab rows [r*S, min(V, (r+1)*S)), S = ceil(V/N);
                          ids outside the shard look up zeros; one all_reduce.
    ParallelLMHead        the same vocab shard; local logits are all_gathered (every rank
                          gets the full (T, V) logits; rank 0 samples).

KV heads: with Hkv >= N each rank holds Hkv/N of them; with Hkv < N (N % Hkv == 0) each
rank holds the ONE kv head that its Hq/N query heads attend with (replicated N/Hkv times).

The model (worker/model/llama.py) gives these layers full, unsharded sizes and a TPContext;
every shard computation lives here, so the model only chooses which layer class it builds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPContext:
    """Where this process sits in its tensor-parallel group. `group` is a
    torch.distributed process group (None = the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.size > 1


SINGLE = TPContext()


def validate_tp(num_heads: int, num_kv_heads: int, size: int, intermediate_size: int | None = None) -> None:
    """Raise ValueError (clear message) when the model cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {num_heads} attention heads; "
            f"choose a size that divides {num_heads}"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} and the model's {num_kv_heads} KV heads: one must divide "
            f"the other (KV heads are split across ranks, or replicated when fewer than ranks)"
        )
    if intermediate_size is not None and intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's intermediate_size {intermediate_size}"
        )


def shard_range(total: int, tp: TPContext) -> tuple[int, int]:
    """Even split of `total` (divisible by tp.size) -> this rank's [lo, hi)."""
    per = total // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def kv_head_range(num_heads: int, num_kv_heads: int, tp: TPContext) -> tuple[int, int]:
    """The kv heads this rank holds, [lo, hi)."""
    if num_kv_heads >= tp.size:
        return shard_range(num_kv_heads, tp)
    # Replicated: rank r's first q head is r*Hq/N; its kv head is that // (Hq/Hkv).
    head = (tp.rank * (num_heads // tp.size)) // (num_heads // num_kv_heads)
    return head, head + 1


def vocab_range(vocab_size: int, tp: TPContext) -> tuple[int, int, int]:
    """(lo, hi, padded shard rows) of this rank's vocab shard."""
    per = -(-vocab_size // tp.size)
    lo = min(vocab_size, tp.rank * per)
    return lo, min(vocab_size, lo + per), per


def all_reduce(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T (+ b_local). `part_ranges[j]` = the rows [lo, hi) of part j
    (of the full, unsharded checkpoint tensor) this rank holds; the loader reads exactly
    those rows."""

    def __init__(
        self, in_features: int, part_ranges: list[tuple[int, int]], bias: bool, tp: TPContext = SINGLE
    ) -> None:
        super().__init__()
        self.part_ranges = part_ranges
        self.part_offsets = []  # first local row of each part
        n = 0
        for lo, hi in part_ranges:
            self.part_offsets.append(n)
            n += hi - lo
        self.weight = nn.Parameter(torch.empty(n, in_features))
        self.bias = nn.Parameter(torch.empty(n)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused [q; k; v] projection, sharded by heads: this rank's query heads and the
    kv heads they attend with. `num_heads` / `num_kv_heads` are this rank's counts."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
        tp: TPContext = SINGLE,
    ) -> None:
        validate_tp(num_heads, num_kv_heads, tp.size)
        q_lo, q_hi = shard_range(num_heads, tp)
        kv_lo, kv_hi = kv_head_range(num_heads, num_kv_heads, tp)
        d = head_dim
        kv_rows = (kv_lo * d, kv_hi * d)
        super().__init__(hidden_size, [(q_lo * d, q_hi * d), kv_rows, kv_rows], bias, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = q_hi - q_lo, kv_hi - kv_lo, d


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Parts of equal size (gate, up), each split evenly; `part_size` is this rank's size
    of one part."""

    def __init__(
        self, in_features: int, part_size: int, num_parts: int, bias: bool, tp: TPContext = SINGLE,
        name: str = "intermediate_size",
    ) -> None:
        if part_size % tp.size:
            raise ValueError(f"tensor_parallel_size={tp.size} does not divide the model's {name} {part_size}")
        lo, hi = shard_range(part_size, tp)
        super().__init__(in_features, [(lo, hi)] * num_parts, bias, tp)
        self.part_size = hi - lo


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, lo:hi]^T) (+ b); x arrives already sharded on its last
    dim. The bias (replicated, whole) is added once, after the sum over ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext = SINGLE, bias: bool = False) -> None:
        super().__init__()
        self.col_range = shard_range(in_features, tp)
        self.weight = nn.Parameter(torch.empty(out_features, self.col_range[1] - self.col_range[0]))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight), self.tp)
        return out if self.bias is None else out + self.bias


class _VocabShard(nn.Module):
    """This rank's rows [lo, hi) of a (vocab, hidden) matrix. Padded to `per` rows on every
    rank so the LM head's all_gather has equal shapes; pad rows are zero (loader) and their
    logits are cut off after the gather."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext = SINGLE) -> None:
        super().__init__()
        lo, hi, per = vocab_range(vocab_size, tp) if tp.is_parallel else (0, vocab_size, vocab_size)
        self.vocab_size = vocab_size
        self.row_range = (lo, hi)
        self.weight = nn.Parameter(torch.empty(per, hidden_size))
        self.tp = tp

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Full (T, V) logits on every rank, with this matrix as the output projection
        (the LM head's, or the embedding's when they are tied); fp32 unless `fp32` is
        False (then in the model dtype: enough for a greedy argmax)."""
        return parallel_logits(hidden, self.weight, self.vocab_size, self.tp, fp32)


class VocabParallelEmbedding(_VocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        lo, hi = self.row_range
        outside = (input_ids < lo) | (input_ids >= hi)
        local = (input_ids - lo).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce(out, self.tp)


class ParallelLMHead(_VocabShard):
    """Vocab-sharded output projection (logits by parallel_logits); `weight` may be the
    embedding's (tied)."""


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPContext,
                    fp32: bool = True) -> torch.Tensor:
    """Full (T, V) logits on every rank from a vocab-sharded weight: fp32, or (`fp32`
    False, one rank) the model dtype's, whose argmax is the fp32 upcast's (the upcast is
    exact), at half the bytes written and read."""
    local = F.linear(hidden, weight)
    if not tp.is_parallel:
        return local.float() if fp32 else local
    local = local.float()
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)[:, :vocab_size]
