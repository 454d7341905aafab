"""The model families of issue 46, measured on CPU: exactness, MoE throughput, KV geometry.

    python -m benchmarks.models [--quick] [--requests N] [--repeats R] [--threads T]
                                [--moe-model DIR] [--tiny]

Four figures, each printed with the value it is expected to take beside it:

- families_exact: every family worker/model/registry.py serves, each variant of it a tiny
  random checkpoint written by transformers; one mixed greedy batch through the engine
  against transformers' per-request greedy `generate` (benchmarks/models_exact.py).
- moe_engine_vs_hf_static: the CPU engine's useful tokens/s over transformers' static
  generation on a Qwen3-MoE of ~31M active parameters (benchmarks/bench_moe_model.py),
  benchmarks/engine.py's method, the sides alternating over --repeats repeats
  (benchmarks/models_moe.py). Workload: 128 requests, --quick 64; 2 repeats per side.
- mla_kv_bytes_vs_gqa: KV bytes per token of a DeepSeek-V3-class pool over an equal GQA
  pool (benchmarks/models_mla.py).
- sliding_kv_blocks_vs_full: the KV a long gpt-oss-class request holds over a
  full-attention one (benchmarks/models_kv.py; `nan` where that module is absent).

--tiny runs every part at its smallest (first variant per family, three short prompts; a
few MoE requests, one repeat; a short sliding request): for the unit test, not a figure.

The LAST line is machine-readable:
    RESULT families_exact=<k>/<n> moe_engine_vs_hf_static=<x> mla_kv_bytes_vs_gqa=<y> sliding_kv_blocks_vs_full=<z>
"""
from __future__ import annotations

import os

# As in benchmarks/engine.py: spinning OpenMP workers are ruinous on a shared CPU; set before
# torch loads OpenMP (an explicit OMP_WAIT_POLICY in the environment wins). Same for both sides.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import importlib.util
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.models_exact import families_exact, is_exact
from benchmarks.models_mla import mla_kv_bytes_vs_gqa
from benchmarks.models_moe import moe_engine_vs_hf_static

MOE_GOAL = 2.0
TINY_SLIDING = dict(prompt_tokens=512, output_tokens=16)


def _fmt(x: float, digits: str = ".2f") -> str:
    return "nan" if math.isnan(x) else format(x, digits)


def _quiet_transformers() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def exactness_part(tiny: bool, log: Callable[[str], None]) -> tuple[int, int]:
    log("families_exact: one mixed greedy batch per checkpoint, engine vs transformers' generate per request")
    results = families_exact(tiny=tiny, log=log)
    k, n = sum(1 for r in results.values() if is_exact(r)), len(results)
    log(f"families_exact: {k}/{n} (expected {n}/{n}); families: {', '.join(results)}")
    return k, n


def moe_part(model_dir: Path, num_requests: int, repeats: int, threads: int, log: Callable[[str], None]) -> float:
    from benchmarks.bench_moe_model import num_active_parameters
    from benchmarks.bench_model import num_parameters

    log(f"moe_engine_vs_hf_static: {model_dir} ({num_active_parameters(model_dir) / 1e6:.1f}M active of "
        f"{num_parameters(model_dir) / 1e6:.1f}M parameters)")
    r = moe_engine_vs_hf_static(model_dir, num_requests, repeats, threads, log)
    per_repeat = ", ".join(_fmt(x) for x in r.repeat_ratios())
    log(f"moe: kvserve {r.tokens_per_s('kvserve'):.1f} useful tok/s, hf_static {r.tokens_per_s('hf_static'):.1f} "
        f"(over all repeats); per repeat {per_repeat}; order {' '.join(r.order)}")
    cpu_ratio = r.cpu_tokens_per_s("kvserve") / r.cpu_tokens_per_s("hf_static")
    log(f"moe: by process CPU seconds kvserve {r.cpu_tokens_per_s('kvserve'):.1f} useful tok/cpu-s, hf_static "
        f"{r.cpu_tokens_per_s('hf_static'):.1f}: ratio {_fmt(cpu_ratio)} (beside the figure: less sensitive to "
        f"other load on a shared CPU)")
    log(f"moe: kvserve vs hf_static tokens: {r.mismatched_requests} of {num_requests} requests differ "
        f"(expected 0)")
    log(f"moe_engine_vs_hf_static: {_fmt(r.ratio)} (goal >= {MOE_GOAL})")
    return r.ratio


def mla_part(log: Callable[[str], None]) -> float:
    r = mla_kv_bytes_vs_gqa()
    log(f"mla_kv_bytes_vs_gqa: {r['mla_kv_bytes_vs_gqa']:.5f} (expected {r['expected']:.5f} = "
        f"(kv_lora_rank + qk_rope_head_dim) / (2 * kv_heads * head_dim)); MLA {r['mla_bytes_per_token']:,} "
        f"B/token, GQA {r['gqa_bytes_per_token']:,} B/token; blocks one budget buys {r['mla_blocks_vs_gqa']:.3f}x")
    return float(r["mla_kv_bytes_vs_gqa"])


def sliding_part(tiny: bool, log: Callable[[str], None]) -> float:
    if importlib.util.find_spec("benchmarks.models_kv") is None:
        log("sliding_kv_blocks_vs_full: nan (benchmarks/models_kv.py is not merged yet: it comes with Gemma 3; "
            "rerun after merging it)")
        return float("nan")
    from benchmarks.models_kv import sliding_kv_blocks_vs_full

    r = sliding_kv_blocks_vs_full(**(TINY_SLIDING if tiny else {}))
    details = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("measured", "expected"))
    log(f"sliding_kv_blocks_vs_full: {float(r['measured']):.4f} (expected {float(r['expected']):.4f}); {details}")
    return float(r["measured"])


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> str:
    """Every part in turn; returns the RESULT line (also logged)."""
    torch.set_num_threads(args.threads)
    k, n = exactness_part(args.tiny, log)
    if args.moe_model is None:
        from benchmarks.bench_moe_model import build

        model_dir = build()
    else:
        model_dir = args.moe_model.expanduser().resolve()
    num_requests = args.requests or (4 if args.tiny else 64 if args.quick else 128)
    repeats = args.repeats or (1 if args.tiny else 2)
    moe = moe_part(model_dir, num_requests, repeats, args.threads, log)
    mla = mla_part(log)
    sliding = sliding_part(args.tiny, log)
    line = (f"RESULT families_exact={k}/{n} moe_engine_vs_hf_static={_fmt(moe)} "
            f"mla_kv_bytes_vs_gqa={_fmt(mla, '.5f')} sliding_kv_blocks_vs_full={_fmt(sliding, '.4f')}")
    log(line)
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MoE requests instead of 128")
    parser.add_argument("--requests", type=int, default=None, help="MoE workload size (overrides --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per side (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads for both sides")
    parser.add_argument("--moe-model", type=Path, default=None, help="Qwen3-MoE directory (default: the bench one)")
    parser.add_argument("--tiny", action="store_true", help="every part at its smallest (the unit test)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _quiet_transformers()

    def log(line: str) -> None:
        print(line, flush=True)

    run(args, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
