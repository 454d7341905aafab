"""The benchmark model: a Llama-shaped ~31M-parameter checkpoint with random weights.

    python -m benchmarks.bench_model [--out DIR]

Shape: hidden 512, 8 layers, 8 heads (head_dim 64), 2 KV heads (GQA 4:1), intermediate
1408, vocab 8192, untied LM head, fp32. Built with transformers itself from a fixed seed
and saved as safetensors, once: later calls find the files and return at once (the
directory name carries a version, so a change to the recipe builds a fresh one).

Random init gives near-uniform logits; like tests/support/tiny_models.py, every matrix is scaled
up (x3) so that greedy choices are decisive and "token-identical across engines" does
not hinge on summation order. Special ids: pad 0, bos 1, eos 2 (the workload avoids them).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

RECIPE_VERSION = 1
SEED = 0
SPECIAL_TOKEN_IDS = (0, 1, 2)  # pad, bos, eos
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKEN_IDS)

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def default_dir() -> Path:
    base = os.environ.get("KVSERVE_BENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve-bench"
    )
    return Path(base) / f"llama-31m-v{RECIPE_VERSION}"


def is_built(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def build(out: Path | None = None) -> Path:
    """Return the model directory, building it first if it is not there yet."""
    out = Path(out) if out is not None else default_dir()
    if is_built(out):
        return out

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
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


def num_parameters(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(os.fspath(file), framework="pt") as f:
            for name in f.keys():
                total += _prod(f.get_slice(name).get_shape())
    return total


def _prod(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"model directory (default {default_dir()})")
    args = parser.parse_args()
    path = build(args.out)
    print(f"{path}  ({num_parameters(path) / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
