"""Tiny random mixture-of-experts checkpoints written with transformers itself (the
reference): Qwen3-MoE, Mixtral and gpt-oss, one variant per switch the model code honours.

    qwen3_moe          norm_topk_prob false, mlp_only_layers=[1] (a dense layer between
                       sparse ones), 8 experts top-2, qkv/o biases
    qwen3_moe_norm     norm_topk_prob true, decoder_sparse_step=2 (layers 1, 3 sparse), 4
                       experts top-2, tied embeddings
    qwen3_moe_fused    qwen3_moe's weights rewritten with fused 3-D expert tensors
                       (mlp.experts.gate_up_proj / down_proj), for the fused loader path
    mixtral            4 experts top-2
    mixtral_swa        mixtral with a sliding window of SLIDING_WINDOW on every layer
    gpt_oss            sliding / full layer_types (window SLIDING_WINDOW), YaRN RoPE with a
                       short original context, attention sinks, q/k/v/o and expert biases
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.tiny_models import SLIDING_WINDOW

MOE_FAMILIES = ("qwen3_moe", "qwen3_moe_norm", "qwen3_moe_fused", "mixtral", "mixtral_swa", "gpt_oss")

_COMMON = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def _config(family: str, vocab_size: int) -> tuple[object, type]:
    from transformers import (
        GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
    )

    common = dict(_COMMON, vocab_size=vocab_size)
    if family in ("qwen3_moe", "qwen3_moe_fused"):
        return Qwen3MoeConfig(
            **common, num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
            attention_bias=True, tie_word_embeddings=False,
        ), Qwen3MoeForCausalLM
    if family == "qwen3_moe_norm":
        return Qwen3MoeConfig(
            **common, num_hidden_layers=4, head_dim=32, intermediate_size=128, moe_intermediate_size=48,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
            tie_word_embeddings=False,
        ), Qwen3MoeForCausalLM
    if family in ("mixtral", "mixtral_swa"):
        window = SLIDING_WINDOW if family == "mixtral_swa" else None
        return MixtralConfig(
            **common, num_hidden_layers=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=window,
        ), MixtralForCausalLM
    if family == "gpt_oss":
        return GptOssConfig(
            **common, num_hidden_layers=4, head_dim=16, intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64,
            },
        ), GptOssForCausalLM
    raise ValueError(family)


def make_tiny_moe(family: str, out: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    config, cls = _config(family, vocab_size)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        # Random init (std 0.02) gives near-uniform logits and outputs that repeat one token;
        # unit-scale weights give varied greedy outputs and decisive routing, so that a
        # wrong expert, window, sink or bias shows in the tokens.
        for name, p in model.named_parameters():
            if "embed" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "bias" in name or name.endswith("sinks"):  # non-zero, so each is tested
                p.copy_(torch.randn_like(p) * (1.0 if name.endswith("sinks") else 0.1))
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(out, safe_serialization=True)
    if family == "qwen3_moe_fused":
        _fuse_experts(out, config.num_hidden_layers, config.num_experts)
    return out


def _fuse_experts(out: Path, num_layers: int, num_experts: int) -> None:
    """Rewrite per-expert tensors as fused 3-D ones: gate_up_proj (E, 2I, H) = [gate; up]
    rows per expert, down_proj (E, H, I)."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in tensors:
            continue  # a dense layer
        gate_up, down = [], []
        for e in range(num_experts):
            gate = tensors.pop(f"{prefix}.{e}.gate_proj.weight")
            up = tensors.pop(f"{prefix}.{e}.up_proj.weight")
            gate_up.append(torch.cat([gate, up]))
            down.append(tensors.pop(f"{prefix}.{e}.down_proj.weight"))
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up).contiguous()
        tensors[f"{prefix}.down_proj"] = torch.stack(down).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    assert not index.exists(), json.loads(index.read_text())  # tiny models are one file


def hf_moe_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy generate (tests/support/tiny_models.py hf_greedy) on a dir."""
    from tests.support.tiny_models import hf_greedy

    return hf_greedy(model_dir, prompts, max_tokens)
