"""Side-by-side throughput: the kvserve engine vs transformers' static and continuous batching.

    python -m benchmarks.engine [--quick] [--requests N] [--seed S] [--model DIR]
                                [--systems kvserve,hf_static,hf_cb,hf_cb_matched] [--profile]

One fixed, seeded workload (cluster/workload/token_prompts.py: 128 requests, --quick 64; prompts
uniform 16-256 random token ids; outputs lognormal mean ~96, capped at 384) runs on the
same model (benchmarks/bench_model.py, ~31M Llama, fp32, built once) on the same
machine, one system after another, with torch.set_num_threads(2) everywhere. All
requests are greedy with EOS ignored, so every system produces exactly max_tokens tokens
per request; "useful tokens" is the sum of max_tokens in every row of the table.

Concurrency 32, all requests submitted at t = 0 (no arrival process):
- kvserve: every request is added before the first step; the scheduler admits up to
  max_num_seqs=32 running sequences, token budget max_num_batched_tokens (2048).
- hf_static: `generate` on groups of 32 in arrival order, left padding + attention mask,
  max_new_tokens = the group's longest request; EOS is disabled so every group runs to
  its longest request; tokens past a request's own max_tokens are discarded (not useful).
- hf_cb: transformers' continuous batching (the manager behind `generate_batch`) at its
  own defaults (its page size, 256 in transformers 5.24; CUDA graphs / async batching / flash
  switch as it decides:
  benchmarks/hf_peers.py), with max_requests_per_batch=32 and the same token budget.
- hf_cb_matched: the same at kvserve's KV layout (16-token pages), graphs, async batching
  and the flash switch off. Both are reported: the peer at its best and like for like.
  For both: `generate_batch` itself takes ONE
  max_new_tokens for all requests (it calls `manager.add_requests(max_new_tokens=...)`),
  but the manager's `add_request` takes one per request, so by default we drive the
  manager exactly as `generate_batch` does (`continuous_batching_context_manager`) and add
  each request with its own limit: no wasted tokens. `--hf-cb-api generate_batch` runs
  `generate_batch` itself with the workload's max and counts only useful tokens.

The transformers peers are benchmarks/hf_peers.py (reusable on their own); this module
runs them and kvserve on the workload and reports.

Timed region: from submitting the first request to the last token of the last request;
model loading, KV allocation and a short warm-up are outside it.

The engine-overhead figure is the share of kvserve step time spent outside the model
forward (+ logits), over the steps that ran a full batch of 32 decodes:
sum(step_s - forward_s) / sum(step_s).

Correctness side effect: kvserve's greedy tokens for the first few requests must equal
hf_static's (fp32, same weights); the mismatch count is printed.

The LAST line is machine-readable:
    RESULT engine_vs_hf_static=<x> engine_vs_hf_cb=<y> engine_vs_hf_cb_matched=<w> overhead_pct=<z>
(ratios = kvserve useful tokens/s over the peer's; "nan" for a system not run).
"""
from __future__ import annotations

import os

# OpenMP workers that spin while waiting for a peer thread are ruinous on a shared CPU:
# with 2 threads on a loaded 2-core box, kvserve's decode step measured 4.5x slower
# with the default (spinning) policy than with PASSIVE. Set before torch loads OpenMP;
# an explicit OMP_WAIT_POLICY in the environment wins. Same for every system.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine_systems import (
    CONCURRENCY,
    MAX_BATCHED_TOKENS,
    StepRecord,
    SystemResult,
    hf_reference,
    overhead_at_full_batch,
    run_hf_cb,
    run_hf_static,
    run_kvserve,
)
from cluster.workload.token_prompts import WorkloadSpec, describe, make_workload

ALL_SYSTEMS = ("kvserve", "hf_static", "hf_cb", "hf_cb_matched")


def count_mismatches(a: dict[str, list[int]], b: dict[str, list[int]], ids: list[str]) -> tuple[int, str]:
    bad = [i for i in ids if a.get(i) != b.get(i)]
    detail = ""
    if bad:
        i = bad[0]
        x, y = a.get(i, []), b.get(i, [])
        first = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        detail = f" (first: {i} diverges at output token {first})"
    return len(bad), detail


# ----------------------------------------------------------------------------- main


def special_ids(model_dir: Path) -> frozenset[int]:

    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = model_dir / name
        if not p.exists():
            continue
        cfg = json.loads(p.read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            v = cfg.get(key)
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, list):
                ids.update(x for x in v if isinstance(x, int))
    return frozenset(ids)


def fmt_ratio(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvserve vs transformers, side by side, one workload.")
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 128")
    parser.add_argument("--requests", type=int, default=None, help="number of requests (overrides --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the bench model)")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma list of " + ",".join(ALL_SYSTEMS))
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads for every system")
    parser.add_argument("--check", type=int, default=4, help="requests checked token-for-token")
    parser.add_argument("--hf-cb-attn", default="sdpa", choices=["sdpa", "paged|eager"],
                        help="attention implementation for transformers' continuous batching")
    parser.add_argument("--hf-cb-api", default="manager", choices=["manager", "generate_batch"],
                        help="manager: per-request max_new_tokens; generate_batch: one limit for all")
    parser.add_argument("--profile", action="store_true", help="cProfile the kvserve steps and print the top")
    args = parser.parse_args(argv)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {','.join(ALL_SYSTEMS)}")

    logging.basicConfig(level=logging.WARNING)
    for name in ("transformers", "transformers.generation.continuous_batching"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - cosmetic only
        pass
    torch.set_num_threads(args.threads)

    if args.model is None:
        from benchmarks.bench_model import build

        model_dir = build()
    else:
        model_dir = args.model.expanduser().resolve()

    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    num_requests = args.requests or (64 if args.quick else 128)
    spec = WorkloadSpec(num_requests=num_requests, seed=args.seed, vocab_size=vocab_size,
                        avoid_token_ids=special_ids(model_dir))
    requests = make_workload(spec)
    max_model_len = spec.prompt_max + spec.output_cap + 16

    print(f"model: {model_dir}")
    print(f"workload (seed {args.seed}): {describe(requests)}")
    print(f"concurrency {CONCURRENCY} (all requests submitted at t=0), token budget {MAX_BATCHED_TOKENS}, "
          f"greedy, EOS ignored, torch threads {args.threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"systems {','.join(systems)}")
    sys.stdout.flush()

    results: dict[str, SystemResult] = {}
    records: list[StepRecord] = []
    profile_report = None
    for name in systems:
        t = time.perf_counter()
        if name == "kvserve":
            results[name], records, profile_report = run_kvserve(
                model_dir, requests, args.threads, args.profile, max_model_len)
        elif name == "hf_static":
            results[name] = run_hf_static(model_dir, requests)
        else:
            settings = "defaults" if name == "hf_cb" else name.removeprefix("hf_cb_")
            results[name] = run_hf_cb(model_dir, requests, args.hf_cb_attn, args.hf_cb_api, max_model_len, settings)
        torch.set_num_threads(args.threads)
        res = results[name]
        print(f"  {name:<10} done: {res.wall_s:7.2f} s timed, {time.perf_counter() - t:7.2f} s with load/warm-up")
        sys.stdout.flush()

    # Correctness (a side effect): kvserve greedy == transformers greedy.
    check_ids = [r.request_id for r in requests[: args.check]]
    if "kvserve" in results and args.check > 0:
        if "hf_static" in results:
            ref, ref_name = results["hf_static"].outputs, "hf_static"
        else:
            ref, ref_name = hf_reference(model_dir, requests[: args.check]), "hf generate (per request)"
        n, detail = count_mismatches(results["kvserve"].outputs, ref, check_ids)
        print(f"correctness: kvserve vs {ref_name}, first {len(check_ids)} requests: {n} mismatches{detail}")
    all_ids = [r.request_id for r in requests]
    for cb in ("hf_cb", "hf_cb_matched"):
        for other in ("hf_static", "kvserve"):
            if cb in results and other in results:
                n, detail = count_mismatches(results[other].outputs, results[cb].outputs, all_ids)
                print(f"correctness: {other} vs {cb}, all {len(all_ids)} requests: {n} mismatches{detail}")

    print()
    print(f"{'system':<10} {'useful tok':>10} {'computed':>9} {'wall s':>8} {'cpu s':>8} {'useful tok/s':>13} "
          f"{'kvserve/peer':>13} {'(by cpu s)':>11}")
    base = results.get("kvserve")
    for name in systems:
        res = results[name]
        ratio = base.tokens_per_s / res.tokens_per_s if base else float("nan")
        cpu_ratio = res.cpu_s / base.cpu_s if base and base.cpu_s > 0 else float("nan")
        print(f"{name:<10} {res.useful_tokens:>10} {res.generated_tokens:>9} {res.wall_s:>8.2f} {res.cpu_s:>8.2f} "
              f"{res.tokens_per_s:>13.1f} {fmt_ratio(ratio):>13} {fmt_ratio(cpu_ratio):>11}")
    print("(kvserve/peer = kvserve useful tok/s over the peer's, by wall time; '(by cpu s)' = the same "
          "ratio from process CPU seconds, less sensitive to other load on a shared CPU)")
    print()
    for res in results.values():
        for note in res.notes:
            print("note: " + note)

    overhead = float("nan")
    if records:
        overhead, num_full, step_ms, which = overhead_at_full_batch(records)
        decode = [s for s in records if s.all_decode]
        all_step = sum(s.step_s for s in records)
        all_fwd = sum(s.forward_s for s in records)
        print(f"engine overhead at batch {CONCURRENCY} ({which}): "
              f"{overhead:.1%} of step time outside the model forward over {num_full} steps "
              f"(mean step {step_ms:.1f} ms); all {len(records)} steps: "
              f"{(all_step - all_fwd) / all_step:.1%}; decode-only steps: {len(decode)}")
    if profile_report:
        print("\n--- cProfile of the kvserve step loop ---")
        print(profile_report)

    def ratio(peer: str) -> float:
        if "kvserve" not in results or peer not in results:
            return float("nan")
        return results["kvserve"].tokens_per_s / results[peer].tokens_per_s

    overhead_pct = "nan" if math.isnan(overhead) else f"{100 * overhead:.1f}"
    print(f"RESULT engine_vs_hf_static={fmt_ratio(ratio('hf_static'))} "
          f"engine_vs_hf_cb={fmt_ratio(ratio('hf_cb'))} engine_vs_hf_cb_matched={fmt_ratio(ratio('hf_cb_matched'))} "
          f"overhead_pct={overhead_pct}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
