"""Request-by-request comparison of routers on a slice of a Mooncake-style trace: each
router replays the same requests on the router table's cluster (benchmarks/routing/setup.py)
at a fixed arrival speed; per router the issue's figures (within SLO, TTFT p50/p90/p99,
prefix hit, imbalance), then for headroom against the reference router: how often they
pick a replica holding the prompt's longest cached prefix, headroom's modes, and where
headroom's late requests came from (its mode, prompt length, queueing before the first token).

    python -m benchmarks.routing.trace_probe TRACE.jsonl [--requests 1500] [--replicas 6]
        [--speed 2] [--routers prefix_affinity,headroom,...]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from dataclasses import replace

from benchmarks.routing.search import collector_paused
from benchmarks.routing.setup import HEADROOM, log, sim_config
from cluster.percentile import percentile
from cluster.sim.run import simulate
from cluster.sim.setup import SimDevice
from cluster.workload.sim_kinds import make_workload
from router.routing.policies.headroom import HeadroomPolicy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing.trace_probe")
    p.add_argument("trace")
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--replicas", type=int, default=6)
    p.add_argument("--speed", type=float, default=2.0, help="arrivals this many times faster than recorded")
    p.add_argument("--routers", default="prefix_affinity,headroom")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    requests = make_workload("trace", args.requests, 0.0, args.seed, path=args.trace, time_scale=1.0 / args.speed)
    log(f"trace {args.trace}: {len(requests)} requests over {requests[-1].arrival_s:.0f} s, "
        f"{args.replicas} replicas, speed x{args.speed:g}")
    modes: dict[str, str] = {}
    original = HeadroomPolicy.rank

    def rank(self: HeadroomPolicy, request, views, now):  # type: ignore[no-untyped-def]
        order = original(self, request, views, now)
        modes[request.request_id] = self.last_mode
        return order

    HeadroomPolicy.rank = rank  # type: ignore[method-assign]
    device = None
    for router in args.routers.split(","):
        config = replace(sim_config(router, args.replicas), seed=args.seed)
        device = device or SimDevice.from_config(config)
        t0 = time.perf_counter()
        with collector_paused():
            result = simulate(config, requests, device)
        s = result.summary()
        ttft = [r.ttft_s for r in result.ok_records()]
        p50, p90, p99 = (percentile(ttft, q, method="strict_rank") for q in (50, 90, 99))
        log(f"{router:16s} within SLO {s['goodput_fraction']:6.1%} goodput {s['goodput_rps']:5.2f} "
            f"TTFT p50/p90/p99 {p50:.2f}/{p90:.2f}/{p99:.2f} s "
            f"ITL p99 {1000 * s['itl_s']['p99']:.0f} ms hit {s['prefix_cache_hit_rate']:.1%} "
            f"imbalance {s['load_imbalance']:.2f} ({time.perf_counter() - t0:.0f} s)")
        if router != HEADROOM:
            continue
        late = [r for r in result.ok_records() if r.ttft_s > config.slo_ttft_ms / 1000]
        log(f"  modes: {dict(Counter(modes.get(r.request_id, '?') for r in result.records))}")
        log(f"  late (TTFT > SLO): {len(late)}; by mode {dict(Counter(modes.get(r.request_id, '?') for r in late))}")
        if late:
            log(f"  late prompt tokens median {statistics.median(r.num_prompt_tokens for r in late):.0f}, "
                f"queued before dispatch median {statistics.median(r.dispatch_s - r.arrival_s for r in late):.2f} s")
        per = Counter(r.replica_keys[-1] for r in result.records if r.replica_keys)
        log(f"  requests per replica: {sorted(per.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
