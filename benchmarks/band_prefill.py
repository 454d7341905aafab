"""Worse bands' prompt tokens per step (engine.worse_band_prefill_tokens) on one simulated
engine, in modelled time: what a better band's request waits behind, and what it costs.

    python -m benchmarks.band_prefill [--num-requests 600] [--load 2.0] [--seed 0]

The real engine (scheduler, KV cache manager, chunked prefill) on a sim:h200 device
(llama-3-8b shape, max_num_seqs 8, max_model_len 4096, as benchmarks.tenants), stepped on a
virtual clock: a request joins the engine at its arrival, a step that starts at t ends at
t + the cost model's time for its plan. Six keys in three bands with benchmarks.tenants'
shares (premium 0, standard 5, batch 10, one batch key half of all requests), ShareGPT-like
lengths, Poisson arrivals at --load x the engine's capacity (its burst capacity). No
admission control: this isolates the engine, whose queue of worse-band work only grows.

Side by side on the same requests: worse bands unlimited (0), limits of 256 (the default),
512 and 1024 tokens, and instead a step-time budget of 25 ms for every band
(engine.max_step_time_s). Per run:
- worse_step_ms p99 / max: the time of the steps that carry worse bands' prompt tokens and
  no premium ones, until the last premium request arrives: what a premium request can
  arrive behind;
- premium queue p99 (arrival to the start of its first step) and TTFT p99;
- batch TTFT p50: the worse band's price;
- tokens/s: prompt plus output tokens computed per modelled second (the engine is
  saturated: its throughput); steps/s: steps per modelled second (each costs host work on
  a real device: scheduling, outputs).

    RESULT worse_step_p99_ms=<256> worse_step_p99_unlimited_ms=<..> premium_ttft_p99_vs_unlimited=<..>
           tokens_vs_unlimited=<..> batch_ttft_p50_vs_unlimited=<..> steps_vs_unlimited=<..>

Modelled time only: no wall clock enters, so the figures do not move with the box's load.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from cluster.percentile import percentile

KEYS = {"premium-1": (0, 0.1), "premium-2": (0, 0.1), "standard-1": (5, 0.1), "standard-2": (5, 0.1),
        "batch-1": (10, 0.1), "batch-flood": (10, 0.5)}
RUNS = (("unlimited", 0, None), ("256", 256, None), ("512", 512, None), ("1024", 1024, None),
        ("step 25 ms", 0, 0.025))
DEFAULT_RUN = "256"


@dataclass(frozen=True)
class Figures:
    worse_step_p99_ms: float
    worse_step_max_ms: float
    premium_queue_p99_ms: float
    premium_ttft_p99_ms: float
    batch_ttft_p50_ms: float
    tokens_per_s: float
    steps_per_s: float


def workload(num_requests: int, rate: float, seed: int) -> list[tuple[float, str, int, object]]:
    """(arrival, request id, band, SimRequest) in arrival order, each key at its share of `rate`."""
    from cluster.workload.sim_kinds import make_workload

    out = []
    for i, (key, (band, share)) in enumerate(KEYS.items()):
        for j, r in enumerate(make_workload("sharegpt", round(num_requests * share), rate * share, seed + 101 * i,
                                            input_mean=512, output_mean=64, max_len=2048)):
            out.append((r.arrival_s, f"{key}/{j}", band, r))
    return sorted(out, key=lambda x: x[0])


def run(requests: list, limit: int, max_step_time_s: float | None) -> Figures:
    """One engine through `requests` on a virtual clock."""
    from worker.api import SamplingParams
    from worker.config import CacheConfig, SchedulerConfig
    from worker.sim.build import build_sim_engine

    config = SchedulerConfig(max_num_seqs=8, max_model_len=4096, worse_band_prefill_tokens=limit,
                             max_step_time_s=max_step_time_s)
    engine = build_sim_engine("llama-3-8b", "h200", config, CacheConfig())
    plans: list = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: (plans.append(plan), execute(plan))[1]  # to read each step's plan
    now = [0.0]
    limiter = engine.scheduler.band_limit
    if limiter is not None:
        limiter.clock = lambda: now[0]  # the rule's window in modelled time
    band, arrival, started, first = {}, {}, {}, {}
    worse_steps: list[tuple[float, float]] = []  # (start, duration)
    num_tokens, num_steps, i = 0, 0, 0
    while i < len(requests) or engine.has_unfinished():
        while i < len(requests) and requests[i][0] <= now[0]:
            t, rid, b, r = requests[i]
            i += 1
            engine.add_request(rid, list(r.prompt_token_ids), SamplingParams(
                max_tokens=r.max_tokens, ignore_eos=True, priority=b, tenant=rid.split("/")[0]))
            band[rid], arrival[rid] = b, t
        if not engine.has_unfinished():
            now[0] = requests[i][0]
            continue
        outputs = engine.step()
        dt = engine.runner.last_step_s
        if plans:
            plan = plans.pop()
            prompt_bands = set()
            for seq, n in zip(plan.seqs, plan.num_new_tokens):
                started.setdefault(seq.request_id, now[0])
                if n > 1:
                    prompt_bands.add(seq.params.priority)
            if prompt_bands and 0 not in prompt_bands:  # a step made long by worse bands' prompts alone
                worse_steps.append((now[0], dt))
            num_tokens += sum(plan.num_new_tokens)
            num_steps += 1
        now[0] += dt
        for o in outputs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now[0]
    premium = [r for r in first if band[r] == 0]
    # The steps a premium request could arrive behind: those before the last one arrived.
    last = max((arrival[r] for r in premium), default=0.0)
    behind = [dt for t, dt in worse_steps if t <= last]
    return Figures(
        1e3 * percentile(behind, 99, method="nearest_rank") if behind else 0.0, 1e3 * max(behind, default=0.0),
        1e3 * percentile([started[r] - arrival[r] for r in premium], 99, method="nearest_rank"),
        1e3 * percentile([first[r] - arrival[r] for r in premium], 99, method="nearest_rank"),
        1e3 * percentile([first[r] - arrival[r] for r in first if band[r] == 10], 50, method="nearest_rank"),
        num_tokens / now[0], num_steps / now[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--load", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from benchmarks.tenants import BenchSpec, modelled_capacity_rps

    capacity = modelled_capacity_rps(BenchSpec(num_requests=args.num_requests, num_replicas=1, seed=args.seed))
    rate = args.load * capacity
    requests = workload(args.num_requests, rate, args.seed)
    print(f"one sim:h200 engine (llama-3-8b, max_num_seqs 8): {len(requests)} requests at {rate:.1f} req/s = "
          f"{args.load:g} x its capacity ({capacity:.1f} req/s); keys (band, share): {KEYS}", flush=True)
    alone = run([r for r in requests if r[2] == 0], 0, None)
    print(f"premium alone: queue p99 {alone.premium_queue_p99_ms:.1f} ms, TTFT p99 {alone.premium_ttft_p99_ms:.1f} ms")
    header = (f"{'run':<11} {'worse_step_p99_ms':>17} {'worse_step_max_ms':>17} {'premium_queue_p99':>17} "
              f"{'premium_ttft_p99':>16} {'vs_alone':>8} {'batch_ttft_p50':>14} {'tokens_per_s':>12} {'steps_per_s':>11}")
    print(header)
    results = {}
    for name, limit, step_s in RUNS:
        f = results[name] = run(requests, limit, step_s)
        print(f"{name:<11} {f.worse_step_p99_ms:>17.1f} {f.worse_step_max_ms:>17.1f} {f.premium_queue_p99_ms:>17.1f} "
              f"{f.premium_ttft_p99_ms:>16.1f} {f.premium_ttft_p99_ms / alone.premium_ttft_p99_ms:>8.2f} "
              f"{f.batch_ttft_p50_ms:>14.0f} {f.tokens_per_s:>12.0f} {f.steps_per_s:>11.1f}", flush=True)
    d, u = results[DEFAULT_RUN], results["unlimited"]
    print(f"RESULT worse_step_p99_ms={d.worse_step_p99_ms:.1f} worse_step_p99_unlimited_ms={u.worse_step_p99_ms:.1f} "
          f"premium_ttft_p99_vs_unlimited={d.premium_ttft_p99_ms / u.premium_ttft_p99_ms:.3f} "
          f"tokens_vs_unlimited={d.tokens_per_s / u.tokens_per_s:.3f} "
          f"batch_ttft_p50_vs_unlimited={d.batch_ttft_p50_ms / u.batch_ttft_p50_ms:.3f} "
          f"steps_vs_unlimited={d.steps_per_s / u.steps_per_s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
