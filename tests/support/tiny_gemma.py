"""Tiny random Gemma 3 text checkpoints written with transformers itself (the reference).

Variants (each a switch of the model code):
    gemma3          local:global 2:1 (sliding_window_pattern 3), window 24, tied embeddings,
                    default RoPE on both layer kinds (local base 10k, global 1M)
    gemma3_capped   final_logit_softcapping, an untied LM head, linear RoPE scaling on the
                    global layers, query_pre_attn_scalar unlike head_dim, layer_types given
                    as a list (5:1, Gemma 3's own ratio)
    gemma3_full     the `gemma3` weights with every layer global (the window must matter)
Init std 0.08 (initializer_range): wider random weights make Gemma 3 degenerate. Norm
weights (zeros in transformers' init: the norm scales by 1 + weight) get small random
values, so every norm's weight is exercised.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

GEMMA_WINDOW = 24
GEMMA_VARIANTS = ("gemma3", "gemma3_capped", "gemma3_full")


def gemma3_config(variant: str, vocab_size: int = 512) -> Any:
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=GEMMA_WINDOW,
        initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if variant in ("gemma3", "gemma3_full"):
        config = AutoConfig.for_model(
            "gemma3_text", **common, num_hidden_layers=6, sliding_window_pattern=3, query_pre_attn_scalar=16,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        )
        if variant == "gemma3_full":
            config.layer_types = ["full_attention"] * config.num_hidden_layers
    elif variant == "gemma3_capped":
        config = AutoConfig.for_model(
            "gemma3_text", **common, num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=24,
            final_logit_softcapping=4.0, tie_word_embeddings=False,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
        )
    else:
        raise ValueError(variant)
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def make_tiny_gemma3(variant: str, out: Path, seed: int = 0, vocab_size: int = 512) -> Path:
    from transformers import Gemma3ForCausalLM

    base = "gemma3" if variant == "gemma3_full" else variant
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma3_config(base, vocab_size)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights: scale by 1 + w
                p.copy_(torch.randn_like(p) * 1.0)
    if variant == "gemma3_full":
        model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    model.save_pretrained(out, safe_serialization=True)
    return out
