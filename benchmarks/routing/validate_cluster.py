"""Validation 2 of benchmarks.routing: a real Ray Serve cluster of 8 simulated-device
replicas (engine.device sim:h200, llama-3-8b shape, time dilation D), the real ingress and
the KV-headroom router, driven over HTTP at the workload's arrival times x D (cluster/bench's
streaming client; prompts sent as token ids so both sides see the same tokens), against
`simulate` with the same config, its stats period and report lag divided by D. Real times
are divided by D (tokens/s multiplied) before comparing. The HTTP proxy -> ingress -> Serve
dispatch path is not dilated, so it is MEASURED under load, on the same cluster, in a
calibration run of another seed (per request: real TTFT less the simulated engine's TTFT)
and given to the simulator as a distribution to draw each request's path from
(SimConfig.dispatch_latency_samples); the log also shows the simulation without it and
with its median as a constant, and the idle path (probes) for contrast.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from benchmarks.open_loop import replay
from benchmarks.routing.validate import Figures, Log, compare
from cluster.percentile import percentile
from cluster.serve_env import controller_options, job_runtime_env
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig
from cluster.workload.sim_kinds import SimRequest, make_workload

CLUSTER_REPLICAS = 8
CLUSTER_ROUTER = CLUSTER_POLICY = "headroom"
# Wall seconds per modelled second: H200 decode steps of ~5 ms become ~100 ms, well above
# the engine's Python work per step (a few ms, more on a busy 2-core box).
TIME_DILATION = 20.0
CLUSTER_STATS_PERIOD_S = 1.0  # real seconds
# The controller's broadcast of a report to the routers (real seconds; an estimate).
CLUSTER_REPORT_LAG_S = 0.1
# b2b at the table's proportions scaled down (prefix 4x the question, as 6,000 : 1,200 is
# 5x): a question's prefill is then most of its TTFT, as in the table, not the ~25 ms of
# real dispatch path a 128-token question's 5 ms step was dwarfed by.
CLUSTER_WORKLOAD = dict(kind="b2b", num_groups=8, prefix_len=2048, question_len=512, output_len=32)
# Idle requests sent one at a time to measure the dispatch path (proxy -> ingress -> Serve
# -> replica -> first token back) on an idle cluster, shown for contrast with the loaded path.
NUM_PROBES = 8
PROBE_PROMPT_LEN = 16
# The validated run's seed, and the calibration run's (the dispatch path under load).
VALIDATION_SEED, CALIBRATION_SEED = 11, 13
CLUSTER_RATE = 30.0  # requests/s modelled
# (calibration, validated run): --quick, full. --quick's 40 calibration requests give the
# dispatch path's p10-p90 (its draws) within the 10 minutes --quick has.
CLUSTER_REQUESTS = {True: (40, 96), False: (160, 240)}


def idle_dispatch_latency(url: str, dilation: float, log: Log) -> float:
    """The path outside the engine on an IDLE cluster, in modelled seconds (shown for
    comparison; the simulator is given the one measured under load): each probe's real TTFT less
    the modelled time of its one prefill step (times the dilation, as the sim device
    sleeps), divided by the dilation (the path is not dilated; the run's real times are
    divided by it). The median over NUM_PROBES fresh prompts (no prefix hits)."""
    from worker.costs.cost_model import SeqWork, StepCostModel
    from worker.costs.profiles import load_profile
    from worker.costs.shapes import load_shape

    cost = StepCostModel(load_shape("llama-3-8b"), load_profile("h200"))
    step_s = cost.step_time_s([SeqWork(num_new_tokens=PROBE_PROMPT_LEN, context_len=0)])
    rng = np.random.default_rng(12345)
    ttfts = []
    for i in range(NUM_PROBES):
        prompt = tuple(int(t) for t in rng.integers(1000, 100_000, PROBE_PROMPT_LEN))
        probe = SimRequest(f"probe-{i}", 0.0, prompt, 1)
        (result,) = asyncio.run(_drive(url, "sim", [probe], 1.0))
        ttfts.append(result.ttft_s)
    real = float(np.median(ttfts))
    latency = max(real - step_s * dilation, 0.0) / dilation
    log(f"  dispatch path idle (for comparison): TTFT median {1000 * real:.0f} ms real over {NUM_PROBES} probes "
        f"(min {1000 * min(ttfts):.0f}, max {1000 * max(ttfts):.0f}), modelled prefill step {1000 * step_s:.2f} ms "
        f"x {dilation:g} -> {1000 * latency:.2f} ms modelled; load average {os.getloadavg()[0]:.1f}")
    return latency


async def _drive(url: str, model: str, requests: Sequence[SimRequest], dilation: float) -> list:
    """Send `requests` at their arrival times x dilation, streaming; every one must succeed.
    Returns cluster/bench's RequestResult per request, in the order of `requests`."""
    results = await replay(url, model, requests, dilation, 600.0)
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}: {failed[0].error_detail}")
    return results


def _figures(results: Sequence) -> Figures:
    """The run's figures in real time; each request's arrival is when it was really sent."""
    arrivals = [r.start_s for r in results]
    return Figures.of(arrivals, [r.start_s + r.ttft_s for r in results], [r.start_s + r.e2e_s for r in results],
                      sum(r.output_tokens for r in results))


def calibrate_dispatch_latency(url: str, dilation: float, requests: Sequence[SimRequest], config: SimConfig,
                               log: Log) -> tuple[float, ...]:
    """The path outside the engine UNDER LOAD, in modelled seconds, from a calibration run
    (a different seed than the validated run, same workload, rate and cluster): per request,
    real TTFT / dilation - the simulated TTFT of the same request without any dispatch
    path; negatives (the engines' share differing a little) count as 0. The simulator draws
    each request's path from these (SimConfig.dispatch_latency_samples): the path is
    right-skewed, so one constant (its median) shifted the TTFT p50 too little (validation
    2 at 13:17: median 0.73 ms, the validated run's p50 moved 2.2 ms). Idle probes miss
    what a loaded run adds (the proxy, the ingress and the replicas' host work competing
    for the same cores); this does not, and it never sees the validated run's requests."""
    results = asyncio.run(_drive(url, "sim", requests, dilation))
    sim = simulate(replace(config, dispatch_latency_s=0.0), requests).records
    by_id = {rec.request_id: rec for rec in sim}
    residuals = np.array([res.ttft_s / dilation - by_id[req.request_id].ttft_s
                          for req, res in zip(requests, results)])
    samples = tuple(float(x) for x in np.maximum(residuals, 0.0))
    p10, p50, p90 = (percentile(samples, q) for q in (10, 50, 90))
    log(f"  dispatch path under load: calibration run of {len(requests)} requests (seed {CALIBRATION_SEED}): "
        f"real TTFT - simulated engine TTFT per request: p10 {1000 * p10:.2f}, median {1000 * p50:.2f}, mean "
        f"{1000 * float(np.mean(samples)):.2f}, p90 {1000 * p90:.2f} ms modelled ({1000 * p50 * dilation:.0f} ms real "
        f"median) -> SimConfig.dispatch_latency_samples; load average {os.getloadavg()[0]:.1f}")
    return samples


def validate_cluster(quick: bool, log: Log) -> dict[str, float]:
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts its workers (the replicas, the proxy) at nice 15 by default: beside the
    # router table's processes (routing.TABLE_NICE) they would wait for a core, and the
    # dispatch path would measure the table's load instead of Serve's.
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from cluster.app import build_app
    from cluster.config import KVServeConfig

    d = TIME_DILATION
    kind = CLUSTER_WORKLOAD["kind"]
    kw = {k: v for k, v in CLUSTER_WORKLOAD.items() if k != "kind"}
    num_calibration, num_requests = CLUSTER_REQUESTS[quick]
    rate = CLUSTER_RATE
    requests = make_workload(kind, num_requests, rate, VALIDATION_SEED, **kw)
    calibration = make_workload(kind, num_calibration, rate, CALIBRATION_SEED, **kw)
    log(f"validation 2: {CLUSTER_REPLICAS} sim:h200 replicas (llama-3-8b), router {CLUSTER_ROUTER}, time dilation {d:g}, "
        f"stats period {CLUSTER_STATS_PERIOD_S} s real; {kind} {kw}, {num_requests} requests at {rate} req/s "
        f"modelled ({rate / d:g} req/s real, seed {VALIDATION_SEED}), after a calibration run of {num_calibration} "
        f"(seed {CALIBRATION_SEED}) that measures the dispatch path under the same load")
    sim_config = SimConfig(shape="llama-3-8b", profile="h200", num_replicas=CLUSTER_REPLICAS, router=CLUSTER_POLICY,
                           stats_period_s=CLUSTER_STATS_PERIOD_S / d, report_lag_s=CLUSTER_REPORT_LAG_S / d,
                           max_model_len=4096, seed=VALIDATION_SEED)
    port = 18000 + os.getpid() % 1000
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env=job_runtime_env({"PYTHONPATH": repo_root, "RAY_AUTH_MODE": "disabled"}))
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port), controller_options=controller_options())
        config = KVServeConfig.from_dict({
            "app_name": "routing-validation", "route_prefix": "/v",
            "model": {"served_model_name": "sim"},
            "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "time_dilation": d, "max_model_len": 4096},
            "workers": {"num_replicas": CLUSTER_REPLICAS, "num_cpus": 0.1},
            "ingress": {"num_cpus": 0.5, "api_keys_env": None},
            "routing": {"router": CLUSTER_ROUTER, "stats_period_s": CLUSTER_STATS_PERIOD_S},
        })
        t0 = time.perf_counter()
        serve.run(build_app(config), name="routing-validation", route_prefix="/v")
        url = f"http://127.0.0.1:{port}/v/v1/completions"
        # One warm-up request per replica's worth (outside the measured run), then the run.
        asyncio.run(_drive(url, "sim", [replace(r, arrival_s=0.0) for r in make_workload(
            "sharegpt", CLUSTER_REPLICAS, 1.0, 99, output_mean=4.0, input_mean=16.0)], 1.0))
        log(f"  cluster up in {time.perf_counter() - t0:.0f} s")
        idle_dispatch_latency(url, d, log)
        # The calibration run's prefixes are its own seed's: they do not warm the validated run's.
        dispatch_samples = calibrate_dispatch_latency(url, d, calibration, replace(sim_config, seed=CALIBRATION_SEED),
                                                      log)
        real = _figures(asyncio.run(_drive(url, "sim", requests, d))).scaled(d)
        log(f"  load average {os.getloadavg()[0]:.1f} after the run")
    finally:
        serve.shutdown()
        ray.shutdown()
    bare = Figures.of_sim(simulate(sim_config, requests).summary())
    log(f"  simulated without the dispatch path: TTFT p50 {bare.ttft_p50_s:.4f} s, p99 {bare.ttft_p99_s:.4f} s, "
        f"{bare.output_tokens_per_s:.1f} tok/s")
    median = Figures.of_sim(simulate(replace(sim_config, dispatch_latency_s=float(np.median(dispatch_samples))),
                                     requests).summary())
    log(f"  simulated with the path's median as a constant: TTFT p50 {median.ttft_p50_s:.4f} s, "
        f"p99 {median.ttft_p99_s:.4f} s")
    sim = Figures.of_sim(simulate(replace(sim_config, dispatch_latency_samples=dispatch_samples), requests).summary())
    return compare(f"cluster ({CLUSTER_REPLICAS} sim replicas, dispatch path drawn from the calibration run)",
                   real, sim, log)
