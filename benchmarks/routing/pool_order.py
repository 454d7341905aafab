"""What the order of a KV pool's free blocks does to the CPU engine's decode steps.

    python -m benchmarks.routing.pool_order [--rounds 4]

A fresh block pool hands out blocks in id order, so a sequence's KV sits in consecutive
blocks; a pool that has served a while hands them out in no order (requests end in any
order and free their blocks as they end). The CPU backend gathers each decode's paged KV
block by block, and reads consecutive blocks faster; so a calibration timed on fresh pools
would underprice a live engine's decodes, and validation 1 runs both its calibration and
its real engine on aged pools (cluster/calibrate.py's `age_pool`).

Per round, each of validation 1's decode plans (the grid's batches x contexts) runs twice
on its clock and thread count, on a fresh pool and on an aged one, in alternating order;
a plan's time is the mean of its steps past the warm-up (as the calibration times them).
Prints per plan the median ratio aged / fresh over the rounds, then
RESULT aged_over_fresh=<median over plans> aged_over_fresh_long=<median over plans whose
context is the grid's longest two>.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.routing.engine_grid import ENGINE_CLOCK, ENGINE_NUM_THREADS, workload_grid
from benchmarks.routing.validate import ENGINE_REQUESTS, ENGINE_WORKLOAD
from cluster.calibrate import start_measurement
from cluster.workload.sim_kinds import make_workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    kw = {k: v for k, v in ENGINE_WORKLOAD.items() if k != "kind"}
    spec = workload_grid(make_workload(ENGINE_WORKLOAD["kind"], ENGINE_REQUESTS[True], 1.0, 7, **kw), 512)
    grid = start_measurement(None, ENGINE_NUM_THREADS, 16, ENGINE_CLOCK, spec).grid  # the loaded runner, no plans run
    plans = [(b, c) for b in spec.decode_batches for c in spec.decode_contexts]
    print(f"validation 1's decode plans (batches {spec.decode_batches} x contexts {spec.decode_contexts}), "
          f"{args.rounds} rounds, {ENGINE_CLOCK} clock, {ENGINE_NUM_THREADS} thread", flush=True)
    ratios: dict[tuple[int, int], list[float]] = {plan: [] for plan in plans}
    for r in range(args.rounds):
        for b, c in plans:
            first_aged = (r + b + c) % 2 == 0  # sides alternate
            times = {aged: 0.0 for aged in (first_aged, not first_aged)}
            for aged in times:
                times[aged] = grid.decode(b, c, aged=aged).seconds
            ratios[(b, c)].append(times[True] / times[False])
            print(f"  round {r + 1}: decode b={b} ctx={c}: fresh {1e3 * times[False]:.2f} ms, aged "
                  f"{1e3 * times[True]:.2f} ms, ratio {times[True] / times[False]:.3f}", flush=True)
    medians = {plan: statistics.median(v) for plan, v in ratios.items()}
    for (b, c), m in medians.items():
        print(f"decode b={b} ctx={c}: aged / fresh median {m:.3f} (rounds: "
              f"{', '.join(f'{x:.2f}' for x in ratios[(b, c)])})")
    long = sorted(spec.decode_contexts)[-2:]
    print(f"RESULT aged_over_fresh={statistics.median(medians.values()):.3f} "
          f"aged_over_fresh_long={statistics.median(m for (b, c), m in medians.items() if c in long):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
