"""The attention backend interface: one call per layer over the whole flat batch.

Flat batch layout (built by the model runner every step):

    tokens:  [ d0 d1 ... d(D-1) | p0 chunk .......... | p1 chunk ..... ]
               decodes, one      prefill chunks, each query_len tokens
               token per seq     (query_start, query_len, context_len)

A sequence's context_len counts its cached tokens plus this step's, so its queries sit
at positions context_len - query_len ... context_len - 1 and attend causally to keys
0 ... own position, read through its block table from the paged KV cache.

Sliding window (Mistral, Qwen2/3 `sliding_attention` layers; a per-layer argument): a
query at position p sees only keys p - window < k <= p, the last `window` positions, as
in transformers. The KV manager gives blocks wholly outside every query's window back to
the pool (kv/kv_groups.py); their block-table entries then name the null block, whose
positions the window masks, so the backends never weigh what it holds.

Attention sinks (gpt-oss; a per-layer argument): one learned logit per query head that
joins every query's softmax denominator and attends to nothing,
    out = sum_k exp(s_k) v_k / (exp(sink) + sum_k exp(s_k)).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from worker.attention.kv_quant import is_fp8, quantize_kv


@dataclass
class PrefillInfo:
    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # (num_blocks,) long, just the blocks this context needs


@dataclass
class DecodeGroup:
    """Decodes [start, end) of the flat batch, attended in one call. The runner sorts
    decodes by context length and groups them so that padding to the group's longest
    context stays small (padding is gathered and computed for nothing)."""

    start: int
    end: int
    block_tables: torch.Tensor  # (end - start, max_blocks) long, padded with block 0
    context_lens: torch.Tensor  # (end - start,) long
    max_context: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) long: where each token's new K/V is written
    num_decode_tokens: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillInfo] = field(default_factory=list)
    # Varlen form of the whole batch (flash and triton backends): int32 tensors.
    cu_seqlens_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    max_query_len: int = 0
    max_context_len: int = 0
    # A model with several KV groups (worker/runner/kv_group_binding.py): every group's metadata,
    # this one being group 0's; each layer's backend reads its own group's.
    groups: list[AttentionMetadata] | None = None


class AttentionBackend(Protocol):
    name: str
    # True: the backend reads the varlen fields (cu_seqlens_q, seqused_k, block_table), so
    # the runner fills them; False: it reads decode_groups / prefills.
    varlen: bool
    # True: forward honours `sinks` (select_backend(needs_sinks=True) picks only these).
    supports_sinks: bool

    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # this layer's window; None: full causal
        sinks: torch.Tensor | None = None,  # (Hq,) this layer's sink logits; None: no sinks
    ) -> torch.Tensor:  # (T, Hq, D)
        ...


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's K/V (num_tokens, Hkv, D) at their slots (block * block_size +
    offset) of one layer's paged cache (2, num_blocks, block_size, Hkv, D), before any
    attention reads it. Returns the (key, value) caches."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if is_fp8(kv_cache):  # e4m3 pool (worker/attention/kv_quant.py): stored as bytes
        k, v = quantize_kv(k).view(torch.uint8), quantize_kv(v).view(torch.uint8)
        key_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        value_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
        return key_cache, value_cache
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return key_cache, value_cache
