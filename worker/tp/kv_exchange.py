"""Moving one request's KV between the ranks of a tensor-parallel group and rank 0, for
prefill/decode disaggregation.

Each rank's paged cache holds only its KV heads (worker/model/parallel.py:kv_head_range),
at the SAME block ids on every rank. An export must carry the whole model's layout, so
that a decode pool of any TP size (1 included) can import it:

    rank r cache (layers, 2, blocks, bs, Hkv/N, D) --gather_blocks(ids)--> local_r
    rank 0: gather local_0..local_{N-1} (gloo, the plan group) and place each at its
            head range along axis 3 -> (layers, 2, len(ids)*bs, Hkv, D)

Import is the inverse: rank 0 slices the export by head range and scatters the slices.
When Hkv < N the heads are replicated (several ranks hold the same head): the export
writes a head once per holder (identical values) and the import sends each holder its copy.

Tensors travel as raw bytes (uint8 views): gloo moves bf16 or fp16 as it moves bytes, and
the plan group is a CPU group whatever the model's device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kv.kv_cache import KVCacheSpec
from worker.model.parallel import TPContext, kv_head_range


def head_ranges(num_heads: int, num_kv_heads: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) of the KV heads each rank holds, rank 0 first."""
    return [kv_head_range(num_heads, num_kv_heads, TPContext(rank, size)) for rank in range(size)]


def assemble_heads(parts: list[torch.Tensor], ranges: list[tuple[int, int]], num_kv_heads: int) -> torch.Tensor:
    """Per-rank (layers, 2, T, h, D) tensors -> (layers, 2, T, num_kv_heads, D)."""
    first = parts[0]
    full = first.new_empty((*first.shape[:3], num_kv_heads, first.shape[4]))
    for part, (lo, hi) in zip(parts, ranges):
        full[:, :, :, lo:hi] = part
    return full


def split_heads(kv: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """(layers, 2, T, Hkv, D) -> each rank's contiguous (layers, 2, T, h, D) slice."""
    return [kv[:, :, :, lo:hi].contiguous() for lo, hi in ranges]


def local_shape(spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
    """The shape of one rank's share of `num_blocks` blocks (spec = that rank's cache)."""
    return (spec.num_layers, spec.num_planes, num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().view(torch.uint8)


def gather_to_rank0(local: torch.Tensor, rank: int, size: int, group: object) -> list[torch.Tensor] | None:
    """A collective: every rank gives its (same-shaped) tensor; rank 0 gets all of them
    (as CPU tensors), the others None."""
    raw = _as_bytes(local)
    if rank != 0:
        dist.gather(raw, None, dst=0, group=group)
        return None
    bufs = [torch.empty_like(raw) for _ in range(size)]
    dist.gather(raw, bufs, dst=0, group=group)
    return [b.view(local.dtype) for b in bufs]


def scatter_from_rank0(
    parts: list[torch.Tensor] | None, shape: tuple[int, ...], dtype: torch.dtype, rank: int, group: object
) -> torch.Tensor:
    """A collective: rank 0 gives one tensor per rank (`parts`), every rank receives its
    own, of `shape` and `dtype` (a CPU tensor)."""
    out = torch.empty(shape, dtype=dtype).view(torch.uint8)
    raws = [_as_bytes(p) for p in parts] if rank == 0 and parts is not None else None
    dist.scatter(out, raws, src=0, group=group)
    return out.view(dtype)
