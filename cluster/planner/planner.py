"""One pool's planning decision, the same in Ray Serve (serve_policy.py) and in the
simulator (cluster/sim/planner.py):

    observe   what arrived since the last tick (forecast.py); a disaggregated decode pool
              the model's arrivals, as its prefill pool saw them (decode_arrivals)
    wanted    max(replicas for the load now, the backlog drained within the horizon and
                  the decodes running now,
                  replicas for the most load forecast before a replica started now is ready)
              (sizing.py, for the pool's role), at least 1 while requests run or wait, at least
              min_replicas, and 0 only with scale_to_zero when under half a request is
              expected before a replica could start
    budget    the GPU budget shared across models may grant fewer (budget.py)
    delays    cluster/autoscaling.py's apply_delays: up at once, down once wanted for the
              downscale delay (under Serve, Serve applies its own delays instead)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.autoscaling import Bounds, apply_delays
from cluster.planner.budget import PoolDemand
from cluster.planner.forecast import Arrivals, Forecaster, Load
from cluster.planner.sizing import PoolSizer


@dataclass(frozen=True)
class PoolObservation:
    """A pool's state at a planner tick."""

    arrivals: Arrivals  # since the previous tick
    backlog: float = 0.0  # requests waiting at the pool's replicas and in handle queues
    running: float = 0.0  # requests running on its replicas


def decode_arrivals(prefill: Arrivals, decode: Arrivals) -> Arrivals:
    """What a disaggregated model's decode pool plans from: the MODEL's arrivals (the prefill
    pool's: a decode pool sees a request only once its prefill is done, so while prefill is
    the bottleneck its own arrivals understate the load coming) with the decode pool's
    generated tokens over its own arrivals (the answers' length: the requests still queued
    for prefill have not started theirs)."""
    return Arrivals(decode.dt_s, prefill.num_requests, prefill.prompt_tokens, decode.output_tokens,
                    num_answering=decode.num_requests)


@dataclass(frozen=True)
class PoolBounds:
    min_replicas: int = 1
    max_replicas: int = 16
    scale_to_zero: bool = False
    gpus_per_replica: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("pool bounds need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.min_replicas == 0 and not self.scale_to_zero:
            raise ValueError("min_replicas 0 needs scale_to_zero")


@dataclass
class PoolPlanner:
    """Plans one pool of one model (its role is the sizer's formula)."""

    model: str
    role: str
    sizer: PoolSizer
    forecaster: Forecaster
    bounds: PoolBounds = PoolBounds()
    priority: int = 0
    delay_state: dict[str, Any] = field(default_factory=dict)
    last_load: Load | None = None  # the forecast the last decision sized for

    def observe(self, observation: PoolObservation) -> None:
        self.forecaster.observe(observation.arrivals)

    def wanted(self, observation: PoolObservation) -> int:
        """Replicas the pool should have now, within its bounds, before the budget."""
        horizon = self.forecaster.settings.horizon_s
        now, peak = self.forecaster.now(), self.forecaster.peak(horizon)
        self.last_load = peak
        replicas = max(self.sizer.replicas(self.role, now, observation.backlog, observation.running, horizon),
                       self.sizer.replicas(self.role, peak))
        busy = observation.backlog > 0 or observation.running > 0
        if self.bounds.scale_to_zero and not busy and peak.rate * horizon < 0.5:
            return self.bounds.min_replicas  # idle: under half a request before a replica could start
        return min(max(replicas, 1, self.bounds.min_replicas), self.bounds.max_replicas)

    def demand(self, wanted: int) -> PoolDemand:
        minimum = self.bounds.min_replicas if self.bounds.scale_to_zero else max(1, self.bounds.min_replicas)
        return PoolDemand(self.model, self.role, wanted, minimum, self.bounds.gpus_per_replica, self.priority)

    def delayed(self, granted: int, current: int, now: float, upscale_delay_s: float = 0.0) -> int:
        """`granted` after the delays (for callers without Serve's own)."""
        bounds = Bounds(self.bounds.min_replicas, self.bounds.max_replicas, upscale_delay_s,
                        self.forecaster.settings.downscale_delay_s)
        replicas, self.delay_state = apply_delays(granted, current, now, self.delay_state, bounds)
        return replicas
