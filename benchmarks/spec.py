"""N-gram speculative decoding on the CPU engine, on and off side by side, on a copy-heavy
workload.

    python -m benchmarks.spec [--repeats 5] [--num-tokens 4] [--prefix-tokens 96] [--max-tokens 96]

The model is the embedded default model (`kvserve-tiny`, worker/default_model/), trained,
fp32, one torch thread. The workload is built so that each answer really copies spans of
its prompt under greedy decoding, from the model's own text: for each seed (a chat turn
asking for a story, a summary of a passage or a code edit of a snippet), the engine
without speculation first generates the model's greedy continuation g of the seed
(prefix + max tokens, EOS ignored); the request's prompt is then the seed followed by
g[:prefix], and its answer is g[prefix:], which repeats the turns and phrases the model
already wrote in the prompt. Every request is greedy with EOS ignored, so each side
produces exactly max_tokens tokens.

After one untimed pass of each side, per repeat the sides take turns (the order
alternating), each running every prompt alone
(batch 1) and then all at once (batch = number of seeds). Measured per request: the mean
inter-token latency (time from its first output to its last over the tokens between;
tokens a verify step emits together share that step's time) and the decode steps that gave
it tokens.

Last line:
    RESULT spec_exact=<0|1> ngram_tokens_per_step=<t> spec_itl_ratio_b1=<r>
spec_exact: every answer of the speculative side is token for token the plain side's and
g[prefix:]; ngram_tokens_per_step: a request's output tokens per decode step at batch 1
with speculation (after its first token; the plain engine's is 1); spec_itl_ratio_b1: the median over repeats of
mean ITL at batch 1, speculation on over off.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

from worker.api import SamplingParams, load_tokenizer
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from worker.default_model import default_model_path
from worker.engine.build import build_engine
from worker.engine.core import Engine

PASSAGE = ("The sun is a star. The moon goes around the earth. Water boils at one hundred degrees. "
           "A cat likes to sleep in the sun. The dog runs in the park every morning.")
SNIPPET = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"
SEEDS = (
    "Tell me a short story about a cat.",
    f"Summarize this text: {PASSAGE}",
    f"Repeat this text exactly: {PASSAGE}",
    f"Rename add to plus in this code:\n{SNIPPET}",
    "What is the capital of France?",
    f"Summarize in one sentence: {PASSAGE} {PASSAGE}",
)


@dataclass
class SideRun:
    """One side's pass over the workload at one batch size."""

    outputs: list[list[int]]
    itl_s: list[float]  # per request: mean seconds per token after its first
    decode_rows: int  # (step, request) pairs that gave a request tokens after its first
    num_decode_tokens: int  # output tokens after each request's first


def make_engine(path: str, num_tokens: int | None) -> Engine:
    spec = SpeculativeConfig(method="ngram", num_tokens=num_tokens) if num_tokens else SpeculativeConfig()
    return build_engine(EngineConfig(
        ModelConfig(path, dtype="float32", device="cpu", num_threads=1),
        CacheConfig(block_size=16, kv_cache_bytes=64 * 1024**2),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
        speculative=spec,
    ))


def build_workload(path: str, prefix: int, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, expected answers): seed + g[:prefix] and g[prefix:] (the module docstring)."""
    tokenizer = load_tokenizer(path)
    engine = make_engine(path, None)
    prompts, answers = [], []
    for i, seed in enumerate(SEEDS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": seed}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        g = run(engine, [ids], prefix + max_tokens, f"w{i}").outputs[0]
        prompts.append(ids + g[:prefix])
        answers.append(g[prefix:])
    return prompts, answers


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, tag: str) -> SideRun:
    """Every prompt at once, stepped to the end; per request the output times."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    decode_rows = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        decode_rows += sum(1 for o in outputs if o.request_id in first)
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
    itl = [(last[r] - first[r]) / max(len(tokens[r]) - 1, 1) for r in ids]
    return SideRun([tokens[r] for r in ids], itl, decode_rows, sum(len(tokens[r]) - 1 for r in ids))


def measure(engines: dict[str, Engine], prompts: list[list[int]], max_tokens: int, repeats: int,
            ) -> dict[tuple[str, int], list[SideRun]]:
    """(side, batch) -> runs: batch 1 (each prompt alone, one SideRun per repeat) and all at once."""
    runs: dict[tuple[str, int], list[SideRun]] = {}
    names = list(engines)
    for name in names:  # warm-up, untimed: each side's first steps of each shape
        run(engines[name], prompts, max_tokens, f"{name}warm")
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for name in order:
            engine = engines[name]
            alone = [run(engine, [p], max_tokens, f"{name}{repeat}a{i}") for i, p in enumerate(prompts)]
            b1 = SideRun([a.outputs[0] for a in alone], [a.itl_s[0] for a in alone],
                         sum(a.decode_rows for a in alone), sum(a.num_decode_tokens for a in alone))
            batch = run(engine, prompts, max_tokens, f"{name}{repeat}b")
            runs.setdefault((name, 1), []).append(b1)
            runs.setdefault((name, len(prompts)), []).append(batch)
            for size, r in ((1, b1), (len(prompts), batch)):
                print(f"  repeat {repeat + 1}/{repeats} {name:<4} b{size}: mean ITL "
                      f"{1e3 * statistics.mean(r.itl_s):.3f} ms, {r.num_decode_tokens / r.decode_rows:.2f} "
                      f"tokens per decode step of a request", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-tokens", type=int, default=4, help="draft tokens per decode row (k)")
    p.add_argument("--prefix-tokens", type=int, default=96, help="tokens of the model's own continuation in each prompt")
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, load average before {os.getloadavg()}", flush=True)
    path = default_model_path()
    prompts, answers = build_workload(path, args.prefix_tokens, args.max_tokens)
    print(f"workload: {len(prompts)} prompts of {[len(q) for q in prompts]} tokens, {args.max_tokens} "
          f"output tokens each; k = {args.num_tokens}", flush=True)
    engines = {"off": make_engine(path, None), "on": make_engine(path, args.num_tokens)}
    runs = measure(engines, prompts, args.max_tokens, args.repeats)
    exact = all(r.outputs == answers for key, rs in runs.items() for r in rs)
    stats = engines["on"].stats()
    print(f"spec engine: {stats.num_draft_tokens} drafts verified, {stats.num_accepted_draft_tokens} accepted "
          f"(acceptance {stats.num_accepted_draft_tokens / max(stats.num_draft_tokens, 1):.3f}) in "
          f"{stats.num_verify_rows} verify rows", flush=True)
    result: dict[str, float] = {}
    for size in sorted({s for _, s in runs}):
        ratios = [statistics.mean(on.itl_s) / statistics.mean(off.itl_s)
                  for on, off in zip(runs["on", size], runs["off", size])]
        tokens_per_step = statistics.median(r.num_decode_tokens / r.decode_rows for r in runs["on", size])
        print(f"b{size}: ITL on/off per repeat {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}; "
              f"{tokens_per_step:.2f} tokens per decode step with speculation", flush=True)
        result[f"spec_itl_ratio_b{size}"] = statistics.median(ratios)
        result[f"ngram_tokens_per_step_b{size}"] = tokens_per_step
    print(f"RESULT spec_exact={int(exact)} ngram_tokens_per_step={result['ngram_tokens_per_step_b1']:.2f} "
          f"spec_itl_ratio_b1={result['spec_itl_ratio_b1']:.3f}", flush=True)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
