"""Split-KV (flash-decoding) paged attention for decode-only batches, in Triton.

The one-pass kernel (worker/attention/triton_paged.py) runs one program per sequence per
KV head: a decode batch of 1 on an 8-KV-head model is 8 programs on a GPU with 100+ SMs,
each walking the whole context alone. Here every (sequence, KV head) is split into
NUM_SPLITS contiguous key ranges, one program each, then a reduce combines them:

    partial (grid S x Hkv x NUM_SPLITS): keys [lo + i*chunk, lo + (i+1)*chunk) of the
        sequence (lo: 0, or the window's first key), chunk = cdiv(span, NUM_SPLITS)
        rounded up to BLOCK_N; per query head its running max m_i, sum l_i (log2 units,
        as the one-pass kernel) and unnormalised accumulator acc_i. A split past the
        context's end stores m = -inf, l = 0, acc = 0.
    reduce (grid S x Hq): M = max(m_i, sink), out = sum_i 2^(m_i - M) acc_i /
        (sum_i 2^(m_i - M) l_i + [sinks] 2^(sink - M)); a sink joins only the denominator.

NUM_SPLITS depends on the batch's row count and the KV head count only (`decode_splits`),
never on the contexts, so a CUDA graph captured for a decode bucket replays with the split
count it was captured with. GQA packs a KV head's query heads into one program's rows, as
the one-pass kernel does; the sliding window bounds the key span before it is split.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from worker.attention.base import AttentionMetadata
from worker.attention.kv_quant import KV_FP8_DTYPE, KV_FP8_SCALE
from worker.attention.triton_support import next_pow2, tl, triton


_LOG2E = 1.4426950408889634

MAX_SPLITS = 16
# Splits aim at this many programs per SM: enough to hide a program's load latency.
PROGRAMS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    """The device's SM count, asked once (decode_splits runs per layer per step)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """The split count of a decode batch: 1 when (sequence, KV head) programs already fill
    the device, else enough splits to give every SM PROGRAMS_PER_SM programs (at most
    MAX_SPLITS). A function of the batch's shape only (graph-static)."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-PROGRAMS_PER_SM * sms // programs)))


if triton is not None:

    @triton.jit
    def _split_kv_partial_kernel(
        q_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr,
        acc_ptr, ml_ptr, scale_log2, kv_scale,
        stride_q_tok, stride_q_head,
        stride_k_block, stride_k_off, stride_k_head,
        stride_v_block, stride_v_off, stride_v_head,
        stride_bt_seq, stride_acc_seq, stride_acc_head, stride_acc_split, stride_ml_seq, stride_ml_head,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
        DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr = False,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        q_tok = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) - q_tok == 1:  # a padded row (no query) does nothing
            context_len = tl.load(seqused_k_ptr + seq)
            rows = tl.arange(0, BLOCK_M)
            row_ok = rows < GROUP
            head = kv_head * GROUP + rows
            d = tl.arange(0, HEAD_DIM_PAD)
            d_ok = d < HEAD_DIM
            q = tl.load(q_ptr + q_tok * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            kv_lo = 0
            if SLIDING_WINDOW > 0:
                kv_lo = tl.maximum(context_len - SLIDING_WINDOW, 0)
            chunk = tl.cdiv(tl.cdiv(context_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
            start = kv_lo + split * chunk
            end = tl.minimum(start + chunk, context_len)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_M], 0.0, tl.float32)
            acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
            for start_n in range(start, end, BLOCK_N):
                n = start_n + tl.arange(0, BLOCK_N)
                n_ok = n < end
                block = tl.load(block_table_ptr + seq * stride_bt_seq + n // BLOCK_SIZE, mask=n_ok, other=0)
                block = block.to(tl.int64)  # block * stride passes 2**31 on big caches
                off = n % BLOCK_SIZE
                k_offs = block[None, :] * stride_k_block + off[None, :] * stride_k_off + kv_head * stride_k_head
                k = tl.load(key_cache_ptr + k_offs + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
                if KV_FP8:  # an e4m3 pool: the tile is dequantized at its load (kv_quant.py)
                    k = (k.to(tl.float32) * kv_scale).to(q.dtype)
                s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
                s = tl.where(n_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v_offs = block[:, None] * stride_v_block + off[:, None] * stride_v_off + kv_head * stride_v_head
                v = tl.load(value_cache_ptr + v_offs + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                if KV_FP8:
                    v = (v.to(tl.float32) * kv_scale).to(q.dtype)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                m_i = m_new
            acc_offs = seq * stride_acc_seq + head[:, None] * stride_acc_head + split * stride_acc_split + d[None, :]
            tl.store(acc_ptr + acc_offs, acc, mask=row_ok[:, None] & d_ok[None, :])
            ml_offs = seq * stride_ml_seq + head * stride_ml_head + split * 2
            tl.store(ml_ptr + ml_offs, m_i, mask=row_ok)
            tl.store(ml_ptr + ml_offs + 1, l_i, mask=row_ok)

    @triton.jit
    def _split_kv_reduce_kernel(
        out_ptr, acc_ptr, ml_ptr, cu_seqlens_q_ptr, sinks_ptr,
        stride_o_tok, stride_o_head,
        stride_acc_seq, stride_acc_head, stride_acc_split, stride_ml_seq, stride_ml_head,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        q_tok = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) - q_tok == 1:
            i = tl.arange(0, SPLITS_PAD)
            i_ok = i < NUM_SPLITS
            ml = ml_ptr + seq * stride_ml_seq + head * stride_ml_head + i * 2
            m = tl.load(ml, mask=i_ok, other=float("-inf"))
            l_part = tl.load(ml + 1, mask=i_ok, other=0.0)
            big_m = tl.max(m, 0)
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
                big_m = tl.maximum(big_m, sink)
            m_safe = tl.where(big_m == float("-inf"), 0.0, big_m)
            w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_safe))
            denom = tl.sum(w * l_part, 0)
            if HAS_SINKS:
                denom += tl.exp2(sink - m_safe)
            d = tl.arange(0, HEAD_DIM_PAD)
            d_ok = d < HEAD_DIM
            acc = tl.load(acc_ptr + seq * stride_acc_seq + head * stride_acc_head + i[:, None] * stride_acc_split
                          + d[None, :], mask=i_ok[:, None] & d_ok[None, :], other=0.0)
            out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
            tl.store(out_ptr + q_tok * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty),
                     mask=d_ok)


def split_kv_decode(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: torch.Tensor, num_splits: int, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (every sequence has one query token, or none: a padded row) of the
    flat batch, its keys split NUM_SPLITS ways, then reduced into `out`."""
    assert meta.cu_seqlens_q is not None and meta.seqused_k is not None and meta.block_table is not None
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = meta.seqused_k.shape[0]
    acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    kwargs: dict[str, Any] = {"num_warps": 4, "num_stages": 2} if q.device.type == "cuda" else {}
    head_dim_pad = max(16, next_pow2(head_dim))
    _split_kv_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, meta.block_table, meta.cu_seqlens_q, meta.seqused_k, acc, ml, scale * _LOG2E,
        KV_FP8_SCALE, q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        meta.block_table.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1),
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=max(16, next_pow2(group)), BLOCK_N=max(16, min(64, 4 * block_size)) if block_size < 64 else block_size,
        NUM_SPLITS=num_splits, SLIDING_WINDOW=sliding_window or 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=key_cache.dtype == KV_FP8_DTYPE,
        **kwargs,
    )
    _split_kv_reduce_kernel[(num_seqs, num_heads)](
        out, acc, ml, meta.cu_seqlens_q, sinks if sinks is not None else q,
        out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, next_pow2(num_splits)),
        HAS_SINKS=sinks is not None,
    )
    return out
