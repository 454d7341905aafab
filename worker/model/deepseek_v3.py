"""DeepSeek-V3 (and R1, Kimi K2: `DeepseekV3ForCausalLM`) over one flat token batch.

    layer i:  x += MLA(input_layernorm(x))                     worker/model/mla.py
              x += FFN(post_attention_layernorm(x))             dense MLP for i < first_k_dense_replace,
                                                                the MoE block after (deepseek_moe.py)

The KV pool holds the latent kind: one row [c | k_pe] of kv_lora_rank + qk_rope_head_dim
values per token per layer (kv.kv_cache.KVCacheSpec with latent=True), so the per-layer
cache handed to attention is (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim).

Checkpoint names are transformers' own (per-expert tensors `mlp.experts.<e>.gate_proj`
etc.); `checkpoint_target` maps them here. Multi-token-prediction layers
(num_nextn_predict_layers, stored as layers past num_hidden_layers) are not loaded:
transformers' model does not run them either, and greedy outputs do not depend on them.
Tensor parallelism splits attention by query heads (the latent pool is replicated on every
rank: worker/model/mla.py), the dense and shared MLPs by intermediate size and the routed
experts within each expert (worker/model/moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kv.kv_cache import KVCacheSpec
from worker.attention.base import AttentionBackend, AttentionMetadata
from worker.model.checkpoint_names import DENSE_MLP_PARTS, Target, layer_target, split_layer_name, top_level_target
from worker.model.deepseek_moe import DeepseekMoE, DenseMLP, RoutingArch
from worker.model.deepseek_v3_config import check_deepseek_v3
from worker.model.layers import RMSNorm, RotaryEmbedding
from worker.model.mla import MLAArch, MLAttention
from worker.model.parallel import SINGLE, ParallelLMHead, TPContext, VocabParallelEmbedding


@dataclass(frozen=True)
class DeepseekV3Arch:
    """The model's shape. num_kv_heads / head_dim describe the KV pool's rows (one latent
    "head" of kv_lora_rank + qk_rope_head_dim per token), which is what the engine sizes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    first_k_dense_replace: int
    mla: MLAArch
    routing: RoutingArch

    num_kv_heads: int = 1
    latent_kv: bool = True

    @property
    def head_dim(self) -> int:
        return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> DeepseekV3Arch:
        check_deepseek_v3(hf_config)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
            first_k_dense_replace=int(hf_config.first_k_dense_replace or 0),
            mla=MLAArch.from_hf_config(hf_config),
            routing=RoutingArch.from_hf_config(hf_config),
        )

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.num_layers, num_kv_heads=1, head_dim=self.head_dim,
            block_size=block_size, dtype=dtype, latent=True,
        )

    def validate_tp(self, size: int) -> None:
        """ValueError (clear message) when the model cannot be split over `size` ranks."""
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
        sizes = {
            "attention heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.routing.moe_intermediate_size,
        }
        for name, value in sizes.items():
            if value % size:
                raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name} {value}")
        if size > 1 and self.mla.attention_bias:
            raise ValueError(f"tensor_parallel_size={size}: attention_bias (an o_proj bias) is served "
                             "on one device only")


# The dense layers' MLP and the MoE layers' shared experts load gate/up into one fused
# projection; every other name loads into the module of the same name.
_MLP_PARTS = {
    **DENSE_MLP_PARTS,
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj", 0),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    def __init__(self, arch: DeepseekV3Arch, index: int, rope: RotaryEmbedding, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = MLAttention(arch.mla, rope, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: nn.Module = (
            DenseMLP(arch.hidden_size, arch.intermediate_size, tp)
            if index < arch.first_k_dense_replace
            else DeepseekMoE(arch.hidden_size, arch.routing, tp)
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(
        self,
        arch: DeepseekV3Arch,
        hf_config: Any,
        backend: AttentionBackend | None = None,  # MLA attends itself (worker/attention/mla_paged.py)
        max_positions: int = 0,
        tp: TPContext = SINGLE,
    ) -> None:
        super().__init__()
        arch.validate_tp(tp.size)
        self.arch = arch
        self.rope = RotaryEmbedding(hf_config, arch.mla.qk_rope_head_dim, max_positions or arch.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, self.rope, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if not arch.tie_word_embeddings:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)

    @classmethod
    def arch_from_hf_config(cls, hf_config: Any) -> DeepseekV3Arch:
        return DeepseekV3Arch.from_hf_config(hf_config)

    @classmethod
    def checkpoint_target(cls, name: str, arch: DeepseekV3Arch) -> Target | None:
        """transformers' names; layers past num_hidden_layers (MTP modules) are not ours."""
        if not name.startswith("model.layers."):
            return top_level_target(name, arch.tie_word_embeddings)
        split = split_layer_name(name)
        if split is None:
            return None
        prefix, rest = split
        if int(prefix.split(".")[1]) >= arch.num_layers or "rotary_emb" in rest:
            return None
        if rest.startswith("mlp.experts."):  # mlp.experts.<e>.<gate|up|down>_proj.weight
            _, _, expert, proj, _ = rest.split(".")
            if proj == "down_proj":
                return prefix + "mlp.experts", "w2", int(expert)
            return prefix + "mlp.experts", "w13", 2 * int(expert) + (proj == "up_proj")
        return layer_target(prefix, rest, _MLP_PARTS)

    def to(self, *args: Any, **kwargs: Any) -> DeepseekV3ForCausalLM:
        """Casts like nn.Module.to, except the router (gate weight, correction bias), which
        stays fp32 as transformers keeps it: routing decisions compare close scores."""
        super().to(*args, **kwargs)
        for layer in self.layers:
            if isinstance(layer.mlp, DeepseekMoE):
                layer.mlp.gate.float()
        return self

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """kv_caches: the latent pool (KVCacheSpec.latent), indexed by layer: kv_caches[i]
        is (1, num_blocks, block_size, 1, R + rope) and layer i attends over its
        (num_blocks, block_size, R + rope) view."""
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, kv_caches[i][0, :, :, 0], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.arch.tie_word_embeddings else self.lm_head
        return head.logits(hidden)
