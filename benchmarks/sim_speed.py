"""How fast the discrete-event simulator runs: wall time, events/s and simulated output
tokens per wall second for one simulation (the engine's real scheduler and KV manager
step every replica; their Python is most of the time). Optionally profiles with cProfile.

    python -m benchmarks.sim_speed --requests 100000 --replicas 128 --rate 2500
    python -m benchmarks.sim_speed --requests 3000 --replicas 16 --rate 150 --profile 25

Prints the machine's load average before and after (this box is shared: a loaded run is
slower in wall time; `cpu_s`, the process's own CPU time, is what the simulation costs)
and, last, a RESULT line.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import resource
import time

from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig
from cluster.workload.sim_kinds import WORKLOAD_NAMES, make_workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--replicas", type=int, default=128)
    p.add_argument("--rate", type=float, default=2500.0)
    p.add_argument("--workload", default="sharegpt", choices=WORKLOAD_NAMES)
    p.add_argument("--router", default="round_robin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile: print the top N functions")
    args = p.parse_args(argv)

    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average before {os.getloadavg()}")
    t0 = time.perf_counter()
    requests = make_workload(args.workload, args.requests, args.rate, args.seed)
    workload_s = time.perf_counter() - t0
    config = SimConfig(num_replicas=args.replicas, router=args.router, seed=args.seed)
    profiler = cProfile.Profile() if args.profile else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    result = simulate(config, requests)
    if profiler:
        profiler.disable()
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    s = result.summary()
    num_steps = sum(r.num_steps for r in result.replicas)
    print(f"load average after {os.getloadavg()}")
    print(f"workload built in {workload_s:.1f} s; simulated {s['duration_s']:.1f} s of {args.replicas} replicas: "
          f"{s['num_finished']} requests, {s['output_tokens']} output tokens, {num_steps} engine steps, "
          f"{s['num_events']} events; TTFT p50 {s['ttft_s']['p50'] * 1000:.1f} ms p99 {s['ttft_s']['p99'] * 1000:.1f} ms, "
          f"ITL p50 {s['itl_s']['p50'] * 1000:.2f} ms, {s['output_tokens_per_s']:.0f} tok/s simulated")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RESULT requests={args.requests} replicas={args.replicas} workload={args.workload} router={args.router} "
          f"wall_s={wall_s:.1f} cpu_s={cpu_s:.1f} events_per_s={s['num_events'] / wall_s:.0f} "
          f"steps_per_cpu_s={num_steps / cpu_s:.0f} output_tokens_per_cpu_s={s['output_tokens'] / cpu_s:.0f} "
          f"output_tokens_per_wall_s={s['output_tokens'] / wall_s:.0f} sim_s={s['duration_s']:.1f} "
          f"max_rss_mb={max_rss_mb:.0f} profiled={int(bool(profiler))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
