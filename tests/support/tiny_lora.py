"""PEFT LoRA adapters for the tiny models (tests/support/tiny_models.py), written with peft
itself, and peft's greedy `generate` as the reference."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Adapters a mixed batch serves together: name -> (rank, targets, rsLoRA); None targets: all seven.
MIXED_ADAPTERS = {
    "r4-attn": (4, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    "r8-all": (8, None, True),
    "r16-mlp": (16, ("gate_proj", "up_proj", "down_proj"), False),
}


def make_mixed_adapters(base_dir: Path, root: Path) -> dict[str, Path]:
    """MIXED_ADAPTERS for this base model, under `root`."""
    return {name: make_tiny_adapter(base_dir, root / name, rank, targets or ALL_TARGETS, use_rslora=rs, seed=k)
            for k, (name, (rank, targets, rs)) in enumerate(MIXED_ADAPTERS.items())}


def run_mixed(engine: Any, jobs: list[tuple[str, str | None, list[int], int]]) -> dict[str, list[int]]:
    """Add every (request id, adapter or None, prompt, max_tokens) job at once and step the
    engine to the end; greedy tokens per request id."""
    from worker.api import SamplingParams

    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in jobs}
    for rid, lora, prompt, n in jobs:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0), lora_name=lora)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def make_tiny_adapter(
    base_dir: Path, out: Path, rank: int, targets: tuple[str, ...] = ALL_TARGETS, alpha: int = 16,
    use_rslora: bool = False, seed: int = 0,
) -> Path:
    """A random adapter whose B is non-zero (peft initialises B to zero, which would leave
    outputs unchanged), large enough to change greedy outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn_like(p) * (0.5 / rank**0.5))
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers + peft greedy `generate`, one request at a time (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs
