"""The SLO planner's section of a worker pool's autoscaling (`workers.autoscaling.slo`, or a
disaggregated pool's): the model's TTFT / ITL targets, each at a percentile, its priority
for a shared GPU budget, and how far ahead to plan. Setting it makes the SLO planner
(cluster/planner/serve_policy.py) the pool's policy; without it, the queue-depth policy
(cluster/autoscaling.py) stays the default.

The planner prices steps with the step-cost model, so it needs the device's profile and
the model's shape: a simulated device's (engine.device sim:<profile>, engine.model_shape),
or engine.step_time_profile and the model's config.json on a real one.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pydantic import Field

from cluster.config_fields import Section, default_of
from cluster.planner.targets import PlannerSettings, SLOTargets

if TYPE_CHECKING:
    from cluster.config import EngineSection

PLANNER_POLICY = "cluster.planner.serve_policy:SLOPlannerPolicy"


class SLOSection(Section):
    ttft_ms: float = Field(default_of(SLOTargets, "ttft_s") * 1000.0, gt=0)
    itl_ms: float = Field(default_of(SLOTargets, "itl_s") * 1000.0, gt=0)
    ttft_percentile: float = Field(default_of(SLOTargets, "ttft_percentile"), gt=0, lt=100)
    itl_percentile: float = Field(default_of(SLOTargets, "itl_percentile"), gt=0, lt=100)
    priority: int = default_of(SLOTargets, "priority")  # higher keeps its replicas when the budget binds
    # A new replica's start-up (model load) time: the planner sizes for the load it
    # forecasts until a replica started now would be ready.
    startup_s: float = Field(default_of(PlannerSettings, "startup_s"), ge=0)
    interval_s: float = Field(default_of(PlannerSettings, "interval_s"), gt=0)  # the planner's tick
    headroom: float = Field(default_of(PlannerSettings, "headroom"), gt=0, le=1)  # plan for this share of each target
    # GPUs every planned pool in the cluster shares (None: no limit).
    gpu_budget: float | None = Field(None, gt=0)

    def targets(self) -> SLOTargets:
        return SLOTargets(self.ttft_ms / 1000.0, self.itl_ms / 1000.0, self.ttft_percentile, self.itl_percentile,
                          self.priority)

    def settings(self, interval_s: float | None = None) -> PlannerSettings:
        return PlannerSettings(startup_s=self.startup_s, interval_s=interval_s or self.interval_s,
                               headroom=self.headroom)


def cost_model_names(engine: EngineSection, model_path: str) -> tuple[str, str]:
    """(shape, profile) the planner prices steps with; a ValueError says what is missing."""
    if engine.device.startswith("sim:"):
        return engine.model_shape or "llama-3-8b", engine.device.removeprefix("sim:")
    if engine.step_time_profile is None:
        raise ValueError("the SLO planner (autoscaling.slo) needs a step-cost profile: set engine.step_time_profile "
                         "(kvserve calibrate fits one) or run on a simulated device (engine.device: sim:<profile>)")
    return f"{model_path.rstrip('/')}/config.json", engine.step_time_profile


def planner_policy_kwargs(slo: SLOSection, role: str, model: str, engine: EngineSection, model_path: str,
                          scale_to_zero: bool, gpus_per_replica: float, interval_s: float) -> dict[str, Any]:
    """SLOPlannerPolicy's constructor arguments (JSON-serialisable, as Serve requires)."""
    from worker.costs.cost_model import StepCostModel
    from worker.costs.profiles import load_profile
    from worker.costs.shapes import load_shape

    shape, profile = cost_model_names(engine, model_path)
    if engine.num_blocks is not None:
        kv_tokens = engine.num_blocks * engine.block_size
    else:
        cost = StepCostModel(load_shape(shape), load_profile(profile))
        kv_tokens = cost.num_kv_blocks(engine.block_size, engine.gpu_memory_utilization) * engine.block_size
    return {
        "role": role, "model": model, "shape": shape, "profile": profile,
        "max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
        "kv_tokens": kv_tokens, "slo": dataclasses.asdict(slo.targets()),
        "settings": dataclasses.asdict(slo.settings(interval_s)), "scale_to_zero": scale_to_zero,
        "gpus_per_replica": gpus_per_replica, "gpu_budget": slo.gpu_budget,
        "time_dilation": engine.time_dilation if engine.device.startswith("sim:") else 1.0,
    }
