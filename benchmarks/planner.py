"""The SLO planner vs the queue-depth autoscaler vs a static fleet sized for the peak, in
the simulator (simulated H200s, llama-3-8b, replicas take `--startup-s` to start); with
--serve, the bursty case once more on a real Serve cluster of simulated devices.

    python -m benchmarks.planner [--phase-s 180] [--cycles 8] [--rate-scale 1] [--hour-s 120] [--seed 0]
                                 [--serve | --serve-only]

  bursty  arrivals alternating between 1 and 24 req/s every --phase-s, 8k-token prompts,
          1k-token answers, TTFT <= 3 s and ITL <= 35 ms at p90, disaggregated pools; the
          same seeded requests for each fleet:
            planner   cluster/sim/planner.py (the SLO planner, as under Serve)
            queue     cluster/sim/autoscale.py (today's queue-depth policy at kvserve's
                      defaults, Serve's delays as kvserve's config sets them: up 10 s, down 120 s)
            static    the pools the planner's sizing gives for the peak rate, all run long
          each autoscaled pool 1..twice the larger peak pool; beside them, the GPU time a
          fleet that knows the trace needs (planner_cases.oracle_gpu_seconds): the least any
          planner meeting every burst can use
  day     three models over a compressed day (benchmarks/planner_cases.py), each its own
          mixed pool planned with scale-to-zero, on one clock (cluster/sim/fleet.py);
          TTFT <= 2 s, ITL <= 50 ms at p90; once with no GPU budget (the RESULT's figure),
          once with --day-budget GPUs shared by priority (day > evening > night)
  serve   (--serve) benchmarks/planner_serve.py: a shorter bursty trace on a local Serve
          cluster of time-dilated simulated devices, the planner as Serve's policy, beside
          the simulator's run of the same trace

SLO attainment: the share of requests with TTFT and mean ITL within the targets (a request
that never finished counts as missed). GPU hours: each replica from its creation to its
removal or the run's end. Last line:

    RESULT planner_slo_attainment=<a> queue_slo_attainment=<q> planner_gpu_hours_vs_queue=<g>
           planner_gpu_hours_vs_static=<s> multi_model_slo_attainment=<m> serve_vs_sim_attainment_gap=<d>

serve_vs_sim_attainment_gap = |Serve's attainment - the simulator's| (n/a without --serve).
A benchmark: nothing asserts.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

from benchmarks.planner_cases import (
    attainment, bursty_phases, day_requests, gpu_seconds, oracle_gpu_seconds, phased_requests, DAY_RATES,
)
from benchmarks.planner_serve import ServeCase, run_serve_vs_sim
from cluster.planner.forecast import Load
from cluster.planner.sizing import EngineLimits, PoolSizer
from cluster.planner.targets import PlannerSettings, SLOTargets
from cluster.sim.autoscale import AutoscaleOptions
from cluster.sim.disagg import DisaggOptions
from cluster.sim.fleet import simulate_fleet
from cluster.sim.planner import SimPlannerOptions
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.pool_config import DOWNSCALE_DELAY_S, UPSCALE_DELAY_S
from worker.costs.cost_model import StepCostModel
from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape

SHAPE, PROFILE = "llama-3-8b", "h200"
BURSTY_SLO = SLOTargets(ttft_s=3.0, itl_s=0.035)
DAY_SLO = SLOTargets(ttft_s=2.0, itl_s=0.05)
MAX_REPLICAS = 16
PROMPT_TOKENS, OUTPUT_TOKENS = 8000, 1024


def base_config(slo: SLOTargets, seed: int) -> SimConfig:
    return SimConfig(shape=SHAPE, profile=PROFILE, router="headroom", max_num_seqs=256, max_num_batched_tokens=8192,
                     max_model_len=16384, slo_ttft_ms=slo.ttft_s * 1000, slo_itl_ms=slo.itl_s * 1000, seed=seed)


def pool_sizer(config: SimConfig, slo: SLOTargets, settings: PlannerSettings) -> PoolSizer:
    cost = StepCostModel(load_shape(SHAPE), load_profile(PROFILE))
    device = SimDevice.from_config(config)
    return PoolSizer(cost, EngineLimits(config.max_num_seqs, config.max_num_batched_tokens,
                                        device.num_blocks * config.block_size), slo, settings)


def peak_pools(config: SimConfig, slo: SLOTargets, settings: PlannerSettings, load: Load) -> tuple[int, int]:
    """(prefill, decode) replicas the planner's sizing gives for `load`."""
    sizer = pool_sizer(config, slo, settings)
    return sizer.prefill_replicas(load), sizer.decode_replicas(load)


def oracle_vs_static(args: argparse.Namespace, config: SimConfig, settings: PlannerSettings,
                     static_gpu_s: float, end_s: float) -> float:
    """The GPU time of a fleet that knows the trace (planner_cases.oracle_gpu_seconds) over the
    static fleet's: the least planner_gpu_hours_vs_static any planner meeting every burst can
    reach. Its peak pools come a start-up before each burst and go when it ends: prefill at
    once, decode after one answer at a batch of one (the fastest an answer can be)."""
    low, high = 1.0 * args.rate_scale, 24.0 * args.rate_scale
    sizer = pool_sizer(config, BURSTY_SLO, settings)
    answer_s = OUTPUT_TOKENS * sizer.decode_step_s(1, PROMPT_TOKENS + OUTPUT_TOKENS // 2)
    oracle = oracle_gpu_seconds(bursty_phases(low, high, args.phase_s, args.cycles), high,
                                peak_pools(config, BURSTY_SLO, settings, Load(low, PROMPT_TOKENS, OUTPUT_TOKENS)),
                                peak_pools(config, BURSTY_SLO, settings, Load(high, PROMPT_TOKENS, OUTPUT_TOKENS)),
                                (0.0, answer_s), args.startup_s, end_s)
    return oracle / static_gpu_s


def run_bursty(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    settings = PlannerSettings(startup_s=args.startup_s, interval_s=10.0)
    low, high = 1.0 * args.rate_scale, 24.0 * args.rate_scale
    requests = phased_requests(bursty_phases(low, high, args.phase_s, args.cycles), PROMPT_TOKENS, OUTPUT_TOKENS,
                               args.seed)
    base = base_config(BURSTY_SLO, args.seed)
    prefill, decode = peak_pools(base, BURSTY_SLO, settings, Load(high, PROMPT_TOKENS, OUTPUT_TOKENS))
    print(f"bursty: {low:g} <-> {high:g} req/s every {args.phase_s:g} s, {len(requests)} requests over "
          f"{2 * args.cycles * args.phase_s:g} s; static fleet for {high:g} req/s: {prefill} prefill + {decode} decode",
          flush=True)
    # Each autoscaled pool's ceiling, as an operator who sized for the peak sets max_replicas:
    # twice the larger pool the peak needs (room to drain a backlog).
    ceiling = 2 * max(prefill, decode)
    print(f"  autoscaled pools: 1..{ceiling} replicas each", flush=True)
    fleets = {
        "planner": replace(base, disagg=DisaggOptions(1, 1), planner=SimPlannerOptions(
            BURSTY_SLO, settings, 1, ceiling, prompt_tokens_prior=PROMPT_TOKENS,
            output_tokens_prior=OUTPUT_TOKENS)),
        "queue": replace(base, disagg=DisaggOptions(1, 1), autoscale=AutoscaleOptions(
            1, ceiling, 10.0, args.startup_s, UPSCALE_DELAY_S, DOWNSCALE_DELAY_S)),
        "static": replace(base, disagg=DisaggOptions(prefill, decode)),
    }
    out: dict[str, dict[str, float]] = {}
    for name, config in fleets.items():
        t0 = time.time()
        result = simulate(config, requests)
        s = result.summary()
        out[name] = {"attainment": attainment(result, BURSTY_SLO.ttft_s, BURSTY_SLO.itl_s),
                     "gpu_hours": gpu_seconds(result) / 3600.0, "ttft_p90": s["ttft_s"]["p90"],
                     "itl_p90": s["itl_s"]["p90"], "max_replicas": s["max_live_replicas"]}
        o = out[name]
        print(f"  {name:8s} attainment {o['attainment']:.3f}  GPU-hours {o['gpu_hours']:.2f}  TTFT p90 "
              f"{o['ttft_p90']:.2f} s  ITL p90 {o['itl_p90'] * 1000:.1f} ms  max live replicas "
              f"{o['max_replicas']}  ({time.time() - t0:.0f} s wall)", flush=True)
        cycles = [attainment(result, BURSTY_SLO.ttft_s, BURSTY_SLO.itl_s, 2 * k * args.phase_s,
                             2 * (k + 1) * args.phase_s) for k in range(args.cycles)]
        print(f"    attainment per low+high cycle: {' '.join(f'{a:.3f}' for a in cycles)}", flush=True)
        if name == "static":
            end = max((r.finish_s for r in result.records if r.finish_s is not None), default=0.0)
            o["oracle_vs_static"] = oracle_vs_static(args, base, settings, gpu_seconds(result), end)
            print(f"    a fleet that knows the trace (peak pools from {args.startup_s:g} s before each burst until "
                  f"it ends, its last answer at batch 1): {o['oracle_vs_static']:.3f} of the static fleet's GPU "
                  f"time, the least any planner that meets every burst can use", flush=True)
        if name == "planner" and result.replica_count:
            counts = result.replica_count
            trace = " ".join(f"{t:.0f}:{n}" for t, n in counts[:: max(1, len(counts) // 24)])
            print(f"    live replicas over time (s:count): {trace}", flush=True)
    return out


DAY_PRIORITIES = {"day": 2, "evening": 1, "night": 0}


def run_day(args: argparse.Namespace, gpu_budget: float | None) -> float:
    """The three models as one fleet on one clock (cluster/sim/fleet.py); their planners
    share `gpu_budget` by priority (day > evening > night). Returns the attainment over all."""
    settings = PlannerSettings(startup_s=args.startup_s, interval_s=10.0)
    models = []
    for i, model in enumerate(DAY_RATES):
        slo = replace(DAY_SLO, priority=DAY_PRIORITIES[model])
        config = replace(base_config(DAY_SLO, args.seed), num_replicas=1, planner=SimPlannerOptions(
            slo, settings, 0, MAX_REPLICAS, scale_to_zero=True, prompt_tokens_prior=1000, output_tokens_prior=250,
            model=model))
        models.append((config, day_requests(model, args.hour_s, 1000, 250, args.seed + 1 + i)))
    t0 = time.time()
    results = simulate_fleet(models, gpu_budget)
    good = total = 0.0
    budget = "no GPU budget" if gpu_budget is None else f"a budget of {gpu_budget:g} GPUs"
    print(f"  day, {budget} ({time.time() - t0:.0f} s wall):", flush=True)
    for (config, requests), result in zip(models, results):
        a = attainment(result, DAY_SLO.ttft_s, DAY_SLO.itl_s)
        zero = sum(1 for _, n in result.replica_count if n == 0)
        assert config.planner is not None
        print(f"    {config.planner.model:8s} priority {config.planner.slo.priority}: {len(requests)} requests, "
              f"attainment {a:.3f}, GPU-hours {gpu_seconds(result) / 3600:.2f}, times at zero replicas {zero}, "
              f"max live {result.summary()['max_live_replicas']}", flush=True)
        good += a * len(requests)
        total += len(requests)
    return good / total if total else 0.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=180.0, help="each burst phase's length")
    p.add_argument("--cycles", type=int, default=8, help="low+high cycles")
    p.add_argument("--hour-s", type=float, default=120.0, help="one hour of the compressed day")
    p.add_argument("--startup-s", type=float, default=60.0, help="a replica's start-up time")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="both burst rates times this (a shorter run on a shared machine: below 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-day", action="store_true")
    p.add_argument("--day-budget", type=float, default=2.0, help="GPUs the day's models share in its second run")
    p.add_argument("--serve", action="store_true",
                   help="also the bursty case on a real Serve cluster of simulated devices beside the simulator "
                        "(benchmarks/planner_serve.py: minutes of wall time, a local Ray cluster)")
    p.add_argument("--serve-only", action="store_true", help="only the Serve half")
    args = p.parse_args(argv)
    if args.serve_only:
        serve = run_serve_vs_sim(ServeCase(seed=args.seed), lambda line: print(line, flush=True))
        print(f"RESULT serve_vs_sim_attainment_gap={serve['gap']:.3f}")
        return
    bursty = run_bursty(args)
    multi = float("nan")
    if not args.skip_day:
        multi = run_day(args, None)
        run_day(args, args.day_budget)  # the same day when the budget binds: priorities decide
    planner, queue, static = bursty["planner"], bursty["queue"], bursty["static"]
    gap = "n/a"
    if args.serve:
        gap = f"{run_serve_vs_sim(ServeCase(seed=args.seed), lambda line: print(line, flush=True))['gap']:.3f}"
    else:
        print("serve_vs_sim: not run (--serve runs it)")
    print(f"RESULT planner_slo_attainment={planner['attainment']:.3f} queue_slo_attainment={queue['attainment']:.3f} "
          f"planner_gpu_hours_vs_queue={planner['gpu_hours'] / queue['gpu_hours']:.3f} "
          f"planner_gpu_hours_vs_static={planner['gpu_hours'] / static['gpu_hours']:.3f} "
          f"multi_model_slo_attainment={multi:.3f} serve_vs_sim_attainment_gap={gap}")


if __name__ == "__main__":
    main()
