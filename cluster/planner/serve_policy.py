"""The SLO planner as Ray Serve's autoscaling policy for one worker pool.

Serve instantiates `SLOPlannerPolicy` once per deployment in its controller with
`policy_kwargs` (cluster/slo_config.py builds them: the targets, the planner settings, the
pool's role and engine limits, the step-cost model's shape and profile), then calls it
every autoscaling tick with an AutoscalingContext. Each tick:

  * the workers' totals (record_autoscaling_stats: num_arrived, num_arrived_prompt_tokens,
    num_generated_tokens; their latest raw values, else the look-back aggregate) are
    differenced per replica against the previous tick (a new replica counts from zero);
  * backlog = the replicas' waiting requests + requests queued at handles; running = theirs;
  * a decode pool takes its model's arrivals from the prefill pool's policy (same process);
  * the pool's PoolPlanner (planner.py, as in the simulator) gives the replicas wanted;
  * on a simulated device at time dilation D, the controller's clock is divided by D
    (time_dilation): the planner runs on the modelled clock, as in the simulator;
  * FLEET (one per controller process: every planned pool of every app registers there)
    shares `gpu_budget` across pools by priority (budget.py).
What it returns is undelayed: Serve applies upscale/downscale delays and bounds to it (a
second timer here would fight Serve's, as cluster/autoscaling.py explains).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cluster.autoscaling import NUM_RUNNING, NUM_WAITING, _log_once
from cluster.planner.budget import FleetBudget
from cluster.planner.forecast import Arrivals, Forecaster
from cluster.planner.planner import PoolBounds, PoolObservation, PoolPlanner, decode_arrivals
from cluster.planner.sizing import EngineLimits, PoolSizer
from cluster.planner.targets import PlannerSettings, SLOTargets

COUNTERS = ("num_arrived", "num_arrived_prompt_tokens", "num_generated_tokens")


class ServeFleet(FleetBudget):
    """The controller process's fleet: budget.py's FleetBudget, and each model's latest
    prefill arrivals (its decode pool plans from them)."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_arrivals: dict[str, Arrivals] = {}


FLEET = ServeFleet()


def _latest(ctx: Any, name: str) -> dict[Any, float]:
    """Each replica's latest value of a metric: the raw series' last point where Serve keeps
    them, else the look-back aggregate."""
    out: dict[Any, float] = {}
    try:
        raw = ctx.raw_metrics or {}
    except Exception:  # not every Serve version keeps raw series
        raw = {}
    for replica_id, series in (raw.get(name) or {}).items():
        if series:
            out[replica_id] = float(series[-1].value)
    if not out:
        aggregated: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
        out = {r: float(v) for r, v in (aggregated.get(name) or {}).items() if v is not None}
    return {r: v for r, v in out.items() if math.isfinite(v)}


class SLOPlannerPolicy:
    def __init__(self, role: str, model: str, shape: str, profile: str, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_tokens: int, slo: dict[str, Any], settings: dict[str, Any],
                 scale_to_zero: bool = False, gpus_per_replica: float = 1.0,
                 gpu_budget: float | None = None, time_dilation: float = 1.0) -> None:
        from worker.costs.cost_model import StepCostModel
        from worker.costs.profiles import load_profile
        from worker.costs.shapes import load_shape

        targets, planner_settings = SLOTargets(**slo), PlannerSettings(**settings)
        cost = StepCostModel(load_shape(shape), load_profile(profile))
        sizer = PoolSizer(cost, EngineLimits(max_num_seqs, max_num_batched_tokens, kv_tokens), targets,
                          planner_settings)
        if time_dilation <= 0:
            raise ValueError(f"time_dilation must be > 0, got {time_dilation}")
        # A simulated device at time dilation D runs D real seconds per modelled second: the
        # planner's clock (its tick, start-up horizon and arrival rates) is the modelled one.
        self.time_dilation = time_dilation
        self.scale_to_zero = scale_to_zero
        self.gpus_per_replica = gpus_per_replica
        self.gpu_budget = gpu_budget
        self.planner = PoolPlanner(model, role, sizer, Forecaster(planner_settings), priority=targets.priority)
        self._totals: dict[Any, tuple[float, ...]] = {}
        self._last_time: float | None = None
        self._decision: int | None = None

    def observe(self, ctx: Any, now: float) -> PoolObservation:
        latest = {name: _latest(ctx, name) for name in COUNTERS}
        sums = [0.0, 0.0, 0.0]
        totals: dict[Any, tuple[float, ...]] = {}
        for replica_id in latest[COUNTERS[0]]:
            values = tuple(latest[name].get(replica_id, 0.0) for name in COUNTERS)
            before = self._totals.get(replica_id, (0.0, 0.0, 0.0))
            for i, (v, b) in enumerate(zip(values, before)):
                sums[i] += max(v - b, 0.0)  # a restarted engine counts from zero again
            totals[replica_id] = values
        self._totals = totals
        dt = now - self._last_time if self._last_time is not None else 0.0
        self._last_time = now
        waiting = sum(_latest(ctx, NUM_WAITING).values())
        try:
            queued = float(ctx.total_queued_requests or 0.0)
        except Exception:  # not every Serve version tracks handle queues
            queued = 0.0
        return PoolObservation(Arrivals(dt, *sums), waiting + queued, sum(_latest(ctx, NUM_RUNNING).values()))

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = (float(ctx.current_time) if ctx.current_time is not None else 0.0) / self.time_dilation
        # Serve calls every control-loop turn; the forecast's history is one point per interval.
        interval = self.planner.forecaster.settings.interval_s
        if self._decision is not None and self._last_time is not None and now - self._last_time < interval:
            return self._decision, {}
        minimum = int(ctx.capacity_adjusted_min_replicas)
        maximum = max(int(ctx.capacity_adjusted_max_replicas), 1)
        self.planner.bounds = PoolBounds(minimum if self.scale_to_zero else max(1, minimum), maximum,
                                         self.scale_to_zero, self.gpus_per_replica)
        observation = self.observe(ctx, now)
        model, role = self.planner.model, self.planner.role
        if role == "prefill":
            FLEET.prefill_arrivals[model] = observation.arrivals
        elif role == "decode" and model in FLEET.prefill_arrivals:
            arrivals = decode_arrivals(FLEET.prefill_arrivals[model], observation.arrivals)
            observation = replace(observation, arrivals=arrivals)
        self.planner.observe(observation)
        wanted = self.planner.wanted(observation)
        try:
            self._decision = FLEET.grant(self.planner.demand(wanted), self.gpu_budget)
        except Exception as e:  # pragma: no cover - the budget must never stop scaling
            _log_once(f"SLO planner budget unavailable: {type(e).__name__}: {e}")
            self._decision = wanted
        return self._decision, {}


