"""The bursty case once on a real Ray Serve cluster of simulated devices, beside the
simulator's forecast of the same trace (`python -m benchmarks.planner --serve`).

The cluster is kvserve's app (cluster/app.py: the real ingress, the KV-headroom router, the
real WorkerReplica and engine) on simulated H200s (engine.device sim:h200, llama-3-8b shape)
at time dilation D: a modelled step of t seconds takes t x D real ones. The worker pool is
scaled by the SLO planner as Serve's autoscaling policy (cluster/planner/serve_policy.py,
on the modelled clock), the requests are replayed over HTTP at their arrival times x D
(benchmarks/open_loop.py, prompts as token ids), and real times are divided by D before
they meet the targets. A replica's model load is a sleep of `startup_s` x D at its start
(ModelLoad, WorkerReplica's set-up hook); what Serve really takes to start one (the sleep,
a new worker process, the engine) is measured from Serve's replica states and given to the
simulation as its replicas' start-up (SimPlannerOptions.replica_startup_s), a measured input
like benchmarks/routing/validate_cluster.py's dispatch path, while both planners plan with
the same `startup_s`. The simulation runs the same config and trace (its routers' stats
period and report lag divided by D).

Scaled to fit a few minutes of wall time on a small machine (ServeCase): one mixed pool
(with the engines' step-time budget keeping answers within the ITL target beside the
prompts' chunks), as a simulated device holds no KV to hand from a prefill to a decode
replica; 0.5 <-> 6 req/s in 20 s phases, two cycles; a 5 s start-up and a 2.5 s planner tick;
64-token answers. The prompts (8000 tokens), the targets (TTFT <= 3 s, ITL <= 35 ms) and the
alternation stay the issue's.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.planner_cases import attainment, bursty_phases, phased_requests
from cluster.planner.targets import PlannerSettings, SLOTargets
from cluster.sim.planner import SimPlannerOptions
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig
from cluster.workload.sim_kinds import SimRequest

APP, PREFIX, MODEL = "planner-serve", "/p", "sim"
STATS_PERIOD_S = 1.0  # real seconds: the routers' stats period on the cluster
REPORT_LAG_S = 0.1  # real seconds: a report's way to the routers (an estimate)


@dataclass(frozen=True)
class ServeCase:
    """The trace and the cluster, in modelled seconds unless named real."""

    dilation: float = 4.0
    low_rps: float = 0.5
    high_rps: float = 6.0
    phase_s: float = 20.0
    cycles: int = 2
    prompt_tokens: int = 8000
    output_tokens: int = 64
    startup_s: float = 5.0
    interval_s: float = 2.5
    downscale_delay_s: float = 10.0
    max_replicas: int = 4
    # The engines' step-time budget (worker/scheduling/step_budget.py): a step carrying
    # decodes takes no more prompt tokens than keep it within this, so a mixed pool's
    # answers keep the ITL target while 8000-token prompts are chunked beside them.
    max_step_time_s: float = 0.025
    slo: SLOTargets = field(default_factory=lambda: SLOTargets(ttft_s=3.0, itl_s=0.035))
    seed: int = 0

    def settings(self) -> PlannerSettings:
        return PlannerSettings(startup_s=self.startup_s, interval_s=self.interval_s,
                               downscale_delay_s=self.downscale_delay_s)

    def requests(self) -> list[SimRequest]:
        phases = bursty_phases(self.low_rps, self.high_rps, self.phase_s, self.cycles)
        return phased_requests(phases, self.prompt_tokens, self.output_tokens, self.seed)

    def kvserve_config(self) -> dict[str, Any]:
        d = self.dilation
        return {
            "app_name": APP, "route_prefix": PREFIX,
            "model": {"served_model_name": MODEL},
            "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "time_dilation": d,
                       "max_model_len": 16384, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                       "max_step_time_s": self.max_step_time_s},
            "workers": {"num_cpus": 0.1, "drain_timeout_s": 600.0, "autoscaling": {
                "min_replicas": 1, "initial_replicas": 1, "max_replicas": self.max_replicas,
                # Serve applies the delays under Serve (real seconds): up at once, down as the
                # simulator's planner does (cluster/planner/planner.py)
                "upscale_delay_s": 0.0, "downscale_delay_s": self.downscale_delay_s * d,
                "look_back_period_s": 2.0, "metrics_interval_s": 0.5,
                "slo": {"ttft_ms": self.slo.ttft_s * 1000, "itl_ms": self.slo.itl_s * 1000,
                        "startup_s": self.startup_s, "interval_s": self.interval_s}}},
            "ingress": {"num_cpus": 0.5, "api_keys_env": None},
            "routing": {"router": "headroom", "stats_period_s": STATS_PERIOD_S},
        }

    def sim_config(self, replica_startup_s: float) -> SimConfig:
        d = self.dilation
        planner = SimPlannerOptions(self.slo, self.settings(), 1, self.max_replicas,
                                    replica_startup_s=replica_startup_s)  # the Serve policy's token priors
        return SimConfig(shape="llama-3-8b", profile="h200", num_replicas=1, router="headroom",
                         max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=16384,
                         max_step_time_s=self.max_step_time_s, stats_period_s=STATS_PERIOD_S / d,
                         report_lag_s=REPORT_LAG_S / d, slo_ttft_ms=self.slo.ttft_s * 1000,
                         slo_itl_ms=self.slo.itl_s * 1000, planner=planner, seed=self.seed)


class ModelLoad:
    """WorkerReplica's set-up hook: a replica's model load, as a sleep (real seconds)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self) -> None:
        time.sleep(self.seconds)


def served_attainment(results: Sequence[Any], dilation: float, ttft_s: float, itl_s: float) -> float:
    """benchmarks/planner_cases.attainment of a real run: real times divided by the dilation;
    a failed request misses."""
    good = 0
    for r in results:
        if not r.success or r.ttft_s is None or r.e2e_s is None:
            continue
        tpot = (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        good += r.ttft_s / dilation <= ttft_s and tpot / dilation <= itl_s
    return good / len(results) if results else 0.0


def misses(pairs: Sequence[tuple[float | None, float | None]], ttft_s: float, itl_s: float) -> str:
    """`pairs`: (TTFT, mean ITL) per request in modelled seconds (None: never came). The
    TTFT and ITL p90 and how many requests missed each target."""
    from cluster.percentile import percentile

    ttfts = [t for t, _ in pairs if t is not None]
    itls = [i for _, i in pairs if i is not None]
    late = sum(1 for t, _ in pairs if t is None or t > ttft_s)
    slow = sum(1 for _, i in pairs if i is not None and i > itl_s)
    return (f"TTFT p90 {percentile(ttfts, 90):.2f} s, mean ITL p90 {1000 * percentile(itls, 90):.1f} ms; "
            f"{late} over the TTFT target (or never answered), {slow} over the ITL target")


def start_ups(timeline: Sequence[tuple[float, int, int]]) -> list[float]:
    """Replica start-ups from polled (time, starting, running) counts: each rise in the
    starting count is a replica asked for, each rise in the running count the oldest of
    those ready (first in, first out)."""
    asked: list[float] = []
    done: list[float] = []
    before_starting, before_running = 0, None
    for t, starting, running in timeline:
        new_running = 0 if before_running is None else max(running - before_running, 0)
        # a replica may start and finish between two polls: counted by the running rise
        asked.extend([t] * max(starting - before_starting + new_running, 0))
        for _ in range(new_running):
            if asked:
                done.append(t - asked.pop(0))
        before_starting, before_running = starting, running
    return done


class ReplicaPoll:
    """serve.status()'s replica states of the worker pool, every `period_s`, in a thread."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.timeline: list[tuple[float, int, int]] = []  # (real s since start, starting, running)
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReplicaPoll:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        from ray import serve

        from cluster.app import WORKER_DEPLOYMENT

        while not self._stop.is_set():
            try:
                states = serve.status().applications[APP].deployments[WORKER_DEPLOYMENT].replica_states
                counts = {str(getattr(state, "value", state)): n for state, n in states.items()}
                starting = counts.get("STARTING", 0) + counts.get("PENDING_MIGRATION", 0)
                self.timeline.append((time.monotonic() - self._t0, starting, counts.get("RUNNING", 0)))
            except Exception:  # the app is not up yet, or is going away
                pass
            self._stop.wait(self.period_s)


def build_planned_app(case: ServeCase) -> Any:
    """cluster/app.py's build_app for the case's config, with ModelLoad as the workers' set-up."""
    from ray import serve

    from cluster.app import (
        INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT, ingress_options, ingress_settings, worker_options,
    )
    from cluster.config import KVServeConfig
    from router.frontend.ingress import Ingress
    from worker.serving.replica import WorkerReplica

    config = KVServeConfig.from_dict(case.kvserve_config())
    worker = serve.deployment(WorkerReplica, name=WORKER_DEPLOYMENT).options(**worker_options(config))
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(**ingress_options(config))
    engine = worker.bind(config.engine_config(), drain_timeout_s=config.workers.drain_timeout_s,
                         setup=ModelLoad(case.startup_s * case.dilation),
                         stream_interval_s=config.workers.stream_interval_ms / 1000)
    return ingress.bind(engine, ingress_settings(config))


def run_on_serve(case: ServeCase, requests: Sequence[SimRequest], log: Callable[[str], None]) -> tuple[list[Any], list]:
    """The trace on a new local Serve cluster: each request's RequestResult and the polled
    replica states."""
    from ray import serve

    from benchmarks import serve_cluster
    from benchmarks.open_loop import replay

    port = serve_cluster.start()
    try:
        t0 = time.monotonic()
        serve.run(build_planned_app(case), name=APP, route_prefix=PREFIX)
        log(f"  cluster up in {time.monotonic() - t0:.0f} s (one worker replica, its model load included)")
        url = f"http://127.0.0.1:{port}{PREFIX}/v1/completions"
        with ReplicaPoll() as poll:
            results = asyncio.run(replay(url, MODEL, requests, case.dilation, 600.0))
        log(f"  replayed in {poll.timeline[-1][0] if poll.timeline else 0.0:.0f} s real; load average "
            f"{os.getloadavg()[0]:.1f}")
        return results, poll.timeline
    finally:
        serve_cluster.stop()


def run_serve_vs_sim(case: ServeCase, log: Callable[[str], None]) -> dict[str, float]:
    """Serve's attainment, the simulator's and their gap (modelled figures)."""
    requests = case.requests()
    d = case.dilation
    log(f"serve_vs_sim: {len(requests)} requests, {case.low_rps:g} <-> {case.high_rps:g} req/s every "
        f"{case.phase_s:g} s x {case.cycles} (modelled), {case.prompt_tokens}-token prompts, "
        f"{case.output_tokens}-token answers, one mixed pool 1..{case.max_replicas}, planner start-up {case.startup_s:g} s, tick "
        f"{case.interval_s:g} s, down after {case.downscale_delay_s:g} s; time dilation {d:g}")
    results, timeline = run_on_serve(case, requests, log)
    failed = [r for r in results if not r.success]
    if failed:
        log(f"  {len(failed)} requests failed on Serve, e.g. {failed[0].error}: {failed[0].error_detail}")
    serve_att = served_attainment(results, d, case.slo.ttft_s, case.slo.itl_s)
    measured = start_ups(timeline)
    startup = (sum(measured) / len(measured) / d) if measured else case.startup_s
    log(f"  Serve: replica start-ups measured {', '.join(f'{s / d:.1f}' for s in measured) or 'none'} s modelled "
        f"(sleep {case.startup_s:g} s + process and engine start); running replicas over modelled time: "
        + " ".join(f"{t / d:.0f}:{n}" for t, _, n in _changes(timeline)))
    sim = simulate(case.sim_config(startup), requests)
    sim_att = attainment(sim, case.slo.ttft_s, case.slo.itl_s)
    log(f"  simulator (replicas starting in {startup:.1f} s): live replicas over time: "
        + " ".join(f"{t:.0f}:{n}" for t, n in sim.replica_count))
    served = [(r.ttft_s / d if r.success and r.ttft_s is not None else None,
               (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) / d
               if r.success and r.ttft_s is not None and r.e2e_s is not None and r.output_tokens > 1 else None)
              for r in results]
    log(f"  serve: {misses(served, case.slo.ttft_s, case.slo.itl_s)}")
    log(f"  sim:   {misses([(r.ttft_s, r.tpot_s) for r in sim.records], case.slo.ttft_s, case.slo.itl_s)}")
    for name, att, cycles in (("serve", serve_att, _cycle_attainment_serve(case, requests, results)),
                              ("sim", sim_att, [attainment(sim, case.slo.ttft_s, case.slo.itl_s, 2 * k * case.phase_s,
                                                           2 * (k + 1) * case.phase_s) for k in range(case.cycles)])):
        log(f"  {name:5s} attainment {att:.3f}; per low+high cycle: {' '.join(f'{a:.3f}' for a in cycles)}")
    return {"serve": serve_att, "sim": sim_att, "gap": abs(serve_att - sim_att), "startup_s": startup}


def _changes(timeline: Sequence[tuple[float, int, int]]) -> list[tuple[float, int, int]]:
    out: list[tuple[float, int, int]] = []
    for point in timeline:
        if not out or point[2] != out[-1][2]:
            out.append(point)
    return out


def _cycle_attainment_serve(case: ServeCase, requests: Sequence[SimRequest], results: Sequence[Any]) -> list[float]:
    out = []
    for k in range(case.cycles):
        lo, hi = 2 * k * case.phase_s, 2 * (k + 1) * case.phase_s
        chosen = [res for req, res in zip(requests, results) if lo <= req.arrival_s < hi]
        out.append(served_attainment(chosen, case.dilation, case.slo.ttft_s, case.slo.itl_s))
    return out
