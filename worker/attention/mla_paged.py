"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged LATENT cache, in torch.

The pool holds one vector per token per layer, not per-head K and V:

    cache : (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)
    row   = [ c (kv_a_layernorm'd compressed kv, kv_lora_rank) | k_pe (roped, rope_dim) ]

Per head h, with kv_b_proj's weight viewed as (H, nope + v, R) = [W_UK[h]; W_UV[h]]:

    k_h = [ W_UK[h] @ c ; k_pe ]       v_h = W_UV[h] @ c
    score(q, t) = q_nope_h . (W_UK[h] @ c_t) + q_pe_h . k_pe_t
                = (W_UK[h]^T q_nope_h) . c_t + q_pe_h . k_pe_t          (absorbed)
    out_h = sum_t p_t W_UV[h] @ c_t = W_UV[h] @ (sum_t p_t c_t)          (absorbed)

Decodes use the absorbed form: the query is moved into the latent space once per token
and every head attends to the cached rows themselves (one "kv head" of width R + rope,
values = the first R columns), then the context goes through W_UV. Prefill chunks use
the expanded form: K/V of the chunk's context are rebuilt from the latents by kv_b_proj
(the arithmetic transformers does), and attended with a causal mask.

Metadata is the torch backend's (base.py): decode groups and prefill infos.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata, DecodeGroup, PrefillInfo


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def write_latent(cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's rows [c | k_pe] (T, R + rope) at their slots of one layer's cache."""
    rows = torch.cat((latent, k_pe), dim=-1).to(cache.dtype)
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows)


def split_kv_b(kv_b_weight: torch.Tensor, dims: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight (H * (nope + v), R) -> W_UK (H, nope, R), W_UV (H, v, R) (views)."""
    w = kv_b_weight.view(dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
    return w[:, : dims.qk_nope_head_dim], w[:, dims.qk_nope_head_dim :]


def decode_absorbed(
    q_nope: torch.Tensor,  # (D, H, nope)
    q_pe: torch.Tensor,  # (D, H, rope), roped
    rows: torch.Tensor,  # (D, L, R + rope): each sequence's cached latent rows, padded
    valid: torch.Tensor,  # (D, L) bool: which rows a sequence attends to
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # (D, H, v)
    rank = w_uk.shape[-1]
    q_latent = torch.einsum("dhn,hnr->dhr", q_nope, w_uk)
    q = torch.cat((q_latent, q_pe), dim=-1).unsqueeze(1)  # heads ride in SDPA's query axis
    keys = rows.unsqueeze(1)  # (D, 1, L, R + rope): one shared "kv head"
    values = rows[..., :rank].unsqueeze(1)  # (D, 1, L, R)
    context = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
    return torch.einsum("dhr,hvr->dhv", context.squeeze(1), w_uv)


def attend_expanded(
    q_nope: torch.Tensor,  # (Tq, H, nope)
    q_pe: torch.Tensor,  # (Tq, H, rope)
    rows: torch.Tensor,  # (Tk, R + rope): the latent rows of keys first_key .. first_key + Tk - 1
    kv_b: torch.nn.Module,  # kv_b_proj: R -> H * (nope + v)
    dims: MLADims,
    scale: float,
    attn_mask: torch.Tensor | None,
    is_causal: bool = False,
) -> torch.Tensor:  # (Tq, H, v)
    num_keys = rows.shape[0]
    latent, k_pe = rows.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
    kv = kv_b(latent).view(num_keys, dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim)
    k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, dims.num_heads, -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )
    return out.transpose(0, 1)


def causal_mask(context_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """(query_len, context_len): query j at position context_len - query_len + j sees keys <= it."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device)
    key_pos = torch.arange(context_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]


class TorchPagedMLA:
    """One call per layer over the flat batch: write the step's latent rows, then attend
    (decode groups absorbed, prefill chunks expanded). Returns (T, H, v_head_dim)."""

    name = "torch-mla"

    def __init__(self, dims: MLADims) -> None:
        self.dims = dims

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b: torch.nn.Module,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        dims = self.dims
        write_latent(cache, latent, k_pe, meta.slot_mapping)
        out = q_nope.new_empty(q_nope.shape[0], dims.num_heads, dims.v_head_dim)
        if meta.decode_groups:
            w_uk, w_uv = split_kv_b(kv_b.weight, dims)
            for group in meta.decode_groups:
                sl = slice(group.start, group.end)
                rows, valid = _gather_group(cache, group)
                out[sl] = decode_absorbed(q_nope[sl], q_pe[sl], rows, valid, w_uk, w_uv, scale)
        for p in meta.prefills:
            sl = slice(p.query_start, p.query_start + p.query_len)
            out[sl] = self._prefill(q_nope[sl], q_pe[sl], latent[sl], k_pe[sl], kv_b, cache, p, scale)
        return out

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b: torch.nn.Module,
        cache: torch.Tensor,
        p: PrefillInfo,
        scale: float,
    ) -> torch.Tensor:
        if p.context_len == p.query_len:  # no cached context: the chunk's own rows
            rows = torch.cat((latent, k_pe), dim=-1).to(cache.dtype)
            return attend_expanded(q_nope, q_pe, rows, kv_b, self.dims, scale, None, is_causal=True)
        rows = cache[p.block_table].view(-1, cache.shape[-1])[: p.context_len]
        mask = causal_mask(p.context_len, p.query_len, q_nope.device)
        return attend_expanded(q_nope, q_pe, rows, kv_b, self.dims, scale, mask)


def _gather_group(cache: torch.Tensor, group: DecodeGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode group's latent rows (D, max_context, R + rope) through its block tables,
    and which of them each sequence sees (its own context length)."""
    num_seqs = group.end - group.start
    rows = cache[group.block_tables].view(num_seqs, -1, cache.shape[-1])[:, : group.max_context]
    positions = torch.arange(group.max_context, device=cache.device)
    return rows, positions[None, :] < group.context_lens[:, None]
