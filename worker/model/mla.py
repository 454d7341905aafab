"""The attention block of DeepSeek-V2/V3: multi-head latent attention (MLA).

Projections, as in transformers' DeepseekV3Attention:

    query:  q_lora_rank set:  q_b_proj(q_a_layernorm(q_a_proj(x)))      else q_proj(x)
            -> (T, H, qk_nope_head_dim + qk_rope_head_dim) = [q_nope | q_pe]
    kv:     kv_a_proj_with_mqa(x) -> [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]
            c = kv_a_layernorm(c); k_pe is ONE head shared by every query head
    RoPE:   on q_pe and k_pe only (rope_interleave: pairs (x0, x1), (x2, x3) ... rotated
            and laid out [evens | odds], transformers' apply_rotary_pos_emb_interleave;
            otherwise rotate-half)
    scale:  qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the RoPE type is
            not default and mscale_all_dim is set (transformers' yarn_apply_mscale)

The latent rows [c | k_pe] go to the paged latent cache; attention over it is
worker/attention/mla_paged.py. The output (T, H * v_head_dim) goes through o_proj.

Tensor parallelism splits the query heads: q_proj / q_b_proj / kv_b_proj are column-parallel
by head (their rows are per-head blocks, so an even split of rows is a split of heads),
o_proj row-parallel (one all-reduce). The latent path (q_a_proj, kv_a_proj_with_mqa, the
two norms) is replicated, so every rank writes the same latent rows to its own copy of
the pool, which every one of its heads reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from worker.attention.base import AttentionMetadata
from worker.attention.mla_paged import MLADims, TorchPagedMLA
from worker.model.layers import RMSNorm, RotaryEmbedding
from worker.model.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TPContext, shard_range


@dataclass(frozen=True)
class MLAArch:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool
    scale: float

    @property
    def dims(self) -> MLADims:
        return MLADims(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> MLAArch:
        qk_head_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        return cls(
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            q_lora_rank=hf_config.q_lora_rank,
            kv_lora_rank=hf_config.kv_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
            scale=softmax_scale(hf_config, qk_head_dim),
        )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(hf_config: Any, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, with YaRN's mscale_all_dim squared on top (transformers' rule:
    any RoPE type but default, when mscale_all_dim is set)."""
    scale = qk_head_dim**-0.5
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim", 0):
        mscale = _yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def _by_heads(in_features: int, rows_per_head: int, num_heads: int, tp: TPContext) -> ColumnParallelLinear:
    """A projection whose rows are per-head blocks, split by heads over the ranks."""
    return ColumnParallelLinear(in_features, [shard_range(num_heads * rows_per_head, tp)], False, tp)


class MLAttention(nn.Module):
    def __init__(self, arch: MLAArch, rope: RotaryEmbedding, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.arch = arch
        heads, qk_head_dim = arch.num_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
        self.num_heads = heads // tp.size  # this rank's query heads
        if arch.q_lora_rank is None:
            self.q_proj = _by_heads(arch.hidden_size, qk_head_dim, heads, tp)
        else:
            self.q_a_proj = nn.Linear(arch.hidden_size, arch.q_lora_rank, bias=arch.attention_bias)
            # transformers builds both latent norms with their default eps (1e-6), not rms_norm_eps
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, 1e-6)
            self.q_b_proj = _by_heads(arch.q_lora_rank, qk_head_dim, heads, tp)
        self.kv_a_proj_with_mqa = nn.Linear(
            arch.hidden_size, arch.kv_lora_rank + arch.qk_rope_head_dim, bias=arch.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(arch.kv_lora_rank, 1e-6)
        self.kv_b_proj = _by_heads(arch.kv_lora_rank, arch.qk_nope_head_dim + arch.v_head_dim, heads, tp)
        # RowParallelLinear carries no bias: attention_bias is single-device only (validate_tp)
        self.o_proj: nn.Module = (
            nn.Linear(heads * arch.v_head_dim, arch.hidden_size, bias=True)
            if arch.attention_bias else RowParallelLinear(heads * arch.v_head_dim, arch.hidden_size, tp)
        )
        self.rope = rope
        self.attn = TorchPagedMLA(replace(arch.dims, num_heads=self.num_heads))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: (T, hidden); cache: this layer's (num_blocks, block_size, R + rope)."""
        arch, num_tokens = self.arch, x.shape[0]
        if arch.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, self.num_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim)
        q_nope, q_pe = q.split([arch.qk_nope_head_dim, arch.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([arch.kv_lora_rank, arch.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self._rope(positions, q_pe, k_pe.unsqueeze(1))
        out = self.attn.forward(q_nope, q_pe, latent, k_pe.squeeze(1), self.kv_b_proj, cache, meta, arch.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * arch.v_head_dim))

    def _rope(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.arch.rope_interleave:
            return self.rope(positions, q_pe, k_pe)
        # Interleaved pairs (x0, x1), (x2, x3) ...: the first half of the tables holds the
        # per-pair angle; the result is laid out [rotated evens | rotated odds].
        half = self.arch.qk_rope_head_dim // 2
        cos = self.rope.cos[positions, :half].unsqueeze(1).to(q_pe.dtype)
        sin = self.rope.sin[positions, :half].unsqueeze(1).to(q_pe.dtype)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            even, odd = t[..., 0::2], t[..., 1::2]
            return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

        return rotate(q_pe), rotate(k_pe)
