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

What a step costs beyond the dense count (worker/costs/cost_model.py uses these):
  MoE   a step of T tokens reads the weights of the experts its tokens route to, not the
        active ones only: with top_k of E experts drawn per token (the routers balance load,
        so uniform draws are the model), E * (1 - (1 - top_k/E)^T) distinct experts per
        layer are expected (top_k at T = 1, all E as T grows). The grouped GEMM pads each
        touched expert's rows to its tile (half a tile on average): the load imbalance
        the FLOPs pay.
  MLA   decode (absorbed): a (query, cached token) pair per head costs 2 (R + rope) FLOPs
        for the score and 2 R for the value: the query and the context live in the latent
        space (R = kv_lora_rank). Prefill (expanded): 2 (nope + rope) + 2 v per pair, and
        kv_b_proj rebuilds K and V of every context token of the chunk: 2 R H (nope + v)
        FLOPs per context token, those K, V written and read back.
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

    def decode_flops_per_pair(self, heads: int) -> int:
        return 2 * heads * self.latent_dim + 2 * heads * self.kv_lora_rank

    def prefill_flops_per_pair(self, heads: int) -> int:
        return 2 * heads * (self.qk_nope_head_dim + self.qk_rope_head_dim) + 2 * heads * self.v_head_dim

    def expand_flops_per_token(self, heads: int) -> int:
        """kv_b_proj over one context token of a prefill chunk."""
        return 2 * self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)

    def expanded_kv_values_per_token(self, heads: int) -> int:
        """The K (nope + rope) and V values a prefill chunk rebuilds for one context token."""
        return heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)

    def decode_qo_values(self, heads: int) -> int:
        """A decode token's absorbed query (R + rope per head) and latent context (R per head)."""
        return heads * (self.latent_dim + self.kv_lora_rank)

    def prefill_qo_values(self, heads: int) -> int:
        return heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


def moe_tile_rows(num_pairs: int, num_experts: int) -> int:
    """The grouped GEMM's rows per block: 16 while experts see few (token, expert) pairs
    each (decode steps, where a big block would be mostly padding), 64 beyond."""
    return 16 if num_pairs <= 16 * num_experts else 64


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

    def expert_params(self, hidden: int) -> int:
        return 3 * hidden * self.moe_intermediate_size

    def tile_rows(self, num_tokens: int) -> int:
        return moe_tile_rows(num_tokens * self.num_experts_per_tok, self.num_experts)

    def expected_touched_experts(self, num_tokens: int) -> float:
        """Distinct routed experts one layer's T tokens use (module docstring)."""
        if num_tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** num_tokens)
