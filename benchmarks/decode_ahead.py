"""The engine's host work under the device, three ways: steps launched before the previous
step's tokens are back (worker/scheduling/async_scheduler.py, the default), decode plans made under the
device but launched after the tokens (worker/scheduling/async_scheduler.py alone), and neither (every
plan made and launched after the tokens). The engine alone at time dilation 1, as
benchmarks/hostpath.py measures it (sim:h200, llama-3-8b, max_num_seqs 256), the sides in
turns, the order rotating per repeat.

    python -m benchmarks.decode_ahead [--repeats N]

Per batch (b64: 64 x 256 tokens, b256: 256 x 128), each side's median exposed engine host
time (engine-thread CPU while no step is on the device, over the modelled step time;
benchmarks/hostpath.py says how a step launched ahead is counted) and delivered / modelled
token rate. Last line:
    RESULT host_pct_b256=<p> host_pct_b256_plan_only=<p> host_pct_b256_without=<p>
           host_pct_b64=<p> ... delivered_ratio_b256=<x> delivered_ratio_b256_plan_only=<x>
           delivered_ratio_b256_without=<x> delivered_ratio_b64=<x> ...
(no suffix: launched ahead; _plan_only: planned ahead, launched after the tokens;
_without: neither.)
"""
from __future__ import annotations

import argparse
import os
import statistics

from benchmarks import hostpath
from benchmarks.hostpath import EngineRun, measure_engine

# side -> (plan_ahead, launch_ahead), and its RESULT suffix
SIDES = {"launch ahead": ((True, True), ""), "plan ahead": ((True, False), "_plan_only"),
         "neither": ((False, False), "_without")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per side and batch")
    args = p.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, load average before {os.getloadavg()}", flush=True)
    result: dict[str, float] = {}
    names = list(SIDES)
    for num_requests, max_tokens in hostpath.BATCHES:
        runs: dict[str, list[EngineRun]] = {name: [] for name in names}
        for repeat in range(args.repeats):
            k = repeat % len(names)
            for name in names[k:] + names[:k]:
                (plan_ahead, launch_ahead), _ = SIDES[name]
                run = measure_engine(num_requests, max_tokens, plan_ahead=plan_ahead, launch_ahead=launch_ahead)
                runs[name].append(run)
                print(f"  b{num_requests} {name:<12} {repeat + 1}/{args.repeats}: "
                      f"exposed {1e6 * run.exposed_host_cpu_s / run.num_steps:.0f} us/step = {run.host_pct:.2f}% "
                      f"of the modelled step; delivered ratio {run.delivered_ratio:.3f}", flush=True)
        summary = []
        for name in names:
            suffix = SIDES[name][1]
            host = statistics.median(r.host_pct for r in runs[name])
            ratio = statistics.median(r.delivered_ratio for r in runs[name])
            result[f"host_pct_b{num_requests}{suffix}"] = host
            result[f"delivered_ratio_b{num_requests}{suffix}"] = ratio
            summary.append(f"{name}: exposed host {host:.2f}%, delivered ratio {ratio:.3f}")
        print(f"b{num_requests} medians: " + "; ".join(summary), flush=True)
    print(f"load average after {os.getloadavg()}")
    keys = [f"{what}_b{n}{SIDES[name][1]}" for what in ("host_pct", "delivered_ratio")
            for n, _ in (hostpath.BATCHES[1], hostpath.BATCHES[0]) for name in names]
    print("RESULT " + " ".join(f"{k}={result[k]:.3f}" if "ratio" in k else f"{k}={result[k]:.2f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
