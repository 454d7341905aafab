"""Routing a LoRA fleet: goodput of each router on the simulator's `lora` workload, the
adapter loads it causes, and the real CPU engine's step overhead with adapters.

    python -m benchmarks.lora [--quick]

Cluster (cluster/sim: the real engine, scheduler, adapter slots and routing policies on a
virtual clock): 8 simulated H200 replicas of llama-3-8b with benchmarks.routing's limits
(benchmarks/routing/setup.py), each with max_loras = 4 device slots and max_cpu_loras = 16
adapters in host memory. Workload: `lora` (cluster/workload/sim_kinds.py): ShareGPT lengths,
Poisson arrivals, 64 rank-16 adapters on all seven projections with Zipf(1) popularity,
after a warm-up of the same traffic. Loads (cluster/sim/lora.py): a cold load reads the
adapter's bytes from storage, a slot load copies them over the H200's host link; the
headroom router's lora_load_s / lora_swap_s are those same figures.

Routers: round robin, least KV, the Gateway API Inference Extension's lora-affinity
(router/routing/policies/lora_affinity.py) and kvserve's headroom. Goodput: each router's
highest rate meeting the SLO (TTFT p99 <= 2 s, ITL p99 <= 100 ms), searched as
benchmarks.routing searches it (benchmarks/routing/search.py), round robin first and the
others from its rate. Adapter loads: every router at one common rate (the lowest goodput
rate found, so every router serves it), slot loads and cold loads per request.
Step overhead: benchmarks/lora_step.py in a process of its own, run beside the simulations
(it measures CPU time).

Last line:
    RESULT lora_goodput_vs_rr=<x> lora_goodput_vs_best=<y> adapter_loads_vs_least_kv=<z> lora_step_overhead_pct=<p>
"""
from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace

from benchmarks.routing.search import RunFigures, Runner, Search, Window, collector_paused
from benchmarks.routing.setup import MIN_REQUESTS, MAX_REQUESTS, RATE_STEP, STATS_PERIOD_S, log, sim_config
from cluster.sim.lora import SimLoRA
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.workload.sim_kinds import make_workload
from worker.config import LoRAConfig

WORKLOAD = "lora"
NUM_REPLICAS = 8
MAX_LORAS = 4
# Host memory holds a quarter of the fleet's adapters (16 x ~84 MB): a replica that sees
# every adapter reads most of them from storage again, one that sees few keeps them.
MAX_CPU_LORAS = 16
BASELINE, HEADROOM = "round_robin", "headroom"
ROUTERS = (BASELINE, "least_kv", "lora_affinity", HEADROOM)
# Round robin's search starts here (requests/s over the 8 replicas): near its capacity on
# this workload, so the flip is a step or two away.
START_RPS = 60.0
SEED = 0


@dataclass(frozen=True)
class LoraPlan:
    window_s: float  # measured arrivals per run
    warmup_s: float  # arrivals before them (cluster/workload/sim_kinds.py _lora)
    bisect_steps: int
    max_steps_out: int

    @property
    def search(self) -> Search:
        return Search(self.bisect_steps, RATE_STEP, self.max_steps_out)


QUICK = LoraPlan(window_s=6.0, warmup_s=3.0, bisect_steps=1, max_steps_out=3)
FULL = LoraPlan(window_s=30.0, warmup_s=10.0, bisect_steps=3, max_steps_out=6)


def lora_sim_config(router: str) -> SimConfig:
    """benchmarks.routing's cluster at 8 replicas, with adapters; the router's load prices
    are the simulated device's own (an operator sets them from the fleet's figures)."""
    base = sim_config(router, NUM_REPLICAS)
    lora = SimLoRA(LoRAConfig(enable=True, max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS))
    device = SimDevice.from_config(base)
    assert device.shape is not None and device.host_to_device_bytes_per_s is not None
    swap_s = lora.swap_s(device.shape, device.host_to_device_bytes_per_s)
    params = replace(base.routing_params(), lora_swap_s=swap_s, lora_load_s=lora.cold_load_s(device.shape) + swap_s)
    options = (("max_loras", MAX_LORAS),) if router == "lora_affinity" else base.policy_options
    return replace(base, lora=lora, policy_params=params, policy_options=options)


def loads_at(config: SimConfig, rate: float, plan: LoraPlan) -> tuple[float, float, dict]:
    """(slot loads, cold loads) per request of one full run at `rate`, and its summary."""
    n = Window(plan.window_s, MIN_REQUESTS, MAX_REQUESTS).num_requests(rate)
    requests = make_workload(WORKLOAD, n, rate, SEED, warmup_s=plan.warmup_s)
    with collector_paused():
        s = simulate(replace(config, seed=SEED), requests).summary()
    return s["lora_slot_loads"] / len(requests), s["lora_cold_loads"] / len(requests), s


def start_step_overhead(quick: bool) -> subprocess.Popen[str]:
    """benchmarks/lora_step.py (the real CPU engine) in a process of its own, beside the
    simulations: it measures the CPU time of its steps, which a neighbour does not inflate."""
    cmd = [sys.executable, "-m", "benchmarks.lora_step", *(["--quick"] if quick else [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def step_overhead_pct(process: subprocess.Popen[str]) -> float:
    """Its lora_step_overhead_pct, once it ends."""
    out, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"benchmarks.lora_step failed:\n{out}")
    for line in out.splitlines():
        log(f"  lora_step: {line}")
    match = re.search(r"RESULT lora_step_overhead_pct=(-?[\d.]+)", out)
    if match is None:
        raise RuntimeError("benchmarks.lora_step printed no RESULT line")
    return float(match.group(1))


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 6 s window, one bisection (about 5 minutes)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    lora_step = start_step_overhead(args.quick)
    cfg = lora_sim_config(HEADROOM)
    params = cfg.routing_params()
    log(f"lora: {NUM_REPLICAS} x {cfg.shape} on {cfg.profile}, 64 adapters (Zipf 1), max_loras {MAX_LORAS}, "
        f"max_cpu_loras {MAX_CPU_LORAS}; cold load {1e3 * (params.lora_load_s - params.lora_swap_s):.1f} ms, "
        f"slot load {1e3 * params.lora_swap_s:.2f} ms; window {plan.window_s:g} s after {plan.warmup_s:g} s warm-up; "
        f"SLO TTFT p99 <= {cfg.slo_ttft_ms:g} ms, ITL p99 <= {cfg.slo_itl_ms:g} ms; stats period {STATS_PERIOD_S:g} s")
    runner = Runner(WORKLOAD, SEED, Window(plan.window_s, MIN_REQUESTS, MAX_REQUESTS), {"warmup_s": plan.warmup_s}, log)
    found: dict[str, RunFigures] = {}
    start, known_miss = START_RPS, None
    for router in ROUTERS:
        fig = runner.goodput(lora_sim_config(router), start, plan.search, known_miss)
        found[router] = fig
        if router == BASELINE and fig.rate_rps:
            start, known_miss = fig.rate_rps, fig.bracket_top
        log(f"GOODPUT {router:14s} {'>=' if fig.lower_bound else '  '}{fig.goodput_rps:7.2f} req/s at rate "
            f"{fig.rate_rps:7.2f} (next miss {fig.next_miss_rps:7.2f}), TTFT p99 {fig.ttft_p99_s:.3f} s")
    common = min(f.rate_rps for f in found.values() if f.rate_rps > 0)
    loads: dict[str, tuple[float, float]] = {}
    for router in ROUTERS:
        slot, cold, s = loads_at(lora_sim_config(router), common, plan)
        loads[router] = (slot, cold)
        log(f"LOADS   {router:14s} at {common:7.2f} req/s: {slot:.3f} slot loads/request, {cold:.3f} cold "
            f"loads/request; TTFT p50 {s['ttft_s']['p50']:.3f} s p99 {s['ttft_s']['p99']:.3f} s, "
            f"imbalance {s['load_imbalance']:.2f}")
    overhead = step_overhead_pct(lora_step)
    head = found[HEADROOM].goodput_rps
    best = max(f.goodput_rps for r, f in found.items() if r != HEADROOM)
    # Goodput counts a run's requests within the SLO over its whole duration, the longest
    # answer's tail included; the highest rate meeting the SLO is the steadier figure beside it.
    best_rate = max(f.rate_rps for r, f in found.items() if r != HEADROOM)
    log(f"rates meeting the SLO: headroom / round robin {ratio(found[HEADROOM].rate_rps, found[BASELINE].rate_rps):.3f}, "
        f"headroom / best baseline {ratio(found[HEADROOM].rate_rps, best_rate):.3f}")
    log(f"done in {time.perf_counter() - t0:.0f} s ({runner.num_runs} search runs)")
    log(f"RESULT lora_goodput_vs_rr={ratio(head, found[BASELINE].goodput_rps):.3f} "
        f"lora_goodput_vs_best={ratio(head, best):.3f} "
        f"adapter_loads_vs_least_kv={ratio(loads[HEADROOM][0], loads['least_kv'][0]):.3f} "
        f"lora_step_overhead_pct={overhead:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
