"""Paged attention in Triton (the project's own kernel), for the whole flat batch at once.

Used on CUDA when no flash-attention package loads (Triton ships with CUDA torch builds);
the kernel also runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which
is how the unit tests check it against the torch backend.

One launch per layer covers decodes and prefill chunks alike, from the varlen metadata
(the same fields the flash backend reads):

    cu_seqlens_q : (S + 1,) int32   seq s owns flat tokens [cu[s], cu[s+1])
    seqused_k    : (S,) int32       context_len of seq s (cached + this step's tokens)
    block_table  : (S, W) int32     logical block j of seq s -> physical block; only the
                                    first cdiv(context_len, block_size) entries are read

Query token t of seq s (0 <= t < query_len) sits at position
    q_pos = context_len - query_len + t
and sees keys 0 .. q_pos (causal over cached context + the chunk itself); a decode is the
case query_len = 1. With a sliding window (SLIDING_WINDOW > 0, a compile-time constant per
layer kind) it sees keys q_pos - SLIDING_WINDOW < k <= q_pos, and the key loop starts at
the tile of the first key its first row can see.

Grid: (S, num_q_tiles, Hkv). A program owns one KV head and BLOCK_Q query tokens of one
sequence, with ALL query heads of that KV head packed into its rows (GQA: q head h reads
kv head h // group), so each K/V tile is loaded once per group, not once per q head:

    row r of the tile  ->  token  q_tile * BLOCK_Q + r // GROUP_PAD,
                           q head kv_head * GROUP + r % GROUP_PAD   (rows with
                           r % GROUP_PAD >= GROUP, or a token past the chunk, are padding)

Programs whose tile starts past their chunk exit at once, so the grid is shape-static for a
given (S, max_query_len): a decode-only batch has num_q_tiles = 1, which is what CUDA graph
capture needs (worker/runner/cuda_graphs.py). Softmax runs online in fp32 (exp2 with the scale
folded into log2 units); the output is written for every valid row, nothing else.

Attention sinks (HAS_SINKS): a row's online softmax starts from its head's sink logit as
if it were one more key with value 0 (m = sink, l = 1, acc = 0), so the sink joins the
denominator and nothing else.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from worker.attention.base import AttentionMetadata, write_kv
from worker.attention.kv_quant import KV_FP8_DTYPE, KV_FP8_SCALE
from worker.attention.triton_split_kv import decode_splits, split_kv_decode
from worker.attention.triton_support import TRITON_IMPORT_ERROR, next_pow2, tl, triton

_LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _softmax_start(sinks_ptr, head, row_ok, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr):
        """The online softmax's running max and sum before the first key: empty, or each
        head's sink logit (gpt-oss), in log2 units like the scores; padding rows keep -inf / 0."""
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
            m_i = sink * 1.4426950408889634
            l_i = tl.where(row_ok, 1.0, 0.0)
        return m_i, l_i

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
        block_table_ptr, cu_seqlens_q_ptr, seqused_k_ptr, sinks_ptr,
        scale_log2, kv_scale,
        stride_q_tok, stride_q_head,
        stride_o_tok, stride_o_head,
        stride_k_block, stride_k_off, stride_k_head,
        stride_v_block, stride_v_off, stride_v_head,
        stride_bt_seq,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
        DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr = False,
    ):
        seq = tl.program_id(0)
        q_tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD

        q_start = tl.load(cu_seqlens_q_ptr + seq)
        query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        first_tok = q_tile * BLOCK_Q
        if first_tok < query_len:
            context_len = tl.load(seqused_k_ptr + seq)
            rows = tl.arange(0, BLOCK_M)
            tok = first_tok + rows // GROUP_PAD
            head_in_group = rows % GROUP_PAD
            row_ok = (tok < query_len) & (head_in_group < GROUP)
            head = kv_head * GROUP + head_in_group
            q_pos = context_len - query_len + tok
            d = tl.arange(0, HEAD_DIM_PAD)
            d_ok = d < HEAD_DIM

            q_offs = (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :]
            q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

            m_i, l_i = _softmax_start(sinks_ptr, head, row_ok, BLOCK_M, HAS_SINKS)
            acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
            # The tile's last real token bounds the keys any of its rows may see.
            last_tok = tl.minimum(first_tok + BLOCK_Q, query_len) - 1
            kv_end = context_len - query_len + last_tok + 1
            kv_start = 0
            if SLIDING_WINDOW > 0:  # the tile's first row sees the earliest key of any row
                first_visible = tl.maximum(context_len - query_len + first_tok - SLIDING_WINDOW + 1, 0)
                kv_start = (first_visible // BLOCK_N) * BLOCK_N
            for start_n in range(kv_start, kv_end, BLOCK_N):
                n = start_n + tl.arange(0, BLOCK_N)
                n_ok = n < kv_end
                block = tl.load(block_table_ptr + seq * stride_bt_seq + n // BLOCK_SIZE, mask=n_ok, other=0)
                # int64: block * stride reaches a layer's cache size, past 2**31 on big GPUs.
                block = block.to(tl.int64)
                off = n % BLOCK_SIZE
                k_offs = block[None, :] * stride_k_block + off[None, :] * stride_k_off + kv_head * stride_k_head
                k = tl.load(key_cache_ptr + k_offs + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
                if KV_FP8:  # an e4m3 pool: the tile is dequantized at its load (kv_quant.py)
                    k = (k.to(tl.float32) * kv_scale).to(q.dtype)
                s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # (M, N) fp32, in log2 units
                visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
                if SLIDING_WINDOW > 0:
                    visible = visible & (n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # A row may see nothing in a tile (padding rows; with a window, tiles before
                # the row's own window): guard so it adds 0, never -inf - -inf. Every valid
                # row sees its own key in some tile, so its final l_i > 0.
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
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            out = acc / l_safe[:, None]
            o_offs = (q_start + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def tile_shape(group: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, GROUP_PAD, num_q_tiles) for a launch. Decodes (max_query_len 1) use the
    smallest tile tl.dot accepts (16 rows) so a decode row wastes little; prefill chunks
    use 64-row tiles. A decode-only batch always gets num_q_tiles = 1 (graph-static)."""
    group_pad = next_pow2(group)
    block_m = max(16, group_pad) if max_query_len == 1 else max(64, group_pad)
    block_q = block_m // group_pad
    return block_m, group_pad, math.ceil(max_query_len / block_q)


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of every query token in the flat batch through the block table; `sinks`
    (Hq,) are the heads' sink logits (None: no sinks). A decode-only batch goes through
    split-KV (worker/attention/triton_split_kv.py) with `num_splits` (None: by the
    batch's shape, 1 off CUDA)."""
    if triton is None:
        raise RuntimeError(f"triton is not available ({TRITON_IMPORT_ERROR})")
    assert meta.cu_seqlens_q is not None and meta.seqused_k is not None and meta.block_table is not None
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1 and q.stride(-1) == 1
    num_seqs = meta.seqused_k.shape[0]
    if meta.max_query_len == 1:  # decodes only: split the keys when programs would not fill the device
        splits = decode_splits(num_seqs, num_kv_heads, q.device) if num_splits is None else num_splits
        if splits > 1:
            return split_kv_decode(q, key_cache, value_cache, meta, scale, out, splits, sliding_window, sinks)
    block_m, group_pad, num_q_tiles = tile_shape(group, max(1, meta.max_query_len))
    grid = (num_seqs, num_q_tiles, num_kv_heads)
    kwargs: dict[str, Any] = {}
    if q.device.type == "cuda":
        kwargs = {"num_warps": 4, "num_stages": 2}
    _paged_attention_kernel[grid](
        out, q, key_cache, value_cache,
        meta.block_table, meta.cu_seqlens_q, meta.seqused_k,
        sinks if sinks is not None else q,
        scale * _LOG2E, KV_FP8_SCALE,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        meta.block_table.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=max(16, min(64, 4 * block_size)) if block_size < 64 else block_size,
        SLIDING_WINDOW=sliding_window or 0,
        # fp32 models multiply in full fp32: Triton's default for fp32 dots on NVIDIA is
        # TF32 (10-bit mantissa), enough to flip a greedy argmax against transformers.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SINKS=sinks is not None,
        KV_FP8=key_cache.dtype == KV_FP8_DTYPE,
        **kwargs,
    )
    return out


class TritonPagedAttention:
    """The AttentionBackend over `paged_attention`: writes this step's K/V into their slots,
    then one kernel launch for the whole batch. Reads the varlen metadata fields."""

    name = "triton"
    varlen = True
    supports_sinks = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale, sliding_window, sinks)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention alone, this step's K/V already in the cache (a caller that wrote
        them itself: worker/model/fused.py's RoPE + KV write)."""
        return paged_attention(
            q.contiguous(), kv_cache[0], kv_cache[1], meta, scale, sliding_window=sliding_window, sinks=sinks
        )


def load_triton_backend(device: torch.device) -> tuple[TritonPagedAttention | None, str]:
    """The Triton backend, or None and why it cannot be used here."""
    if device.type != "cuda":
        return None, f"the triton kernel runs on CUDA (device is {device.type})"
    if triton is None:
        return None, f"triton does not import ({TRITON_IMPORT_ERROR})"
    return TritonPagedAttention(), f"triton {triton.__version__}"
