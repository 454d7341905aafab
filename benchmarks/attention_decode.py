"""Decode attention alone, in GB/s of KV read: kvserve's paged Triton kernel (split-KV and
one-pass) against FlexAttention's paged decode and SDPA on contiguous K/V.

    python -m benchmarks.attention_decode [--batches 1,64,256] [--context 1024] [--tiny]

On CUDA: Llama-3-8B's attention shape (32 query heads, 8 KV heads, head dim 128, bf16),
kvserve's 16-token pages; every method gets the same keys, values and queries, timed
with CUDA events (median of `--iters`). FlexAttention runs compiled over torch's
experimental PagedAttention (its own page table; pages of 128 tokens, the block size
its block mask needs); SDPA reads each sequence's K/V laid out contiguously, the floor a
paged kernel is measured against. GB/s = (K and V bytes of every context + q and out)
/ time. `--tiny` (automatic without CUDA): a tiny shape on CPU, only a smoke run; the
Triton kernels run there only under TRITON_INTERPRET=1 (else they are left out) and
FlexAttention eagerly. Every method's output is compared with SDPA's (max |diff|).
Last line: RESULT gbps_b<B>_<method>=... per batch and method, split_over_one_pass_b<B>=...
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class Batch:
    q: torch.Tensor  # (B, Hq, D)
    k: torch.Tensor  # (B, Hkv, ctx, D) contiguous
    v: torch.Tensor
    key_cache: torch.Tensor  # (num_blocks, block, Hkv, D): kvserve's pages
    value_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(shape: Shape, batch: int, context: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    hkv, d, bs = shape.num_kv_heads, shape.head_dim, shape.block_size
    k = torch.randn(batch, hkv, context, d, generator=g).to(shape.device, shape.dtype)
    v = torch.randn(batch, hkv, context, d, generator=g).to(shape.device, shape.dtype)
    q = torch.randn(batch, shape.num_heads, d, generator=g).to(shape.device, shape.dtype)
    per_seq = -(-context // bs)
    pages = (torch.randperm(batch * per_seq, generator=g) + 1).view(batch, per_seq)  # block 0 unused
    key_cache = torch.zeros(batch * per_seq + 1, bs, hkv, d, dtype=shape.dtype, device=shape.device)
    value_cache = torch.zeros_like(key_cache)
    pad = per_seq * bs - context
    for src, dst in ((k, key_cache), (v, value_cache)):
        tokens = F.pad(src.transpose(1, 2), (0, 0, 0, 0, 0, pad))  # (B, per_seq*bs, Hkv, D)
        dst[pages.flatten().to(shape.device)] = tokens.reshape(batch * per_seq, bs, hkv, d)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long, device=shape.device), num_decode_tokens=batch,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=shape.device),
        seqused_k=torch.full((batch,), context, dtype=torch.int32, device=shape.device),
        block_table=pages.to(torch.int32).to(shape.device), max_query_len=1, max_context_len=context,
    )
    return Batch(q, k, v, key_cache, value_cache, meta)


def sdpa(b: Batch) -> Callable[[], torch.Tensor]:
    q = b.q.unsqueeze(2)  # (B, Hq, 1, D)
    return lambda: F.scaled_dot_product_attention(q, b.k, b.v, enable_gqa=True).squeeze(2)


def triton_paged(b: Batch, num_splits: int | None) -> Callable[[], torch.Tensor]:
    from worker.attention.triton_paged import paged_attention

    scale = b.q.shape[-1] ** -0.5
    out = torch.empty_like(b.q)
    return lambda: paged_attention(b.q, b.key_cache, b.value_cache, b.meta, scale, out=out, num_splits=num_splits)


def flex_paged(b: Batch, page_size: int) -> Callable[[], torch.Tensor]:
    """torch's experimental PagedAttention over flex_attention (compiled on CUDA)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, hkv, context, d = b.k.shape
    device = b.q.device
    n_pages = batch * -(-context // page_size)
    paged = PagedAttention(n_pages, page_size, batch, device=str(device))
    idx = torch.arange(batch, device=device)
    for i in range(batch):  # reserve takes one sequence at a time
        paged.reserve(idx[i : i + 1], torch.tensor([context], device=device))
    k_cache = torch.zeros(1, hkv, n_pages * page_size, d, dtype=b.k.dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(context, device=device).expand(batch, context)
    paged.assign(idx, positions, b.k, b.v, k_cache, v_cache)
    kv_len = torch.full((batch,), context, device=device)

    def visible(bi: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx < kv_len[bi]

    logical = create_block_mask(visible, batch, None, 1, context, device=str(device), BLOCK_SIZE=(128, page_size))
    mask = paged.convert_logical_block_mask(logical)
    attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
    q = b.q.unsqueeze(2)
    return lambda: attend(q, k_cache, v_cache, block_mask=mask, enable_gqa=True).squeeze(2)


def time_it(fn: Callable[[], torch.Tensor], device: str, iters: int) -> float:
    """Median seconds per call, after warm-up calls (compilation, autotuning)."""
    for _ in range(3 if device == "cuda" else 1):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def methods(b: Batch, shape: Shape) -> dict[str, Callable[[], torch.Tensor]]:
    out: dict[str, Callable[[], torch.Tensor]] = {"sdpa_contiguous": sdpa(b)}
    if shape.device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        out["triton_split"] = triton_paged(b, None if shape.device == "cuda" else 4)
        out["triton_one_pass"] = triton_paged(b, 1)
    else:
        print("triton kernels left out: on a CPU they run only under TRITON_INTERPRET=1")
    try:
        out["flex_paged"] = flex_paged(b, 128)
    except Exception as e:  # an older torch without the experimental API
        print(f"flex_paged left out: {type(e).__name__}: {e}")
    return out


def run(shape: Shape, batches: list[int], context: int, iters: int) -> dict[str, float]:
    elem = torch.empty((), dtype=shape.dtype).element_size()
    fields: dict[str, float] = {}
    print(f"{'batch':>6} {'method':>16} {'us':>10} {'GB/s':>9} {'max |diff| vs sdpa':>19}")
    for batch in batches:
        b = make_batch(shape, batch, context)
        nbytes = (2 * batch * context * shape.num_kv_heads + 2 * batch * shape.num_heads) * shape.head_dim * elem
        reference = sdpa(b)().float()
        for name, fn in methods(b, shape).items():
            diff = (fn().float() - reference).abs().max().item()
            seconds = time_it(fn, shape.device, iters)
            fields[f"gbps_b{batch}_{name}"] = nbytes / seconds / 1e9
            fields[f"diff_b{batch}_{name}"] = diff
            print(f"{batch:>6} {name:>16} {1e6 * seconds:>10.1f} {nbytes / seconds / 1e9:>9.1f} {diff:>19.2e}")
        if f"gbps_b{batch}_triton_split" in fields:
            fields[f"split_over_one_pass_b{batch}"] = (fields[f"gbps_b{batch}_triton_split"]
                                                      / fields[f"gbps_b{batch}_triton_one_pass"])
        sys.stdout.flush()
    return fields


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=None, help="comma-separated (default 1,64,256; --tiny 1,3)")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default 1024; --tiny 100)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU (automatic without CUDA)")
    args = p.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    if tiny:
        # Eager flex on a CPU warns, every call, that it is not fused: known, and not timed for it.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        shape = Shape(4, 2, 32, 16, torch.float32, "cpu")
        batches, context, iters = [1, 3], 100, args.iters or 2
    else:
        shape = Shape(32, 8, 128, 16, torch.bfloat16, "cuda")
        batches, context, iters = [1, 64, 256], 1024, args.iters or 20
    batches = [int(x) for x in args.batches.split(",")] if args.batches else batches
    context = args.context or context
    print(f"decode attention: {shape.num_heads} q heads, {shape.num_kv_heads} kv heads, head dim {shape.head_dim}, "
          f"{shape.dtype}, {context} tokens of context, on {shape.device}")
    fields = run(shape, batches, context, iters)
    print("RESULT " + " ".join(f"{k}={v:.3g}" for k, v in fields.items() if not k.startswith("diff_")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
