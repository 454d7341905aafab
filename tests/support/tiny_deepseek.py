"""Tiny random DeepSeek-V3 checkpoints written by transformers itself (the reference).

Each named variant flips one of the switches the model code must honour: the query
path (q_lora_rank set: q_a_proj / q_a_layernorm / q_b_proj; None: q_proj), the dense
layers first (first_k_dense_replace), the grouped routing (n_group / topk_group), the
interleaved RoPE layout and YaRN with its softmax mscale.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 512

# Base geometry: kv_lora_rank + qk_rope_head_dim = 48 values per token per layer in the
# pool, against 2 * num_heads * qk_head_dim = 384 that per-head K and V would take.
_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=1024, num_nextn_predict_layers=0, rope_interleave=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)

VARIANTS: dict[str, dict[str, Any]] = {
    # q_lora_rank set, one dense layer then MoE, 4 groups of 2 experts choosing 2 groups.
    "ds_qlora": {},
    # q_proj straight from the hidden state; every layer MoE; rotate-half RoPE.
    "ds_qproj": dict(q_lora_rank=None, first_k_dense_replace=0, rope_interleave=False),
    # one group (plain top-k over all experts), no normalisation of the top-k weights,
    # two shared experts, attention biases, a tied LM head.
    "ds_flat": dict(n_group=1, topk_group=1, norm_topk_prob=False, n_shared_experts=2,
                    num_experts_per_tok=3, attention_bias=True, tie_word_embeddings=True),
    # YaRN RoPE: the softmax scale carries mscale_all_dim (transformers' yarn_apply_mscale).
    "ds_yarn": dict(q_lora_rank=None, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0,
    }),
}


def deepseek_config(variant: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model("deepseek_v3", **{**_BASE, **VARIANTS[variant], **overrides})


def make_tiny_deepseek(variant: str, out: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random DeepSeek-V3 of the named variant to `out` (safetensors)."""
    from transformers import AutoModelForCausalLM

    config = deepseek_config(variant, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random init gives near-uniform logits; scale matrices up so greedy choices
            # are decisive (ties would make "token-identical" depend on summation order).
            if p.dim() >= 2:
                p.mul_(3.0)
            # Norm weights away from 1 so that a missed norm shows.
            elif name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
        for name, buf in model.named_buffers():
            # A non-zero correction bias: routing must add it to choose but not to weigh.
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.3, 0.3)
    model.save_pretrained(out, safe_serialization=True)
    return out


class DeepseekReference:
    """Each variant's checkpoint, written on first use, and transformers' greedy outputs on
    it (fp32, one request at a time), memoised per (variant, prompt, max_tokens)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[str, Path] = {}
        self._outputs: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def checkpoint(self, variant: str) -> Path:
        if variant not in self._dirs:
            self._dirs[variant] = make_tiny_deepseek(variant, self.root / variant)
        return self._dirs[variant]

    def greedy(self, variant: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        from tests.support.tiny_models import hf_greedy

        keys = [(variant, tuple(p), n) for p, n in zip(prompts, max_tokens, strict=True)]
        missing = list(dict.fromkeys(k for k in keys if k not in self._outputs))
        if missing:
            outs = hf_greedy(self.checkpoint(variant), [list(k[1]) for k in missing], [k[2] for k in missing])
            self._outputs.update(zip(missing, outs))
        return [list(self._outputs[k]) for k in keys]


def make_served_deepseek(out: Path, variant: str = "ds_qlora") -> Path:
    """A tiny DeepSeek-V3 with the served-model tokenizer and chat template: a complete
    model directory `kvserve serve` can load."""
    from tests.support.tiny_served_model import make_served_model

    return make_served_model(out, weights=lambda o, vocab: make_tiny_deepseek(variant, o, vocab_size=vocab))
