"""The parts of a model shape that only some families have: multi-head latent attention
(DeepSeek-V2/V3) and mixture-of-experts feed-forward layers. Read from the same
config.json fields transformers reads; counted for the cost model and the KV sizing.

MLA per layer (q_lora_rank set: q_a_proj, its norm, q_b_proj; else q_proj):
    q:   hidden x q_lora + q_lora + q_lora x heads*(nope+rope)   |   hidden x heads*(nope+rope)
    kv:  hidden x (kv_lora+rope) + kv_lora (norm) + kv_lora x heads*(nope+v)
    o:   heads*v x hidden
    KV pool: kv_lora + rope values per token per layer (one latent row, no per-head K/V)

MoE layer (DeepSeek-V3 style: the first `num_dense_layers` keep the dense MLP):
    gate: experts x hidden (+ experts, the correction bias)
    experts: experts x 3 x hidden x moe_inter     shared: 3 x hidden x moe_inter x num_shared
    active per token: (top_k + num_shared) x 3 x hidden x moe_inter + the gate
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAShape:
    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MLAShape | None:
        if not cfg.get("kv_lora_rank"):
            return None
        return cls(int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]), int(cfg["qk_nope_head_dim"]),
                   int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"]))

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_params(self, hidden: int, heads: int) -> int:
        qk = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * qk
        else:
            q = hidden * qk
        kv = hidden * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    num_dense_layers: int

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoEShape | None:
        num_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
        if not num_experts:
            return None
        return cls(int(num_experts), int(cfg["num_experts_per_tok"]),
                   int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                   int(cfg.get("n_shared_experts") or 0), int(cfg.get("first_k_dense_replace") or 0))

    def layer_params(self, hidden: int, active: bool) -> int:
        """One MoE layer's feed-forward weights: all of them, or those one token multiplies by."""
        routed = self.num_experts_per_tok if active else self.num_experts
        gate = self.num_experts * hidden + self.num_experts
        return gate + (routed + self.num_shared_experts) * 3 * hidden * self.moe_intermediate_size
