"""The simulator against real runs, same seeded workload (benchmarks.routing's validations).

1. Engine: the real engine (one replica, CPU, the embedded model, FP32), driven in real
   time (each request added at its arrival time, the engine stepped as AsyncEngine's loop
   does: step, then a stats snapshot), against `simulate` with the calibrated CPU profile
   (`kvserve calibrate`, cluster/calibrate.py) on the same shape, KV size and scheduler
   limits.
2. Cluster: a real Ray Serve cluster of 8 simulated-device replicas (engine.device
   sim:h200, llama-3-8b shape, time dilation D), the real ingress and the KV-headroom
   router, driven over HTTP at the workload's arrival times x D (cluster/bench's streaming
   client; prompts sent as token ids so both sides see the same tokens), against
   `simulate` with the same config, its stats period and report lag divided by D. Real
   times are divided by D (tokens/s multiplied) before comparing. The HTTP proxy ->
   ingress -> Serve dispatch path is not dilated, so it is MEASURED under load, on the same
   cluster, in a calibration run of another seed (per request: real TTFT less the simulated
   engine's TTFT) and given to the simulator as a distribution to draw each request's path
   from (SimConfig.dispatch_latency_samples); the log also shows the simulation without
   it and with its median as a constant, and the idle path (probes) for contrast.
   The real engine of validation 1 runs the workload ENGINE_REPEATS times (median figures)
   against a CPU profile calibrated in the same run.

Figures: TTFT p50, TTFT p99, output tokens/s (all output tokens / (last finish - first
arrival)), relative error (sim - real) / real.
"""
from __future__ import annotations

import asyncio
import math
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from benchmarks.open_loop import replay
from cluster.sim.run import SimConfig, SimDevice, simulate
from cluster.sim.workloads import SimRequest, make_workload

Log = Callable[[str], None]


@dataclass(frozen=True)
class Figures:
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens_per_s: float

    @classmethod
    def of(cls, arrivals: Sequence[float], first_tokens: Sequence[float], finishes: Sequence[float],
           num_output_tokens: int) -> Figures:
        ttft = np.asarray(first_tokens) - np.asarray(arrivals)
        duration = max(finishes) - min(arrivals)
        return cls(float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99)), num_output_tokens / duration)

    @classmethod
    def of_sim(cls, summary: dict) -> Figures:
        return cls(summary["ttft_s"]["p50"], summary["ttft_s"]["p99"], summary["output_tokens_per_s"])

    @classmethod
    def median(cls, runs: Sequence[Figures]) -> Figures:
        """Each figure's median over repeated real runs."""
        return cls(*(float(np.median([getattr(r, k) for r in runs]))
                     for k in ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s")))

    def scaled(self, dilation: float) -> Figures:
        """Real figures of a dilated run, in undilated time."""
        return Figures(self.ttft_p50_s / dilation, self.ttft_p99_s / dilation, self.output_tokens_per_s * dilation)


def compare(name: str, real: Figures, sim: Figures, log: Log) -> dict[str, float]:
    errors = {k: 100.0 * (getattr(sim, k) - getattr(real, k)) / getattr(real, k)
              for k in ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s")}
    log(f"  {name}: {'':14} {'TTFT p50':>10} {'TTFT p99':>10} {'out tok/s':>10}")
    log(f"  {'':{len(name) + 16}} {real.ttft_p50_s:>10.4f} {real.ttft_p99_s:>10.4f} {real.output_tokens_per_s:>10.1f}  real")
    log(f"  {'':{len(name) + 16}} {sim.ttft_p50_s:>10.4f} {sim.ttft_p99_s:>10.4f} {sim.output_tokens_per_s:>10.1f}  simulated")
    log(f"  {'':{len(name) + 16}} {errors['ttft_p50_s']:>+9.1f}% {errors['ttft_p99_s']:>+9.1f}% "
        f"{errors['output_tokens_per_s']:>+9.1f}%  error")
    return errors


def into_vocab(requests: Sequence[SimRequest], vocab_size: int) -> list[SimRequest]:
    """Token ids folded into [1, vocab): equal ids stay equal, so shared prefixes stay shared."""
    return [replace(r, prompt_token_ids=tuple(1 + (t - 1) % (vocab_size - 1) for t in r.prompt_token_ids))
            for r in requests]


# -- 1. the real engine vs the simulator -------------------------------------------------------
ENGINE_WORKLOAD = dict(kind="sharegpt", input_mean=160.0, output_mean=48.0, max_len=768)


def run_engine_real_time(engine, requests: Sequence[SimRequest]) -> Figures:  # noqa: ANN001 (worker.engine.Engine)
    from worker.api import SamplingParams

    pending = deque(requests)
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    num_tokens = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            engine.add_request(r.request_id, list(r.prompt_token_ids),
                               SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
        if not engine.has_unfinished():
            time.sleep(max(pending[0].arrival_s - now, 0.0))  # idle until the next arrival (a benchmark)
            continue
        outputs = engine.step()
        engine.stats()  # AsyncEngine's loop takes this snapshot after every step (so did calibrate)
        t = time.perf_counter() - start
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, t)
                num_tokens += len(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = t
    arrivals = [r.arrival_s for r in requests]
    return Figures.of(arrivals, [first[r.request_id] for r in requests], list(finish.values()), num_tokens)


ENGINE_NUM_THREADS = 1  # torch threads: the engine here and the calibration that priced it
ENGINE_LOAD_FRACTION = 0.5  # the run's rate: this fraction of the modelled saturation rate
ENGINE_REQUESTS = {True: 120, False: 300}  # --quick, full
# Calibration and the real run, paired, this many times; each figure is the median over the
# pairs (real and simulated alike). The machine's speed drifts within tens of seconds: one
# 10 s run's TTFT p50 moved -5% to +13% against one profile (2026-12-01 13:13), and three
# runs 20-50 s after one calibration drifted 19.0 -> 21.2 ms (-20% against it, 13:41).
ENGINE_REPEATS = 3
# Calibration's grid here: the regime this workload runs in (decode contexts up to its
# ~800-token sequences), so a calibration takes ~10 s, not the full grid's ~25 s
# (32 prompts of 1,024 tokens are prefilled for its largest decode point alone).
ENGINE_GRID = dict(decode_contexts=(16, 128, 512))


def engine_profile(profile_path: str | None, log: Log):  # noqa: ANN201 (worker.sim.profiles.DeviceProfile)
    """The CPU profile to price the engine with: `profile_path`, else a calibration now,
    with the engine's thread count. Now, not the committed fit: a shared 2-core machine
    runs 15-20% faster or slower from one hour to the next (the committed profile of 09:39
    predicted TTFT p50 16% high on the idle machine at 13:11, a fresh one -9%), and a
    calibrated profile is a statement about the machine as it is."""
    from cluster.calibrate import GridSpec, calibrate
    from worker.sim.profiles import load_profile

    if profile_path:
        profile = load_profile(profile_path)
        log(f"validation 1: CPU profile {profile_path} ({profile.source})")
        return profile
    t0 = time.perf_counter()
    profile, report, points = calibrate(None, "cpu-validation", ENGINE_NUM_THREADS, 16, spec=GridSpec(**ENGINE_GRID))
    saved = os.path.join(tempfile.gettempdir(), f"kvserve-cpu-validation-{os.getpid()}.json")
    profile.save(saved)
    log(f"validation 1: calibrated a CPU profile now ({len(points)} engine steps, decode contexts "
        f"{ENGINE_GRID['decode_contexts']}, {time.perf_counter() - t0:.0f} s, "
        f"{ENGINE_NUM_THREADS} thread, saved to {saved}): fit error mean {100 * report.mean_rel_error:.1f}%, "
        f"max {100 * report.max_rel_error:.1f}%")
    return profile


def modelled_saturation_rps(config: SimConfig, device: SimDevice, kind: str, num_requests: int, seed: int,
                            vocab_size: int, **kw) -> float:
    """Requests/s the modelled replica completes when every request is waiting at once
    (the workload's requests, all arriving within a millisecond): its capacity."""
    burst = into_vocab(make_workload(kind, num_requests, num_requests / 1e-3, seed, **kw), vocab_size)
    summary = simulate(config, burst, device).summary()
    return num_requests / summary["duration_s"]


def validate_engine(quick: bool, profile_path: str | None, log: Log) -> dict[str, float]:
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.default_model import default_model_path
    from worker.engine import Engine
    from worker.sim.cost_model import StepCostModel
    from worker.sim.runner import SimRunner
    from worker.sim.shapes import load_shape

    path = default_model_path()
    scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=2048)  # prompt + output <= 1536
    cache = CacheConfig(block_size=16, kv_cache_bytes=64 * 1024**2, enable_prefix_caching=True)
    engine = Engine.from_config(EngineConfig(
        model=ModelConfig(model=path, device="cpu", dtype="float32", num_threads=ENGINE_NUM_THREADS),
        cache=cache, scheduler=scheduler))
    num_blocks = engine.runner.num_blocks
    shape = load_shape(path, dtype_bytes=4)

    def simulator(profile) -> tuple[SimConfig, SimDevice]:  # noqa: ANN001 (DeviceProfile)
        cost = StepCostModel(shape, profile)
        device = SimDevice(make_runner=lambda n: SimRunner(cost, n, 16, shape.vocab_size, sleep=False),
                           num_blocks=num_blocks, vocab_size=shape.vocab_size,
                           kv_bytes_per_token=shape.kv_bytes_per_token(), max_model_len=scheduler.max_model_len)
        config = SimConfig(shape=path, profile=profile.name, num_replicas=1, router="round_robin",
                           max_num_seqs=scheduler.max_num_seqs,
                           max_num_batched_tokens=scheduler.max_num_batched_tokens,
                           max_model_len=scheduler.max_model_len, block_size=16, num_blocks=num_blocks, seed=7)
        return config, device

    config, device = simulator(engine_profile(profile_path, log))
    kind = ENGINE_WORKLOAD["kind"]
    kw = {k: v for k, v in ENGINE_WORKLOAD.items() if k != "kind"}
    num_requests = ENGINE_REQUESTS[quick]
    capacity = modelled_saturation_rps(config, device, kind, num_requests, 7, shape.vocab_size, **kw)
    rate = ENGINE_LOAD_FRACTION * capacity
    requests = into_vocab(make_workload(kind, num_requests, rate, 7, **kw), shape.vocab_size)
    log(f"  workload: {kind} {kw}, {num_requests} requests at {rate:.2f} req/s (Poisson, seed 7) = "
        f"{ENGINE_LOAD_FRACTION:.0%} of the modelled saturation rate {capacity:.2f} req/s; engine "
        f"{ENGINE_NUM_THREADS} torch thread, max_num_seqs {scheduler.max_num_seqs}, max_num_batched_tokens "
        f"{scheduler.max_num_batched_tokens}, {num_blocks} KV blocks; load average {os.getloadavg()[0]:.1f} at start")
    engine.step()  # warm-up (first-step allocations), before the clock starts
    reals, sims = [], []
    for i in range(ENGINE_REPEATS):
        if i > 0 and not profile_path:  # calibrate again right before this run: the machine drifts
            config, device = simulator(engine_profile(None, log))
        real = run_engine_real_time(engine, [replace(r, request_id=f"{r.request_id}-{i}") for r in requests])
        engine.kv.pool.reset_prefix_cache()  # each repeat starts cold, as the simulation does
        sim = Figures.of_sim(simulate(config, requests, device).summary())
        reals.append(real)
        sims.append(sim)
        log(f"  pair {i + 1}/{ENGINE_REPEATS}: real TTFT p50 {real.ttft_p50_s:.4f} s, p99 {real.ttft_p99_s:.4f} s, "
            f"{real.output_tokens_per_s:.1f} tok/s; simulated {sim.ttft_p50_s:.4f} s, {sim.ttft_p99_s:.4f} s, "
            f"{sim.output_tokens_per_s:.1f} tok/s")
    log(f"  load average {os.getloadavg()[0]:.1f} at end (the real engine runs on the wall clock: a machine "
        f"shared with other jobs slows it, the calibrated profile does not)")
    return compare(f"engine (1 CPU replica, median of {ENGINE_REPEATS})", Figures.median(reals), Figures.median(sims),
                   log)


# -- 2. a real Serve cluster of simulated-device replicas vs the simulator ---------------------
CLUSTER_REPLICAS = 8
CLUSTER_ROUTER, CLUSTER_POLICY = "kv_headroom", "headroom"  # the same code: router/headroom.py
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
CLUSTER_REQUESTS = {True: (64, 96), False: (160, 240)}  # (calibration, validated run): --quick, full


def idle_dispatch_latency(url: str, dilation: float, log: Log) -> float:
    """The path outside the engine on an IDLE cluster, in modelled seconds (shown for
    comparison; the simulator is given the one measured under load): each probe's real TTFT less
    the modelled time of its one prefill step (times the dilation, as the sim device
    sleeps), divided by the dilation (the path is not dilated; the run's real times are
    divided by it). The median over NUM_PROBES fresh prompts (no prefix hits)."""
    from worker.sim.cost_model import SeqWork, StepCostModel
    from worker.sim.profiles import load_profile
    from worker.sim.shapes import load_shape

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
    p10, p50, p90 = np.percentile(samples, [10, 50, 90])
    log(f"  dispatch path under load: calibration run of {len(requests)} requests (seed {CALIBRATION_SEED}): "
        f"real TTFT - simulated engine TTFT per request: p10 {1000 * p10:.2f}, median {1000 * p50:.2f}, mean "
        f"{1000 * float(np.mean(samples)):.2f}, p90 {1000 * p90:.2f} ms modelled ({1000 * p50 * dilation:.0f} ms real "
        f"median) -> SimConfig.dispatch_latency_samples; load average {os.getloadavg()[0]:.1f}")
    return samples


def validate_cluster(quick: bool, log: Log) -> dict[str, float]:
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
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
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": repo_root, "RAY_AUTH_MODE": "disabled"}})
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
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


def validate_all(quick: bool, cpu_profile: str | None, log: Log) -> float:
    """Both validations; the worst |error| in % of TTFT p50 and output tokens/s."""
    import traceback

    log("")
    worst = 0.0
    for name, run in (("engine", lambda: validate_engine(quick, cpu_profile, log)),
                      ("cluster", lambda: validate_cluster(quick, log))):
        try:
            errors = run()
        except Exception:  # a failed validation is reported, and leaves the figure unknown
            log(f"validation {name} FAILED:\n{traceback.format_exc()}")
            worst = math.nan
            continue
        worst = max(worst, abs(errors["ttft_p50_s"]), abs(errors["output_tokens_per_s"]))
    return worst
