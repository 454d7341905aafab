"""The simulator against real runs, same seeded workload (benchmarks.routing's validations).

1. Engine: the real engine (one replica, CPU, the embedded model, FP32) on its own clock
   (each request added once the clock passes its arrival, the engine stepped as
   AsyncEngine's loop does: step, then a stats snapshot), against `simulate` with a CPU
   profile calibrated (`kvserve calibrate`, cluster/calibrate.py) on the same shape, KV
   size and scheduler limits, over plans where this workload's steps run (workload_grid).
   The clock is the one the calibration priced the steps with: by default the process's
   CPU time (a step advances it by the CPU seconds the step took; an idle engine jumps to
   the next arrival, as a real one would sleep until it). CPU time is not moved by waiting
   for a core, but it is by what other load does to the caches and the core's speed, so
   each pair's calibration is measured between the steps of its real run
   (calibrate_beside), and the error is the median over ENGINE_REPEATS pairs of each
   pair's error, with the pairs' spread printed.
2. Cluster: a real Ray Serve cluster of 8 simulated-device replicas vs the simulator
   (benchmarks/routing/validate_cluster.py).

Figures: TTFT p50, TTFT p99, output tokens/s (all output tokens / (last finish - first
arrival)), relative error (sim - real) / real.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from worker.engine.build import build_engine

from benchmarks.routing.engine_grid import (ENGINE_CLOCK, ENGINE_NUM_THREADS, engine_profile, fit_summary,
                                           grid_moment, workload_grid)
from cluster.calibrate import CLOCKS, age_pool
from cluster.percentile import percentile
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.workload.sim_kinds import SimRequest, make_workload

Log = Callable[[str], None]
# Validation 2's outcome from its own process: its errors (None if it failed), its log lines
# and, if it failed, the traceback.
ClusterValidation = tuple[dict[str, float] | None, list[str], str | None]


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
        return cls(percentile(ttft, 50), percentile(ttft, 99), num_output_tokens / duration)

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


FIGURES = ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s")


def relative_errors(real: Figures, sim: Figures) -> dict[str, float]:
    """(sim - real) / real, in %, per figure."""
    return {k: 100.0 * (getattr(sim, k) - getattr(real, k)) / getattr(real, k) for k in FIGURES}


def median_pair_errors(reals: Sequence[Figures], sims: Sequence[Figures]) -> dict[str, float]:
    """Each figure's median over the pairs of that pair's own error. A simulation is priced
    by the calibration taken right before its real run, so that the machine's drift cancels
    within the pair; medians of the real runs and of the simulations taken apart would set
    one pair's real run against another pair's simulation."""
    per_pair = [relative_errors(r, s) for r, s in zip(reals, sims, strict=True)]
    return {k: float(np.median([e[k] for e in per_pair])) for k in FIGURES}


def compare(name: str, real: Figures, sim: Figures, log: Log,
            errors: dict[str, float] | None = None) -> dict[str, float]:
    """Log real vs simulated and the errors (default: of these two figures)."""
    errors = errors if errors is not None else relative_errors(real, sim)
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


def run_engine_on_clock(engine, requests: Sequence[SimRequest],  # noqa: ANN001 (worker.engine.core.Engine)
                        clock: Callable[[], float] = time.process_time,
                        between_steps: Callable[[float], None] | None = None) -> Figures:
    """The engine's run, timed by `clock`: each step advances the run's time by what the
    step (and the stats snapshot after it) took on that clock; requests join once the
    time passes their arrival; an idle engine jumps to the next arrival.
    `between_steps(progress)`, when given, runs after each step, off the run's clock, with
    the share of the requests added so far (the validation measures its calibration there)."""
    from worker.api import SamplingParams

    pending = deque(requests)
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    num_tokens = 0
    now = 0.0
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            engine.add_request(r.request_id, list(r.prompt_token_ids),
                               SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
        if not engine.has_unfinished():
            now = pending[0].arrival_s
            continue
        started = clock()
        outputs = engine.step()
        engine.stats()  # AsyncEngine's loop takes this snapshot after every step (so did calibrate)
        now += clock() - started
        t = now
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, t)
                num_tokens += len(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = t
        if between_steps is not None:
            between_steps(1.0 - len(pending) / len(requests))
    arrivals = [r.arrival_s for r in requests]
    return Figures.of(arrivals, [first[r.request_id] for r in requests], list(finish.values()), num_tokens)


ENGINE_LOAD_FRACTION = 0.5  # the run's rate: this fraction of the modelled saturation rate
ENGINE_REQUESTS = {True: 100, False: 300}  # --quick, full
# Calibration and the real run, paired, this many times; the error is the median over the
# pairs of each pair's error (median_pair_errors). Each pair's calibration runs interleaved
# with its real run (calibrate_beside): on a shared machine the process clock still moves
# with the load (caches and the core's other tenants), within tens of seconds, and a
# calibration taken before the run would price it at another moment's speed.
ENGINE_REPEATS = 5
def calibrate_beside(engine, requests: Sequence[SimRequest], spec,  # noqa: ANN001 (Engine, GridSpec)
                     log: Log):  # noqa: ANN201 (Figures, DeviceProfile)
    """The real run, with a calibration's grid measured between its steps (off the run's
    clock): whenever the grid's share done falls behind the share of the run's requests
    added by 1 / ENGINE_GRID_MOMENTS, grid plans until it no longer lags; the rest after
    the last step. Both then sample the machine over
    the same stretch of time, so a load that comes or goes mid-run moves both alike.
    Returns the run's figures and the profile fitted to the grid."""
    from cluster.calibrate import fit_measurement, start_measurement

    t0 = time.perf_counter()
    measurement = start_measurement(None, ENGINE_NUM_THREADS, 16, ENGINE_CLOCK, spec)

    def between_steps(progress: float) -> None:
        if grid_moment(progress, measurement.progress):
            while not measurement.done and measurement.progress < progress:
                measurement.measure_next()

    real = run_engine_on_clock(engine, requests, CLOCKS[ENGINE_CLOCK], between_steps)
    num_after = len(measurement.tasks) - measurement.num_done
    measurement.finish()
    profile, report, points = fit_measurement(measurement, "cpu-validation")
    log(f"    calibrated beside the run ({len(points)} engine steps in {len(measurement.tasks)} grid plans, "
        f"{num_after} after its last step; {time.perf_counter() - t0:.0f} s together): {fit_summary(report)}")
    return real, profile


def modelled_saturation_rps(config: SimConfig, device: SimDevice, kind: str, num_requests: int, seed: int,
                            vocab_size: int, **kw) -> float:
    """Requests/s the modelled replica completes when every request is waiting at once
    (the workload's requests, all arriving within a millisecond): its capacity."""
    burst = into_vocab(make_workload(kind, num_requests, num_requests / 1e-3, seed, **kw), vocab_size)
    summary = simulate(config, burst, device).summary()
    return num_requests / summary["duration_s"]


def validate_engine(quick: bool, profile_path: str | None, log: Log,
                    step_check: Callable[..., AbstractContextManager[Any]] | None = None) -> dict[str, float]:
    """`step_check(engine, cost, log)`, when given, wraps each real run (a context manager:
    benchmarks/routing/validate_steps.py sets each step against its prediction, priced at
    the block's end by the pair's own profile: the `cost` set on what it yields)."""
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.default_model import default_model_path
    from worker.engine.core import Engine
    from worker.costs.cost_model import StepCostModel
    from worker.sim.runner import SimRunner
    from worker.costs.shapes import load_shape

    path = default_model_path()
    scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=2048)  # prompt + output <= 1536
    cache = CacheConfig(block_size=16, kv_cache_bytes=64 * 1024**2, enable_prefix_caching=True)
    engine = build_engine(EngineConfig(
        model=ModelConfig(model=path, device="cpu", dtype="float32", num_threads=ENGINE_NUM_THREADS),
        cache=cache, scheduler=scheduler))
    num_blocks = engine.runner.num_blocks
    shape = load_shape(path, dtype_bytes=4)

    def simulator(profile) -> tuple[SimConfig, SimDevice, StepCostModel]:  # noqa: ANN001 (DeviceProfile)
        cost = StepCostModel(shape, profile)
        device = SimDevice(make_runner=lambda n: SimRunner(cost, n, 16, shape.vocab_size, sleep=False),
                           num_blocks=num_blocks, vocab_size=shape.vocab_size,
                           kv_bytes_per_token=shape.kv_bytes_per_token(), max_model_len=scheduler.max_model_len)
        config = SimConfig(shape=path, profile=profile.name, num_replicas=1, router="round_robin",
                           max_num_seqs=scheduler.max_num_seqs,
                           max_num_batched_tokens=scheduler.max_num_batched_tokens,
                           max_model_len=scheduler.max_model_len, block_size=16, num_blocks=num_blocks, seed=7)
        return config, device, cost

    kind = ENGINE_WORKLOAD["kind"]
    kw = {k: v for k, v in ENGINE_WORKLOAD.items() if k != "kind"}
    num_requests = ENGINE_REQUESTS[quick]
    # The workload's lengths do not depend on its rate: the grid is known before the rate.
    spec = workload_grid(make_workload(kind, num_requests, 1.0, 7, **kw), scheduler.max_num_batched_tokens)
    first = engine_profile(profile_path, spec, log)
    log(f"  calibration grid: decode batches {spec.decode_batches} x contexts {spec.decode_contexts}, prefill "
        f"chunks {spec.prefill_chunks}, mixed (chunk, decodes, their context) {spec.mixed}")
    config, device, cost = simulator(first)
    capacity = modelled_saturation_rps(config, device, kind, num_requests, 7, shape.vocab_size, **kw)
    rate = ENGINE_LOAD_FRACTION * capacity
    requests = into_vocab(make_workload(kind, num_requests, rate, 7, **kw), shape.vocab_size)
    log(f"  workload: {kind} {kw}, {num_requests} requests at {rate:.2f} req/s (Poisson, seed 7) = "
        f"{ENGINE_LOAD_FRACTION:.0%} of the modelled saturation rate {capacity:.2f} req/s; engine "
        f"{ENGINE_NUM_THREADS} torch thread, max_num_seqs {scheduler.max_num_seqs}, max_num_batched_tokens "
        f"{scheduler.max_num_batched_tokens}, {num_blocks} KV blocks; load average {os.getloadavg()[0]:.1f} at start")
    age_pool(engine.kv.pool)  # a live engine's pool, as the calibration's plans run on (cluster/calibrate.py)
    engine.step()  # warm-up (first-step allocations), before the clock starts
    reals, sims = [], []
    for i in range(ENGINE_REPEATS):
        run = [replace(r, request_id=f"{r.request_id}-{i}") for r in requests]
        with step_check(engine, cost, log) if step_check is not None else nullcontext() as steps:
            if profile_path:
                real, profile = run_engine_on_clock(engine, run, CLOCKS[ENGINE_CLOCK]), first
            else:
                real, profile = calibrate_beside(engine, run, spec, log)
            config, device, cost = simulator(profile)
            if steps is not None:
                steps.cost = cost  # the step check prices the run's steps with this pair's profile
        engine.kv.pool.reset_prefix_cache()  # each repeat starts cold, as the simulation does
        sim = Figures.of_sim(simulate(config, requests, device).summary())
        reals.append(real)
        sims.append(sim)
        e = relative_errors(real, sim)
        log(f"  pair {i + 1}/{ENGINE_REPEATS}: real TTFT p50 {real.ttft_p50_s:.4f} s, p99 {real.ttft_p99_s:.4f} s, "
            f"{real.output_tokens_per_s:.1f} tok/s; simulated {sim.ttft_p50_s:.4f} s, {sim.ttft_p99_s:.4f} s, "
            f"{sim.output_tokens_per_s:.1f} tok/s; error {e['ttft_p50_s']:+.1f}%, {e['ttft_p99_s']:+.1f}%, "
            f"{e['output_tokens_per_s']:+.1f}%")
    log(f"  load average {os.getloadavg()[0]:.1f} at end (both sides on the {ENGINE_CLOCK} clock, each pair's "
        f"calibration measured between its real run's steps)")
    log_spread(reals, sims, log)
    real, sim = Figures.median(reals), Figures.median(sims)
    apart = relative_errors(real, sim)
    log(f"  (the medians taken apart would read {apart['ttft_p50_s']:+.1f}%, {apart['ttft_p99_s']:+.1f}%, "
        f"{apart['output_tokens_per_s']:+.1f}%)")
    return compare(f"engine (1 CPU replica, {ENGINE_REPEATS} pairs: medians; error: median of the pairs' errors)",
                   real, sim, log, median_pair_errors(reals, sims))


def pair_error_spread(reals: Sequence[Figures], sims: Sequence[Figures]) -> dict[str, tuple[float, float]]:
    """Each figure's (lowest, highest) error over the pairs."""
    per_pair = [relative_errors(r, s) for r, s in zip(reals, sims, strict=True)]
    return {k: (min(e[k] for e in per_pair), max(e[k] for e in per_pair)) for k in FIGURES}


def log_spread(reals: Sequence[Figures], sims: Sequence[Figures], log: Log) -> None:
    spread = pair_error_spread(reals, sims)
    log("  the pairs' errors spread over: " + ", ".join(
        f"{name} {spread[k][0]:+.1f}% .. {spread[k][1]:+.1f}%"
        for name, k in zip(("TTFT p50", "TTFT p99", "out tok/s"), FIGURES)))


def validate_cluster_buffered(quick: bool) -> ClusterValidation:
    """Validation 2 in its own process, beside the router table: its log lines come back
    (printed after validation 1's, so the log keeps its order), with its errors or the
    traceback of its failure. It runs on the wall clock but mostly waits (dilated steps
    sleep), and its calibration run measures the dispatch path under the same load as the
    validated run; the table's processes run at a lower priority (routing.TABLE_NICE) so
    that a woken replica or proxy gets a core at once."""
    import traceback

    from benchmarks.routing.validate_cluster import validate_cluster

    lines: list[str] = []
    try:
        return validate_cluster(quick, lines.append), lines, None
    except Exception:  # reported by validate_all, which leaves the figure unknown
        return None, lines, traceback.format_exc()


def validate_all(quick: bool, cpu_profile: str | None, log: Log, cluster: Callable[[], ClusterValidation]) -> float:
    """Both validations; the worst |error| in % of TTFT p50 and output tokens/s. `cluster`
    waits for validation 2's result (validate_cluster_buffered, run in its own process):
    it is awaited before validation 1 starts, whose real engine must have the machine to
    itself, and its lines are logged after validation 1's."""
    import traceback

    log("")
    worst = 0.0
    errors_2, lines, failure = cluster()

    def cluster_run() -> dict[str, float]:
        for line in lines:
            log(line)
        if failure is not None:
            raise RuntimeError(failure)
        assert errors_2 is not None
        return errors_2

    for name, run in (("engine", lambda: validate_engine(quick, cpu_profile, log)), ("cluster", cluster_run)):
        try:
            errors = run()
        except Exception:  # a failed validation is reported, and leaves the figure unknown
            log(f"validation {name} FAILED:\n{traceback.format_exc()}")
            worst = math.nan
            continue
        worst = max(worst, abs(errors["ttft_p50_s"]), abs(errors["output_tokens_per_s"]))
    return worst
