"""Tiny random Llama-family checkpoints written with transformers itself (the reference)."""
from __future__ import annotations

from pathlib import Path

import torch

# The sliding window of the *_swa families: shorter than most test prompts, so prompts,
# chunks and decodes all cross it.
SLIDING_WINDOW = 24


def make_tiny_model(family: str, out: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
        Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False)
        cls = LlamaForCausalLM
    elif family == "llama3":
        config = LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
        }, rope_theta=500000.0)
        cls = LlamaForCausalLM
    elif family == "mistral":
        config = MistralConfig(**common, sliding_window=None)
        cls = MistralForCausalLM
    elif family == "mistral_swa":  # every layer sees the last SLIDING_WINDOW positions
        config = MistralConfig(**common, sliding_window=SLIDING_WINDOW)
        cls = MistralForCausalLM
    elif family == "qwen2_swa":  # layer 0 full attention, layer 1 sliding (max_window_layers)
        config = Qwen2Config(
            **common, tie_word_embeddings=True, use_sliding_window=True,
            sliding_window=SLIDING_WINDOW, max_window_layers=1,
        )
        cls = Qwen2ForCausalLM
    elif family == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
        cls = Qwen2ForCausalLM
    elif family == "qwen3":
        config = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    # Random init gives near-uniform logits; scale the LM head up so greedy choices are
    # decisive (ties would make "token-identical" depend on summation order).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' own greedy `generate`, one request at a time (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )
        outs.append(gen[0, len(prompt):].tolist())
    return outs
