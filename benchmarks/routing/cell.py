"""One cell of benchmarks.routing's --quick table: every router's SLO rate search on one
workload (4 replicas, seed 0, the quick plan's arrival window and x1.5 rate ladder from
round robin's rate), without the table's 80%-rate runs, the multi-ingress rows or the
validations. For iterating on a routing policy against the baselines on the same seeded
workload (the simulator is deterministic: the same seed gives the same requests).

    python -m benchmarks.routing.cell WORKLOAD [ROUTER,ROUTER,...] [START_RATE]

Round robin comes first (the others start from its rate, as in the table). Prints one
`CELL` line per router, then `RESULT headroom_vs_best=... headroom_vs_rr=...`.
"""
from __future__ import annotations

import math
import sys
import time

from benchmarks.routing.search import RunFigures, Runner
from benchmarks.routing.setup import (
    BASELINE,
    HEADROOM,
    QUICK,
    ROUTERS,
    START_RPS_PER_REPLICA,
    TRACE,
    log,
    sim_config,
    slo_attainment,
    workload_kw,
)

NUM_REPLICAS = 4
SEED = 0


def main(argv: list[str]) -> int:
    workload = argv[0]
    routers = argv[1].split(",") if len(argv) > 1 else list(ROUTERS)
    start = float(argv[2]) if len(argv) > 2 else START_RPS_PER_REPLICA[workload] * NUM_REPLICAS
    wkw = workload_kw(TRACE, NUM_REPLICAS) if workload == TRACE else {}
    runner = Runner(workload, SEED, QUICK.window_for(workload), wkw, log, slo_attainment(workload))
    t0 = time.perf_counter()
    found: dict[str, RunFigures] = {}
    for router in routers:
        config = sim_config(router, NUM_REPLICAS)
        fig = runner.goodput(config, start, QUICK.search)
        if router == BASELINE and fig.rate_rps:
            start = fig.rate_rps
        found[router] = fig
        log(f"CELL {workload:9s} {router:16s} goodput {'>=' if fig.lower_bound else '  '}{fig.goodput_rps:7.2f} "
            f"rate {fig.rate_rps:8.2f} ttft99 {fig.ttft_p99_s:.3f} hit {fig.hit_rate:.3f}")
    log(f"CELL {workload} done in {time.perf_counter() - t0:.0f} s")
    if HEADROOM in found:
        head = found[HEADROOM].goodput_rps
        others = [f.goodput_rps for r, f in found.items() if r != HEADROOM]
        best = max(others, default=math.nan)
        rr = found[BASELINE].goodput_rps if BASELINE in found else math.nan
        log(f"RESULT headroom_vs_best={head / best if best > 0 else math.nan:.3f} "
            f"headroom_vs_rr={head / rr if rr > 0 else math.nan:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
