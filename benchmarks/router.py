"""kvserve's router (KV headroom + admission control) vs Ray Serve's default power-of-two
choices, on a REAL Serve cluster of simulated-device replicas, near saturation.

    python -m benchmarks.router [--repeats 3] [--num-requests 160] [--load 1.0] ...

The cluster (cluster/app.py's build_app, as `kvserve serve` deploys it): the HTTP proxy, 2
ingress replicas (each with its own request router and admission control), 8 worker
replicas with engine.device sim:h200 (the real scheduler, KV manager and prefix cache; the
llama-3-8b shape's step times from the H200 cost model, slept x the time dilation, so that
8 "GPUs" fit on a 2-core box). Only `routing.router` differs between the two sides:
headroom, or pow2 (Serve's default algorithm, through kvserve's PolicyRouter; kvserve's admission control then never holds a
request: it has no headroom view to judge with).

Workload: b2b (cluster/workload/sim_kinds.py: G customer groups, each request = its group's
long shared prefix + a question), Poisson arrivals, sent as token ids over HTTP streaming
(cluster/bench's client) at the arrival times x dilation. Each worker's KV pool is set to
--num-blocks, small enough that not every replica can keep every group's prefix cached:
the regime where prefix reuse meets KV pressure, which is what headroom routing is for.
The rate is --load (default 1.6) x the cluster's capacity under pow2 as the discrete-event
simulator models it (the same engine code, cluster/sim/: every request arriving at once),
printed with the simulator's own forecast for both routers at that rate. The default was
chosen with that forecast: pow2 queues there (TTFT p99 0.3-0.5 s, inside the 2 s SLO), so
routing decides the tail; at --load 1.0 neither side queues and every request meets the
SLO on both, so goodput is just the offered rate.

Both sides are deployed once, side by side (separate replicas), each warmed with one short
request per replica; repeat i then replays the workload with seed + i (new group prefixes:
what earlier repeats cached never helps), on both sides. Sides alternate (headroom first in the 1st and 3rd
repeats, pow2 first in the 2nd) so that drift of the shared box's load favours neither.

Figures (modelled time: real seconds / dilation): TTFT p99 (a failed or shed request
counts as an infinite TTFT), goodput = requests finished within the SLO (TTFT <= 2 s and
TPOT <= 100 ms, DistServe's per-request attainment, as the simulator's goodput) per second
of the run (first arrival to last finish). Printed per run, then median and spread (min-max)
per router, and last:

    RESULT ttft_p99_ratio=<pow2/headroom, median over repeats> goodput_ratio=<headroom/pow2, median> runs=<n>

Numbers from a shared 2-core box are noisy (the dispatch path is real and not dilated);
this is a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

from benchmarks import serve_cluster
from benchmarks.open_loop import replay
from cluster.percentile import percentile

ROUTERS = ("headroom", "pow2")
SIM_POLICY = {"headroom": "headroom", "pow2": "pow2"}  # the same code in the simulator
APP_NAME = "bench-router"
MODEL = "sim"


@dataclass(frozen=True)
class BenchSpec:
    num_requests: int = 160
    # Offered rate / the cluster's modelled burst capacity under pow2. 1.6 is still inside
    # pow2's TTFT SLO (its p99 stays < 0.5 s) but builds a queue there: near saturation.
    # At 1.0 both sides idle along (benchmarks/results/router-2026-12-01-0816.txt).
    load: float = 1.6
    rate: float = 0.0  # modelled requests/s; 0: load x capacity
    seed: int = 0
    num_groups: int = 16
    prefix_len: int = 2048
    question_len: int = 128
    output_len: int = 32
    num_replicas: int = 8
    num_ingress: int = 2
    num_blocks: int = 1024  # KV blocks per replica (16 tokens each): ~8 prefixes of 2048
    time_dilation: float = 50.0
    stats_period_s: float = 1.0  # real seconds (Serve's report period)
    slo_ttft_ms: float = 2000.0  # modelled
    slo_itl_ms: float = 100.0
    repeats: int = 3

    def workload_kw(self) -> dict[str, int]:
        return {"num_groups": self.num_groups, "prefix_len": self.prefix_len,
                "question_len": self.question_len, "output_len": self.output_len}


@dataclass
class RunResult:
    router: str
    dilation: float
    ttft_s: list[float] = field(default_factory=list)  # modelled; inf for failed requests
    num_good: int = 0
    num_failed: int = 0
    num_shed: int = 0  # 429s (admission control or Serve's back pressure)
    num_output_tokens: int = 0
    duration_s: float = 0.0  # modelled: first arrival to last finish
    cached_tokens: int = 0

    @property
    def goodput_rps(self) -> float:
        return self.num_good / self.duration_s if self.duration_s > 0 else 0.0

    def ttft_p99_s(self) -> float:
        return percentile(self.ttft_s, 99, method="nearest_rank")


def run_order(repeat: int) -> tuple[str, ...]:
    """headroom first in even repeats (0-based), pow2 first in odd ones."""
    return ROUTERS if repeat % 2 == 0 else ROUTERS[::-1]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the finite values; nan for none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    return statistics.median(finite), min(finite), max(finite)


def pair_ratios(headroom: RunResult, pow2: RunResult) -> tuple[float, float]:
    """(TTFT p99 pow2/headroom, goodput headroom/pow2) of one repeat: > 1 favours headroom."""
    h, p = headroom.ttft_p99_s(), pow2.ttft_p99_s()
    ttft = p / h if h > 0 and math.isfinite(h) else math.nan
    good = headroom.goodput_rps / pow2.goodput_rps if pow2.goodput_rps > 0 else math.nan
    return ttft, good


def result_line(runs: list[dict[str, RunResult]]) -> str:
    ratios = [pair_ratios(r["headroom"], r["pow2"]) for r in runs]
    ttft = spread([t for t, _ in ratios])[0]
    good = spread([g for _, g in ratios])[0]
    return f"RESULT ttft_p99_ratio={ttft:.3f} goodput_ratio={good:.3f} runs={len(runs)}"


def score(router: str, results: list[Any], arrivals_s: list[float], spec: BenchSpec) -> RunResult:
    """Modelled figures of one run from cluster/bench RequestResults (real seconds)."""
    d = spec.time_dilation
    run = RunResult(router, d)
    finishes = []
    for r in results:
        if not r.success or r.ttft_s is None:
            run.num_failed += 1
            run.num_shed += int(r.status == 429)
            run.ttft_s.append(math.inf)
            continue
        ttft, tpot = r.ttft_s / d, (r.tpot_s or 0.0) / d
        run.ttft_s.append(ttft)
        run.num_output_tokens += r.output_tokens
        run.cached_tokens += r.cached_tokens or 0
        run.num_good += int(ttft <= spec.slo_ttft_ms / 1000 and tpot <= spec.slo_itl_ms / 1000)
        finishes.append(r.start_s + (r.e2e_s or 0.0))
    if finishes:
        run.duration_s = (max(finishes) - min(arrivals_s)) / d
    return run


# -- the simulator's view: capacity and forecast ------------------------------------------------
def sim_config(spec: BenchSpec, router: str) -> Any:
    from cluster.sim.setup import SimConfig

    d = spec.time_dilation
    return SimConfig(shape="llama-3-8b", profile="h200", num_replicas=spec.num_replicas, router=SIM_POLICY[router],
                     num_ingress=spec.num_ingress, shared_view=False, num_blocks=spec.num_blocks,
                     stats_period_s=spec.stats_period_s / d, report_lag_s=0.1 / d, max_model_len=4096,
                     slo_ttft_ms=spec.slo_ttft_ms, slo_itl_ms=spec.slo_itl_ms, seed=spec.seed)


def modelled_capacity_rps(spec: BenchSpec) -> float:
    """Requests/s the cluster completes under pow2 with every request waiting at once."""
    from cluster.sim.run import simulate
    from cluster.workload.sim_kinds import make_workload

    burst = make_workload("b2b", spec.num_requests, spec.num_requests / 1e-3, spec.seed, **spec.workload_kw())
    return spec.num_requests / simulate(sim_config(spec, "pow2"), burst).summary()["duration_s"]


# -- the real cluster ----------------------------------------------------------------------------
def app_config(spec: BenchSpec, router: str, app_name: str) -> Any:
    from cluster.config import KVServeConfig

    return KVServeConfig.from_dict({
        "app_name": app_name, "route_prefix": f"/{app_name}",
        "model": {"served_model_name": MODEL},
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "time_dilation": spec.time_dilation,
                   "max_model_len": 4096, "num_blocks": spec.num_blocks},
        "workers": {"num_replicas": spec.num_replicas, "num_cpus": 0.1},
        "ingress": {"num_replicas": spec.num_ingress, "num_cpus": 0.5, "api_keys_env": None},
        "routing": {"router": router, "stats_period_s": spec.stats_period_s},
    })


async def drive(url: str, requests: list[Any], dilation: float) -> tuple[list[Any], list[float]]:
    """Send each request at its arrival time x dilation; (results, send times in real s)."""
    results = await replay(url, MODEL, requests, dilation, 3600.0)
    return results, [r.start_s for r in results]


def deploy(spec: BenchSpec, router: str) -> str:
    """The app for one side (both run side by side, on separate replicas); its name."""
    from ray import serve

    from cluster.app import build_app

    app_name = f"{APP_NAME}-{router.replace('_', '-')}"
    serve.run(build_app(app_config(spec, router, app_name)), name=app_name, route_prefix=f"/{app_name}")
    return app_name


def warm_up(spec: BenchSpec, url: str) -> None:
    """One short request per replica and ingress (distinct prompts: no prefix to share),
    then two report periods, so that every router starts with fresh stats."""
    from cluster.workload.sim_kinds import make_workload

    warm = make_workload("sharegpt", spec.num_replicas * spec.num_ingress, 1.0, 999, input_mean=16.0, output_mean=2.0)
    asyncio.run(drive(url, [replace(r, arrival_s=0.0) for r in warm], 1.0))
    time.sleep(2 * spec.stats_period_s)  # a benchmark's settling time, not synchronisation


def repeat_workload(spec: BenchSpec, rate: float, repeat: int) -> list[Any]:
    """Repeat i replays seed + i: new group prefixes, so that what the replicas cached in
    earlier repeats never helps (both sides of a repeat get the same requests)."""
    from cluster.workload.sim_kinds import make_workload

    return make_workload("b2b", spec.num_requests, rate, spec.seed + repeat, **spec.workload_kw())


def run_one(spec: BenchSpec, router: str, requests: list[Any], url: str) -> RunResult:
    results, sent = asyncio.run(drive(url, requests, spec.time_dilation))
    return score(router, results, sent, spec)


def report(runs: list[dict[str, RunResult]]) -> list[str]:
    header = (f"{'repeat':>6} {'router':<12} {'ttft_p50_ms':>11} {'ttft_p99_ms':>11} {'goodput_rps':>11} "
              f"{'good':>5} {'failed':>6} {'shed':>5} {'out_tok/s':>9} {'cached_tok':>10}")
    lines = [header]
    for repeat, pair in enumerate(runs):
        for router in run_order(repeat):  # in the order they ran
            r = pair[router]
            tput = r.num_output_tokens / r.duration_s if r.duration_s > 0 else 0.0
            p50_ms = 1000 * percentile(r.ttft_s, 50, method="nearest_rank")
            lines.append(f"{repeat + 1:>6} {router:<12} {p50_ms:>11.1f} "
                         f"{1000 * r.ttft_p99_s():>11.1f} {r.goodput_rps:>11.2f} {r.num_good:>5} {r.num_failed:>6} "
                         f"{r.num_shed:>5} {tput:>9.0f} {r.cached_tokens:>10}")
    for router in ROUTERS:
        p99 = spread([1000 * pair[router].ttft_p99_s() for pair in runs])
        good = spread([pair[router].goodput_rps for pair in runs])
        lines.append(f"{router}: over {len(runs)} runs, median (min-max): TTFT p99 {p99[0]:.1f} ({p99[1]:.1f}-{p99[2]:.1f}) ms, "
                     f"goodput {good[0]:.2f} ({good[1]:.2f}-{good[2]:.2f}) req/s (modelled time)")
    for repeat, pair in enumerate(runs):
        ttft, good = pair_ratios(pair["headroom"], pair["pow2"])
        lines.append(f"repeat {repeat + 1}: ttft_p99_ratio={ttft:.3f} goodput_ratio={good:.3f}")
    lines.append(result_line(runs))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = BenchSpec()
    for f in fields(BenchSpec):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name))
    args = p.parse_args(argv)
    spec = BenchSpec(**{f.name: getattr(args, f.name) for f in fields(BenchSpec)})

    from cluster.sim.run import simulate

    t0 = time.perf_counter()
    capacity = modelled_capacity_rps(spec)
    rate = spec.rate or spec.load * capacity
    print(f"workload: b2b {spec.workload_kw()}, {spec.num_requests} requests per run, Poisson {rate:.1f} req/s modelled "
          f"({rate / spec.time_dilation:.2f} req/s real) = {rate / capacity:.2f} x the modelled capacity under pow2 "
          f"({capacity:.1f} req/s), seeds {spec.seed}..{spec.seed + spec.repeats - 1} (one per repeat); "
          f"{spec.num_replicas} sim:h200 replicas (llama-3-8b) x {spec.num_blocks} KV blocks, {spec.num_ingress} ingress "
          f"replicas, time dilation {spec.time_dilation:g}, stats period {spec.stats_period_s} s real; "
          f"SLO TTFT {spec.slo_ttft_ms:g} ms, TPOT {spec.slo_itl_ms:g} ms (modelled)")
    for repeat in range(spec.repeats):
        requests = repeat_workload(spec, rate, repeat)
        forecast = []
        for router in ROUTERS:
            s = simulate(sim_config(spec, router), requests).summary()
            forecast.append(f"{router} TTFT p99 {1000 * s['ttft_s']['p99']:.1f} ms, goodput {s['goodput_rps']:.2f} req/s")
        print(f"simulator forecast, seed {spec.seed + repeat} ({spec.num_ingress} private-view routers): {'; '.join(forecast)}")
    print(f"(capacity and forecasts: {time.perf_counter() - t0:.0f} s); load average {os.getloadavg()[0]:.1f}", flush=True)

    port = serve_cluster.start()
    runs: list[dict[str, RunResult]] = []
    try:
        t = time.perf_counter()
        urls = {}
        for router in ROUTERS:
            urls[router] = f"http://127.0.0.1:{port}/{deploy(spec, router)}/v1/completions"
            warm_up(spec, urls[router])
        print(f"both apps up and warm in {time.perf_counter() - t:.0f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
        for repeat in range(spec.repeats):
            requests = repeat_workload(spec, rate, repeat)
            pair: dict[str, RunResult] = {}
            for router in run_order(repeat):
                t = time.perf_counter()
                pair[router] = r = run_one(spec, router, requests, urls[router])
                print(f"repeat {repeat + 1}/{spec.repeats} {router}: TTFT p99 {1000 * r.ttft_p99_s():.1f} ms, goodput "
                      f"{r.goodput_rps:.2f} req/s, {r.num_failed} failed ({r.num_shed} shed); {time.perf_counter() - t:.0f} s "
                      f"real, load average {os.getloadavg()[0]:.1f}", flush=True)
            runs.append(pair)
    finally:
        serve_cluster.stop()
    for line in report(runs):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
