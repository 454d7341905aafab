"""Side-by-side throughput: the kvserve engine vs transformers' static and continuous batching.

    python -m benchmarks.engine [--quick] [--requests N] [--seed S] [--model DIR]
                                [--systems kvserve,hf_static,hf_cb] [--profile]

One fixed, seeded workload (benchmarks/workload.py: 128 requests, --quick 64; prompts
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
- hf_cb: transformers' continuous batching (the manager behind `generate_batch`), with
  max_requests_per_batch=32 and the same token budget. `generate_batch` itself takes ONE
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
    RESULT engine_vs_hf_static=<x> engine_vs_hf_cb=<y> overhead_pct=<z>
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
import cProfile

import io
import json
import logging
import math
import pstats
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.hf_peers import (
    PeerRun,
    cb_num_blocks,
    continuous_batching_generate,
    load_hf_model,
    reference_generate,
    static_generate,
)
from benchmarks.workload import Request, WorkloadSpec, describe, make_workload

ALL_SYSTEMS = ("kvserve", "hf_static", "hf_cb")
CONCURRENCY = 32
MAX_BATCHED_TOKENS = 2048
# Warm-up prompts unlike any workload prompt, so that no prefix cache (kvserve's or
# transformers') carries blocks from the warm-up into the timed run.
WARMUP_PROMPTS = (list(range(3, 35)), list(range(35, 67)))


@dataclass
class SystemResult:
    name: str
    wall_s: float
    cpu_s: float  # process CPU time over the timed region (all threads)
    useful_tokens: int
    generated_tokens: int  # tokens the system computed, discarded ones included
    outputs: dict[str, list[int]]  # request id -> its useful output tokens
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else float("nan")


# ----------------------------------------------------------------------------- kvserve


@dataclass
class StepRecord:
    num_seqs: int
    num_tokens: int
    all_decode: bool
    step_s: float
    forward_s: float


def run_kvserve(
    model_dir: Path, requests: list[Request], threads: int, profile: bool, max_model_len: int
) -> tuple[SystemResult, list[StepRecord], str | None]:
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.engine import Engine
    from worker.sampling_params import SamplingParams

    engine = Engine.from_config(
        EngineConfig(
            ModelConfig(model=str(model_dir), num_threads=threads),
            CacheConfig(),
            SchedulerConfig(
                max_num_seqs=CONCURRENCY,
                max_num_batched_tokens=MAX_BATCHED_TOKENS,
                max_model_len=max_model_len,
            ),
        )
    )
    torch.set_num_threads(threads)

    # Record each step's plan shape next to the engine's own step / forward timings.
    plans: list[tuple[int, int, bool]] = []
    execute = engine.runner.execute

    def recording_execute(plan):  # type: ignore[no-untyped-def]
        plans.append((len(plan.seqs), plan.num_batched_tokens, all(n == 1 for n in plan.num_new_tokens)))
        return execute(plan)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]

    # Warm-up (untimed): a couple of short requests through prefill and decode.
    for i, prompt in enumerate(WARMUP_PROMPTS):
        engine.add_request(f"warmup-{i}", prompt,
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    plans.clear()
    steps_before = engine.num_steps

    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    records: list[StepRecord] = []
    profiler = cProfile.Profile() if profile else None
    start, cpu_start = time.perf_counter(), time.process_time()
    for r in requests:
        engine.add_request(r.request_id, r.prompt_token_ids,
                           SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    if profiler:
        profiler.enable()
    while engine.has_unfinished():
        step0, fwd0, n0 = engine.step_time_s, engine.forward_time_s, len(plans)
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"kvserve failed {out.request_id}: {out.error}")
            outputs[out.request_id].extend(out.new_token_ids)
        if len(plans) > n0:
            num_seqs, num_tokens, all_decode = plans[-1]
            records.append(StepRecord(num_seqs, num_tokens, all_decode,
                                      engine.step_time_s - step0, engine.forward_time_s - fwd0))
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start

    stats = engine.stats()
    for r in requests:
        if len(outputs[r.request_id]) != r.max_tokens:
            raise RuntimeError(f"kvserve gave {len(outputs[r.request_id])} tokens for {r.request_id}, "
                               f"expected {r.max_tokens}")
    useful = sum(r.max_tokens for r in requests)
    result = SystemResult("kvserve", wall, cpu, useful, useful, outputs)
    result.notes.append(
        f"kvserve: {stats.num_steps - steps_before} steps, {stats.num_preemptions} preemptions, "
        f"forward share of step time {stats.forward_share:.1%} (all steps, warm-up included), "
        f"step time / wall {sum(s.step_s for s in records) / wall:.1%}"
    )
    report = None
    if profiler:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(30)
        buf.write("\n--- by own time ---\n")
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(20)
        report = buf.getvalue()
    return result, records, report


def overhead_at_full_batch(records: list[StepRecord]) -> tuple[float, int, float, str]:
    """(overhead share, number of steps, mean step ms, which steps) over the decode-only
    steps that ran a full batch of CONCURRENCY sequences; falls back to all decode-only
    steps when none did (a workload smaller than the concurrency)."""
    which = f"decode-only steps with {CONCURRENCY} running"
    full = [s for s in records if s.all_decode and s.num_seqs >= CONCURRENCY]
    if not full:
        which = f"no step ran {CONCURRENCY} sequences; all decode-only steps"
        full = [s for s in records if s.all_decode]
    if not full:
        return float("nan"), 0, float("nan"), "no decode-only steps"
    step = sum(s.step_s for s in full)
    fwd = sum(s.forward_s for s in full)
    return (step - fwd) / step, len(full), 1000 * step / len(full), which


# ----------------------------------------------------------------------------- transformers
# The peers themselves are benchmarks/hf_peers.py; these wrap them for the report
# (fp32 on CPU, the workload's Requests, the same concurrency and token budget).


def _peer_result(name: str, requests: list[Request], run: PeerRun, notes: list[str]) -> SystemResult:
    outputs = {r.request_id: tokens for r, tokens in zip(requests, run.tokens)}
    useful = sum(r.max_tokens for r in requests)
    return SystemResult(name, run.wall_s, run.cpu_s, useful, run.generated_tokens, outputs, notes)


def run_hf_static(model_dir: Path, requests: list[Request]) -> SystemResult:
    model = load_hf_model(model_dir, "sdpa")
    run = static_generate(model, [r.prompt_token_ids for r in requests], [r.max_tokens for r in requests],
                          CONCURRENCY, WARMUP_PROMPTS)
    return _peer_result("hf_static", requests, run, [f"hf_static: {run.note}"])


def run_hf_cb(model_dir: Path, requests: list[Request], attn: str, api: str,
              max_model_len: int, page_size: int = 16) -> SystemResult:
    model = load_hf_model(model_dir, attn)
    # The same KV capacity as kvserve's default 256 MiB pool for this model shape is far
    # more than 32 in-flight requests need; size it for them.
    num_blocks = cb_num_blocks(CONCURRENCY, max_model_len, page_size)
    run = continuous_batching_generate(
        model, [r.prompt_token_ids for r in requests], [r.max_tokens for r in requests],
        max_requests_per_batch=CONCURRENCY, max_batch_tokens=MAX_BATCHED_TOKENS, num_blocks=num_blocks,
        page_size=page_size, api=api, warmup_prompts=WARMUP_PROMPTS,
    )
    note = f"hf_cb: {run.note}; attention {attn!r}, page_size {page_size}, {num_blocks} blocks"
    return _peer_result("hf_cb", requests, run, [note])


def hf_reference(model_dir: Path, requests: list[Request]) -> dict[str, list[int]]:
    """Per-request greedy `generate` (no padding): the reference when hf_static is not run."""
    model = load_hf_model(model_dir, "sdpa")
    tokens = reference_generate(model, [r.prompt_token_ids for r in requests], [r.max_tokens for r in requests])
    return {r.request_id: t for r, t in zip(requests, tokens)}


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
    parser.add_argument("--hf-cb-page-size", type=int, default=16,
                        help="tokens per KV page in transformers' continuous batching (kvserve uses 16)")
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
            results[name] = run_hf_cb(model_dir, requests, args.hf_cb_attn, args.hf_cb_api, max_model_len,
                                      args.hf_cb_page_size)
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
    if "hf_cb" in results and "hf_static" in results:
        all_ids = [r.request_id for r in requests]
        n, detail = count_mismatches(results["hf_cb"].outputs, results["hf_static"].outputs, all_ids)
        print(f"correctness: hf_cb vs hf_static, all {len(all_ids)} requests: {n} mismatches{detail}")
    if "kvserve" in results and "hf_cb" in results:
        all_ids = [r.request_id for r in requests]
        n, detail = count_mismatches(results["kvserve"].outputs, results["hf_cb"].outputs, all_ids)
        print(f"correctness: kvserve vs hf_cb, all {len(all_ids)} requests: {n} mismatches{detail}")

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
          f"engine_vs_hf_cb={fmt_ratio(ratio('hf_cb'))} overhead_pct={overhead_pct}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
