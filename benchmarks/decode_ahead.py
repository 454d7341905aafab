"""Decode plans made under the device (worker/decode_ahead.py) against plans made after
each step's tokens are back: the engine alone at time dilation 1, as benchmarks/hostpath.py
measures it (sim:h200, llama-3-8b, max_num_seqs 256), the two sides in turns.

    python -m benchmarks.decode_ahead [--repeats N]

Per batch (b64: 64 x 256 tokens, b256: 256 x 128), each side's median exposed engine host
time (engine-thread CPU while no step is on the device, over the modelled step time) and
delivered / modelled token rate. Last line:
    RESULT host_pct_b256=<p> host_pct_b256_without=<p> host_pct_b64=<p> host_pct_b64_without=<p>
           delivered_ratio_b256=<x> delivered_ratio_b256_without=<x> delivered_ratio_b64=<x>
           delivered_ratio_b64_without=<x>
"""
from __future__ import annotations

import argparse
import os
import statistics

from benchmarks import hostpath
from benchmarks.hostpath import EngineRun, measure_engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per side and batch")
    args = p.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, load average before {os.getloadavg()}", flush=True)
    result: dict[str, float] = {}
    for num_requests, max_tokens in hostpath.BATCHES:
        runs: dict[bool, list[EngineRun]] = {True: [], False: []}
        for repeat in range(args.repeats):
            for ahead in ((True, False) if repeat % 2 == 0 else (False, True)):
                run = measure_engine(num_requests, max_tokens, plan_ahead=ahead)
                runs[ahead].append(run)
                print(f"  b{num_requests} {'ahead  ' if ahead else 'without'} {repeat + 1}/{args.repeats}: "
                      f"exposed {1e6 * run.exposed_host_cpu_s / run.num_steps:.0f} us/step = {run.host_pct:.2f}% "
                      f"of the modelled step; delivered ratio {run.delivered_ratio:.3f}", flush=True)
        for ahead, suffix in ((True, ""), (False, "_without")):
            host = statistics.median(r.host_pct for r in runs[ahead])
            ratio = statistics.median(r.delivered_ratio for r in runs[ahead])
            result[f"host_pct_b{num_requests}{suffix}"] = host
            result[f"delivered_ratio_b{num_requests}{suffix}"] = ratio
        print(f"b{num_requests} medians: exposed host {result[f'host_pct_b{num_requests}']:.2f}% with plans ahead, "
              f"{result[f'host_pct_b{num_requests}_without']:.2f}% without; delivered ratio "
              f"{result[f'delivered_ratio_b{num_requests}']:.3f} / {result[f'delivered_ratio_b{num_requests}_without']:.3f}",
              flush=True)
    print(f"load average after {os.getloadavg()}")
    keys = ("host_pct_b256", "host_pct_b256_without", "host_pct_b64", "host_pct_b64_without",
            "delivered_ratio_b256", "delivered_ratio_b256_without", "delivered_ratio_b64", "delivered_ratio_b64_without")
    print("RESULT " + " ".join(f"{k}={result[k]:.3f}" if "ratio" in k else f"{k}={result[k]:.2f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
