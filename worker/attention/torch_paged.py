"""Pure-torch paged attention (CPU and GPU), the default backend.

Decodes: one batched SDPA call per decode group (the runner groups decodes of similar
context length; usually 1-3 groups) per layer: their keys/values are gathered through a
(D, max_blocks) block table into (D, L, Hkv, Dh) and masked by context length. Prefill
chunks: one SDPA call per chunk; a chunk with no cached context attends to its own fresh
K/V directly (no gather), one with cached context gathers it.

A sliding window (base.py) masks keys at or before p - window; a prefill chunk gathers
only the blocks its first query can still see. Decodes gather the group's whole context
and mask (skipping the blocks outside every member's window is an optimisation not made).

Attention sinks (gpt-oss; base.py): SDPA has no term for them, so a layer with sinks
computes the same masked scores explicitly and softmaxes them with the sink logit appended.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata, DecodeGroup, write_kv
from worker.attention.kv_quant import dequantize_kv, is_fp8, roundtrip


class TorchPagedAttention:
    name = "torch"
    varlen = False  # reads decode_groups / prefills, not the varlen fields
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
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache, value_cache = write_kv(kv_cache, k, v, meta.slot_mapping)
        block_size = key_cache.shape[1]
        if is_fp8(kv_cache):  # attend to what the pool holds, fresh K/V too (kv_quant.py)
            k, v = roundtrip(k), roundtrip(v)

        out = torch.empty_like(q)
        for group in meta.decode_groups:
            out[group.start : group.end] = self._decode(
                q[group.start : group.end], key_cache, value_cache, group, scale, sliding_window, sinks
            )
        for p in meta.prefills:
            end = p.query_start + p.query_len
            qs = q[p.query_start : end]
            windowed = sliding_window is not None and p.query_len > sliding_window
            if p.context_len == p.query_len and not windowed:
                out[p.query_start : end] = _sdpa_token_major(
                    qs, k[p.query_start : end], v[p.query_start : end], scale, is_causal=True, sinks=sinks
                )
                continue
            # Keys from the first block the chunk's first query can see (block 0 without a window).
            first_key = 0
            if sliding_window is not None:
                first_key = max(0, p.context_len - p.query_len + 1 - sliding_window)
            first_block = first_key // block_size
            table = p.block_table[first_block:]
            num_keys = p.context_len - first_block * block_size
            ks = dequantize_kv(key_cache[table].view(-1, num_kv_heads, head_dim)[:num_keys], q.dtype)
            vs = dequantize_kv(value_cache[table].view(-1, num_kv_heads, head_dim)[:num_keys], q.dtype)
            out[p.query_start : end] = _sdpa_with_context(
                qs, ks, vs, p.context_len, scale, first_block * block_size, sliding_window, sinks
            )
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        tables = group.block_tables
        max_len = group.max_context
        # (D, max_blocks, block_size, Hkv, Dh) -> (D, Hkv, L, Dh)
        keys = key_cache[tables].view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].transpose(1, 2)
        values = value_cache[tables].view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].transpose(1, 2)
        keys, values = dequantize_kv(keys, q.dtype), dequantize_kv(values, q.dtype)
        positions = torch.arange(max_len, device=q.device)
        mask = positions[None, :] < group.context_lens[:, None]
        if sliding_window is not None:  # the query sits at context_len - 1
            mask &= positions[None, :] >= group.context_lens[:, None] - sliding_window
        mask = mask[:, None, None, :]
        # GQA without expanding K/V: query heads are grouped by the KV head they read
        # (q head h uses kv head h // group_size, as in transformers' repeat_kv), so the
        # group's queries ride in SDPA's query-length axis: (D, Hkv, group_size, Dh).
        group_size = num_heads // num_kv_heads
        grouped_q = q.view(num_seqs, num_kv_heads, group_size, head_dim)
        if sinks is not None:
            out = _attend_with_sinks(grouped_q, keys, values, mask, scale, sinks.view(num_kv_heads, group_size, 1))
        else:
            out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)


def _sdpa_token_major(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    attn_mask: torch.Tensor | None = None, is_causal: bool = False, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over token-major (T, H, D) tensors; GQA when q has more heads than k/v."""
    if sinks is not None:
        if attn_mask is None:  # is_causal: the chunk attends to itself alone
            n = q.shape[0]
            attn_mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        group_size = q.shape[1] // k.shape[1]
        keys = k.transpose(0, 1).repeat_interleave(group_size, dim=0)  # q head h reads kv head h // group
        values = v.transpose(0, 1).repeat_interleave(group_size, dim=0)
        out = _attend_with_sinks(q.transpose(0, 1), keys, values, attn_mask, scale, sinks.view(-1, 1, 1))
        return out.transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=attn_mask,
        is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def _sdpa_with_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    first_key: int = 0,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # Query j sits at position context_len - query_len + j and sees keys 0..that position
    # (with a window: the last `sliding_window` of them). k/v hold positions first_key...
    query_len = q.shape[0]
    query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
    key_pos = torch.arange(first_key, context_len, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return _sdpa_token_major(q, k, v, scale, attn_mask=mask, sinks=sinks)


def _attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """softmax([q.k * scale (masked), sink]) without the sink's column, times v, as
    transformers' gpt-oss eager attention: a sink is a logit every query adds to its
    softmax denominator, attending to nothing. q (..., Lq, D); k, v (..., Lk, D) with q's
    head layout; mask (bool) broadcasts to (..., Lq, Lk); sinks to (..., 1)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
