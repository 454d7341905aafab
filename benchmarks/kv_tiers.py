"""KV tiers below the device: simulated H200s with and without tiers, then reloading a
prefix against recomputing it on the real CPU engine.

    python -m benchmarks.kv_tiers [--quick] [--model PATH] [--prefix-tokens 2048]

The simulated part (benchmarks/kv_tiers_sim.py, its docstring says how) gives
later_turn_ttft_ratio, goodput_ratio_4x and tier_aware_vs_blind. The real part:

One engine with a host tier (worker/kvcache/tiers.py) and a device pool that holds one long
prompt but not two. Each round, on a fresh random prefix P (2,048 tokens by default):

  recompute  P + suffix A, nothing cached anywhere: the whole prompt is prefilled
  evict      a filler prompt as long, which pushes P's blocks off the device into the host tier
  reload     P + suffix B: P's blocks are copied back from the host tier, only B is prefilled
  device     P + suffix C right after: P is on the device (the floor: no copy, no compute)

Each figure is the request's wall time to its first token (add to first output, the
synchronous engine stepped on this thread), greedy, one output token; suffixes are 16
tokens. The reload's first token is checked against a recompute of the same prompt on a
second engine without tiers in the first round (a mismatch fails the run). Figures are
medians over the rounds (2 with --quick, else 4). The default model is SmolLM2-135M (a
real 30-layer checkpoint, the GGUF the tests use) when installed, else the benchmark
model (benchmarks/bench_model.py, whose 2,048-token context caps the prefix).

RESULT later_turn_ttft_ratio=<a> goodput_ratio_4x=<b> tier_aware_vs_blind=<c>
       reload_vs_recompute=<median reload TTFT / median recompute TTFT>   (one line)
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.engine.build import build_engine

BLOCK = 16
SUFFIX = 16


def default_model() -> tuple[Path, int]:
    """(model path, the longest prefix its context allows with a suffix and one token)."""
    from tests.support.real_models import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is not None:
        return gguf, 8192 - SUFFIX - BLOCK
    from benchmarks.bench_model import SHAPE, build

    return build(), (SHAPE["max_position_embeddings"] - SUFFIX - 1) // BLOCK * BLOCK


def make_engine(model: Path, num_blocks: int, host_blocks: int) -> Engine:
    cache = CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks)
    engine = build_engine(EngineConfig(
        ModelConfig(str(model), dtype="float32", device="cpu"), cache,
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048)))
    if host_blocks:
        from kv.host_tier import HostTier
        from worker.kvcache.tiers import TierManager

        spec = engine.runner.kv_spec
        engine.use_tiers(TierManager(engine.runner, spec, HostTier(spec, host_blocks)))
    return engine


def ttft(engine: Engine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Wall seconds from add to the first token, and that token."""
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished():
                    engine.step()
                return elapsed, out.new_token_ids[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds instead of 4, and the simulated searches' quick plan")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from benchmarks import kv_tiers_sim

    sim = kv_tiers_sim.run(args.quick)
    reload_ratio = reload_vs_recompute(args)
    print(f"RESULT later_turn_ttft_ratio={sim.later_turn_ttft_ratio:.3f} goodput_ratio_4x={sim.goodput_ratio_4x:.3f} "
          f"tier_aware_vs_blind={sim.tier_aware_vs_blind:.3f} reload_vs_recompute={reload_ratio:.3f}")


def reload_vs_recompute(args: argparse.Namespace) -> float:
    """The real engine's part: median reload TTFT / median recompute TTFT."""
    torch.set_num_threads(args.threads)
    model, longest = default_model() if args.model is None else (args.model, args.prefix_tokens)
    prefix_tokens = min(args.prefix_tokens, longest) // BLOCK * BLOCK
    rounds = 2 if args.quick else 4
    prompt_blocks = (prefix_tokens + SUFFIX) // BLOCK + 1  # with its one output token
    # The device holds exactly one prompt: the filler pushes every block of the prefix out.
    engine = make_engine(model, num_blocks=prompt_blocks, host_blocks=2 * prompt_blocks)
    reference = make_engine(model, num_blocks=prompt_blocks, host_blocks=0)
    vocab = engine.vocab_size
    spec = engine.runner.kv_spec
    print(f"model: {model}")
    print(f"prefix: {prefix_tokens} tokens ({prefix_tokens // BLOCK} blocks of {BLOCK}), suffix {SUFFIX}; "
          f"KV {spec.bytes_per_block * prefix_tokens // BLOCK / 2**20:.1f} MiB per prefix "
          f"({spec.num_layers} layers, {spec.num_kv_heads} KV heads, {spec.dtype}); "
          f"device {engine.kv.num_total_blocks} blocks, host tier {engine.tiers.host.num_slots} blocks; "
          f"{args.threads} threads")
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    ttft(engine, "warm", tokens(64))  # first-call costs out of the rounds
    recompute, reload, device, mismatches = [], [], [], 0
    for r in range(rounds):
        prefix = tokens(prefix_tokens)
        t_recompute, _ = ttft(engine, f"recompute{r}", prefix + tokens(SUFFIX))
        ttft(engine, f"filler{r}", tokens(prefix_tokens + SUFFIX))
        loaded_before = engine.tiers.num_loaded_blocks
        prompt_b = prefix + tokens(SUFFIX)
        t_reload, token_b = ttft(engine, f"reload{r}", prompt_b)
        num_loaded = engine.tiers.num_loaded_blocks - loaded_before
        t_device, _ = ttft(engine, f"device{r}", prefix + tokens(SUFFIX))
        check = ""
        if r == 0:  # one exactness check (a recompute costs as much as a round's two)
            _, token_ref = ttft(reference, f"ref{r}", prompt_b)
            mismatches += token_b != token_ref
            check = f"; reload's token {'==' if token_b == token_ref else '!='} a recompute's"
        print(f"round {r}: recompute {t_recompute * 1e3:.1f} ms, reload {t_reload * 1e3:.1f} ms "
              f"({num_loaded} blocks from the host tier), device hit {t_device * 1e3:.1f} ms{check}", flush=True)
        recompute.append(t_recompute)
        reload.append(t_reload)
        device.append(t_device)
    med = statistics.median
    print(f"medians: recompute {med(recompute) * 1e3:.1f} ms, reload {med(reload) * 1e3:.1f} ms, "
          f"device hit {med(device) * 1e3:.1f} ms; reload / device hit {med(reload) / med(device):.2f}")
    if mismatches:
        raise SystemExit(f"{mismatches} reloads sampled another token than a recompute of the same prompt")
    print(f"reload_vs_recompute={med(reload) / med(recompute):.3f}", flush=True)
    return med(reload) / med(recompute)


if __name__ == "__main__":
    main()
