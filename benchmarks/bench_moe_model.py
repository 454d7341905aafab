"""The MoE benchmark model: a Qwen3-MoE checkpoint of ~31M ACTIVE parameters, random weights.

    python -m benchmarks.bench_moe_model [--out DIR]

Shape: benchmarks/bench_model.py's dense Llama (hidden 512, 8 layers, 8 heads of 64, 2 KV
heads, vocab 8192, untied LM head, fp32) with every MLP replaced by a sparse block of
NUM_EXPERTS experts, TOP_K routed per token, norm_topk_prob on (Qwen3-30B-A3B's settings).
The expert width is chosen so that the routed experts of one token cost what the dense
model's MLP costs (TOP_K * MOE_INTERMEDIATE = 1408), hence the same ~31M active
parameters; all experts together make ~150M.

Built with transformers itself from a fixed seed, saved as safetensors once (the
directory name carries a version). Like the dense bench model, matrices are scaled up so
greedy choices (and routing) are decisive. Special ids: pad 0, bos 1, eos 2.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.bench_model import SEED, SHAPE, is_built, num_parameters

RECIPE_VERSION = 1
NUM_EXPERTS = 32
TOP_K = 4
DENSE_INTERMEDIATE = SHAPE["intermediate_size"]
MOE_INTERMEDIATE = DENSE_INTERMEDIATE // TOP_K

MOE_SHAPE = dict(
    SHAPE,
    head_dim=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
    moe_intermediate_size=MOE_INTERMEDIATE,
    num_experts=NUM_EXPERTS,
    num_experts_per_tok=TOP_K,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def default_dir() -> Path:
    base = os.environ.get("KVSERVE_BENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve-bench"
    )
    return Path(base) / f"qwen3-moe-a31m-v{RECIPE_VERSION}"


def build(out: Path | None = None) -> Path:
    """Return the model directory, building it first if it is not there yet."""
    out = Path(out) if out is not None else default_dir()
    if is_built(out):
        return out

    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**MOE_SHAPE)
    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # expert weights are 3-D (experts, out, in)
                p.mul_(3.0)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # Write next to the target, then rename: a half-written directory is never "built".
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if is_built(out):  # another process won the race
            return out
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def num_active_parameters(path: Path) -> int:
    """Parameters one token runs through: all but the unrouted experts (each layer's
    experts count TOP_K / NUM_EXPERTS of their size)."""
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    h, k = config["hidden_size"], config["num_experts_per_tok"]
    n = config.get("num_experts") or config["num_local_experts"]  # the name saved varies by version
    expert = 3 * h * config["moe_intermediate_size"]
    sparse_layers = config["num_hidden_layers"] - len(config.get("mlp_only_layers") or [])
    return num_parameters(path) - sparse_layers * (n - k) * expert


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"model directory (default {default_dir()})")
    args = parser.parse_args()
    path = build(args.out)
    print(f"{path}  ({num_active_parameters(path) / 1e6:.1f}M active of {num_parameters(path) / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
