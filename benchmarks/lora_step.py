"""The CPU engine's step time with LoRA adapters mixed in a batch, against the same batch
on the base model.

    python -m benchmarks.lora_step [--quick] [--rank R] [--adapters N] [--threads T]

Model: benchmarks/bench_model.py (~31M Llama: hidden 512, 8 layers, fp32). Adapters: N
(default 4) PEFT adapters of rank R (default 16) on all seven projections, written in
PEFT's format (adapter_config.json + adapter_model.safetensors) with random non-zero
weights. One engine with LoRA enabled (max_loras = N, max_lora_rank = R) runs, side by
side in the same process and alternating, three batches of 32 greedy requests (64-token
prompts, 64 output tokens, EOS ignored):

- base:       every request on the base model;
- lora-mixed: requests round-robin over the N adapters (each step mixes all of them);
- base-only-engine: the same base batch on an engine without LoRA (what enabling LoRA
  costs requests that use no adapter).

Step time = the process's CPU time (all threads) in Engine.step over the decode steps
(every step after the batch's prefill, 32 decode rows each), the median over rounds of
each round's mean: on a shared machine, wall time measures the neighbours as much as the
step. The wall-time figures (the fastest round of each side) are printed beside it.
lora_step_overhead_pct = (lora-mixed / base - 1) * 100, both on the LoRA engine.

The LAST line is machine-readable:
    RESULT lora_step_overhead_pct=<p> lora_engine_base_overhead_pct=<q>
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/engine.py: no spinning OpenMP

import argparse
import json
import statistics
import tempfile
import time
from worker.engine.build import build_engine
from pathlib import Path

BATCH, PROMPT_LEN, OUTPUT_LEN, SKIP_STEPS = 32, 64, 64, 2
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, model_dir: Path, rank: int, seed: int) -> Path:
    """A PEFT-format adapter for the model at `model_dir` (random A and B)."""
    import torch
    from safetensors.torch import save_file

    from worker.lora.model_lora import target_shapes
    from worker.model.llama import LlamaArch
    from worker.model_config import load_hf_config

    arch = LlamaArch.from_hf_config(load_hf_config(model_dir))
    shapes = target_shapes(arch)
    owner = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for target in TARGETS:
            in_f, out_f = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{owner.get(target, 'mlp')}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    return out


def make_engine(model_dir: Path, threads: int, adapters: dict[str, Path] | None, rank: int):  # noqa: ANN201
    from worker.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
    from worker.engine.core import Engine

    lora = (LoRAConfig(max_loras=len(adapters), max_lora_rank=rank, modules=tuple((n, str(p)) for n, p in adapters.items()))
            if adapters else LoRAConfig())
    return build_engine(EngineConfig(
        ModelConfig(model=str(model_dir), num_threads=threads, device="cpu", dtype="float32"),
        CacheConfig(),
        SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=BATCH * PROMPT_LEN),
        lora,
    ))


def decode_step_s(engine, loras: list[str | None], tag: str) -> tuple[float, float]:  # noqa: ANN001
    """Mean CPU time and mean wall time of the batch's decode steps."""
    import random

    from worker.api import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    for i, lora in enumerate(loras):
        prompt = [rng.randrange(3, 1000) for _ in range(PROMPT_LEN)]
        engine.add_request(f"{tag}-{i}", prompt, params, lora_name=lora)
    cpu, wall = [], []
    while engine.has_unfinished():
        c, t = time.process_time(), time.perf_counter()
        engine.step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.fmean(cpu[SKIP_STEPS:-1]), statistics.fmean(wall[SKIP_STEPS:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 11")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from benchmarks.bench_model import build

    torch.set_num_threads(args.threads)
    model_dir = build()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {f"lora{i}": write_adapter(Path(tmp) / f"lora{i}", model_dir, args.rank, seed=i)
                    for i in range(args.adapters)}
        lora_engine = make_engine(model_dir, args.threads, adapters, args.rank)
        plain_engine = make_engine(model_dir, args.threads, None, args.rank)
        names = list(adapters)
        sides = {
            "base": (lora_engine, [None] * BATCH),
            "lora-mixed": (lora_engine, [names[i % len(names)] for i in range(BATCH)]),
            "base-only-engine": (plain_engine, [None] * BATCH),
        }
        for name, (engine, loras) in sides.items():  # warm-up, untimed (adapters reach their slots)
            decode_step_s(engine, loras, f"warm-{name}")
        rounds = 5 if args.quick else 11
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        wall: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(rounds):
            for name, (engine, loras) in sides.items():
                c, w = decode_step_s(engine, loras, f"{name}-{r}")
                cpu[name].append(c)
                wall[name].append(w)
            print(f"round {r}: " + "  ".join(f"{n}={cpu[n][-1] * 1e3:.2f}ms cpu/{wall[n][-1] * 1e3:.2f}ms wall"
                                            for n in sides), flush=True)
    median = {name: statistics.median(v) for name, v in cpu.items()}
    fastest = {name: min(v) for name, v in wall.items()}
    print(f"\nmodel {model_dir.name}: batch {BATCH} decodes, {args.adapters} adapters of rank {args.rank} "
          f"on all 7 projections, {args.threads} threads, {rounds} rounds")
    for name, value in median.items():
        print(f"  {name:18s} {value * 1e3:8.2f} ms CPU/step (median of round means)  "
              f"{fastest[name] * 1e3:8.2f} ms wall/step (fastest round)")
    print(f"  wall-time overhead (fastest rounds): {(fastest['lora-mixed'] / fastest['base'] - 1) * 100:.1f}%")
    overhead = (median["lora-mixed"] / median["base"] - 1) * 100
    base_cost = (median["base"] / median["base-only-engine"] - 1) * 100
    print(f"RESULT lora_step_overhead_pct={overhead:.1f} lora_engine_base_overhead_pct={base_cost:.1f}")


if __name__ == "__main__":
    main()
