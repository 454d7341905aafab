"""The worker-pool sections of the user's config: replicas, resources, autoscaling.

Part of the one schema (cluster/config.py). The autoscaling policy's own settings are
`cluster.autoscaling.PoolTargets` (a frozen dataclass, with their defaults); the section
takes its defaults from there and hands them back through `build`.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator

from cluster.autoscaling import PoolTargets, Role
from cluster.config_fields import Section, build, default_of
from cluster.slo_config import PLANNER_POLICY, SLOSection
from worker.config import ModelConfig

# kvserve's policy (cluster/autoscaling.py), by either of its import paths; both run as the
# class, which Serve instantiates with PoolTargets' fields as `policy_kwargs`.
KVSERVE_POLICY = "cluster.autoscaling:QueueDepthPolicy"
KVSERVE_POLICIES = (KVSERVE_POLICY, "cluster.autoscaling:queue_depth_policy")
# QueueDepthPolicy's constructor arguments: the fields of PoolTargets.
KVSERVE_POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(PoolTargets))

# Serve's autoscaling timing: the same defaults for the worker pools and the ingress (the
# two sections below; cluster/app.py's serve_autoscaling_config hands either to Serve).
UPSCALE_DELAY_S = 10.0
DOWNSCALE_DELAY_S = 120.0
LOOK_BACK_PERIOD_S = 30.0
# Serve's own default for AutoscalingConfig.metrics_interval_s: cluster/app.py passes the
# field only when it differs, since Serve warns on any explicit value.
METRICS_INTERVAL_S = 10.0


class AutoscalingSection(Section):
    min_replicas: int = Field(1, ge=0)  # 0 only with scale_to_zero: true
    max_replicas: int = Field(4, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    # -- kvserve's queue-depth / KV-usage policy (cluster/autoscaling.py:QueueDepthPolicy).
    # mixed/decode pools size on waiting requests, prefill pools on waiting prompt tokens;
    # every pool also on KV usage.
    role: Role = default_of(PoolTargets, "role")
    target_waiting_per_replica: float = Field(default_of(PoolTargets, "target_waiting_per_replica"), gt=0)
    target_waiting_prompt_tokens_per_replica: float = Field(
        default_of(PoolTargets, "target_waiting_prompt_tokens_per_replica"), gt=0)
    # used/all KV blocks per replica, mean
    kv_usage_ceiling: float = Field(default_of(PoolTargets, "kv_usage_ceiling"), gt=0, le=1)
    # Let an idle pool go to zero replicas (then a request waits for a model load).
    scale_to_zero: bool = default_of(PoolTargets, "scale_to_zero")
    # -- Serve's built-in policy (`policy: serve`) aims at this many ongoing requests per replica.
    target_ongoing_requests: float = Field(64.0, gt=0)
    # -- Timing, applied by Serve to whichever policy runs. A change happens once it has been
    # wanted continuously for the delay; metrics are averaged over look_back_period_s.
    upscale_delay_s: float = Field(UPSCALE_DELAY_S, ge=0)
    downscale_delay_s: float = Field(DOWNSCALE_DELAY_S, ge=0)
    # Serve warns (and will refuse in a later release) unless this exceeds metrics_interval_s.
    look_back_period_s: float = Field(LOOK_BACK_PERIOD_S, gt=0)
    # How often replicas (and handles) push their stats to Serve's controller. Ray 2.60 reads
    # this AutoscalingConfig field (deprecated); its successor environment variable
    # RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S is defined but not read.
    metrics_interval_s: float = Field(METRICS_INTERVAL_S, gt=0)
    # The scaling policy, "module:function_or_class". Default: kvserve's policy above;
    # "serve": Serve's built-in policy; anything else: a custom policy, given policy_kwargs
    # (when it is a class). For kvserve's policy, policy_kwargs may carry the typed fields
    # above instead (they are moved there).
    policy: str = KVSERVE_POLICY
    policy_kwargs: dict[str, Any] = Field(default_factory=dict)
    # TTFT / ITL targets: with them, the SLO planner (cluster/planner/) sizes this pool in
    # place of the queue-depth policy (unless `policy` names another one).
    slo: SLOSection | None = None

    @model_validator(mode="before")
    @classmethod
    def _lift_policy_kwargs(cls, data: Any) -> Any:
        """`policy_kwargs: {role: decode}` for kvserve's policy -> `role: decode`."""
        if not isinstance(data, dict) or data.get("policy", KVSERVE_POLICY) not in KVSERVE_POLICIES:
            return data
        kwargs = data.get("policy_kwargs") or {}
        if not isinstance(kwargs, dict) or not kwargs:
            return data
        unknown = sorted(set(kwargs) - set(KVSERVE_POLICY_FIELDS))
        if unknown:
            raise ValueError(f"policy_kwargs {unknown} are not settings of kvserve's policy "
                             f"(known: {', '.join(KVSERVE_POLICY_FIELDS)})")
        data = dict(data)
        for key, value in kwargs.items():
            if key in data and data[key] != value:
                raise ValueError(f"{key} is set twice, as {data[key]!r} and in policy_kwargs as {value!r}")
            data[key] = value
        data["policy_kwargs"] = {}
        return data

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        if self.min_replicas == 0 and not self.scale_to_zero:
            raise ValueError("min_replicas 0 needs scale_to_zero: true (an idle pool then has no "
                             "replica, and the next request waits for a model load)")
        if self.policy != "serve" and ":" not in self.policy:
            raise ValueError(f"policy must be 'module:function' or 'serve', got {self.policy!r}")
        return self

    def uses_kvserve_policy(self) -> bool:
        return self.policy in KVSERVE_POLICIES and self.slo is None

    def uses_planner(self) -> bool:
        return self.slo is not None and self.policy in (*KVSERVE_POLICIES, PLANNER_POLICY)

    def pool_targets(self) -> PoolTargets:
        return build(PoolTargets, self)

    def kvserve_policy_kwargs(self) -> dict[str, Any]:
        """QueueDepthPolicy's constructor arguments (JSON-serialisable, as Serve requires)."""
        return dataclasses.asdict(self.pool_targets())


class IngressAutoscalingSection(Section):
    """The ingress deployment's own scaling: Serve's built-in policy on ongoing requests
    (streams, weighted by nothing: each HTTP/gRPC call is one) per ingress replica. The
    ingress does no engine work; what fills it is open streams, whatever the pools do."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    # Streams one ingress replica carries on average before another is added; keep it
    # well under ingress.max_queued_requests (the 429 bound).
    target_ongoing_requests: float = Field(256.0, gt=0)
    upscale_delay_s: float = Field(UPSCALE_DELAY_S, ge=0)
    downscale_delay_s: float = Field(DOWNSCALE_DELAY_S, ge=0)
    look_back_period_s: float = Field(LOOK_BACK_PERIOD_S, gt=0)
    metrics_interval_s: float = Field(METRICS_INTERVAL_S, gt=0)  # as AutoscalingSection's

    @model_validator(mode="after")
    def _bounds(self) -> IngressAutoscalingSection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


def custom_resources(v: dict[str, float]) -> dict[str, float]:
    """Check a Ray custom-resource map (workers' and the ingress's `resources`)."""
    for name, amount in v.items():
        if name.upper() in ("CPU", "GPU", "MEMORY"):
            raise ValueError(f"{name!r} is not a custom resource; use num_cpus / num_gpus")
        if amount < 0:
            raise ValueError(f"resource {name!r}: amount must be >= 0, got {amount}")
    return v


# A section's Ray custom-resource map (workers' and the ingress's `resources`), checked.
CustomResources = Annotated[dict[str, float], AfterValidator(custom_resources)]


class WorkersSection(Section):
    num_replicas: int = Field(1, ge=1)
    # A batching engine wants many requests at once (Serve's default of 5 starves it).
    max_ongoing_requests: int = Field(256, ge=1)
    # Per replica resources; a tensor-parallel replica's total, split evenly over its ranks.
    # None: 1 CPU per rank; 1 GPU per rank when the engine runs on CUDA.
    num_cpus: float | None = Field(None, ge=0)
    num_gpus: float | None = Field(None, ge=0)
    # Custom Ray resources per rank (per replica without tensor parallelism), e.g.
    # {kvserve_pool_decode: 1} to pin a pool to the nodes that advertise it (the Helm chart
    # sets this from its pools' roles).
    resources: CustomResources = Field(default_factory=dict)
    tensor_parallel_size: int = Field(default_of(ModelConfig, "tensor_parallel_size"), json_schema_extra={"minimum": 1})
    autoscaling: AutoscalingSection | None = None
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    # A replica Serve removes (scale-down, redeploy, shutdown) gets this long to finish its
    # running requests before it is killed (Serve's graceful_shutdown_timeout_s); requests
    # still running then are cut, and the ingress resumes them on another replica
    # (ingress.max_migrations). It also bounds how long a scale-down or shutdown takes.
    drain_timeout_s: float = Field(60.0, ge=0)
    # Outputs leave a worker replica at most this often per ingress replica, each request's
    # tokens in between in one piece (worker/outputs/streams.py); a request's first token
    # and its end leave at once. Streaming clients then get a chunk per interval rather than
    # per token when steps are faster; 0: every step's outputs as they come.
    stream_interval_ms: float = Field(50.0, ge=0)

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp_is_positive(cls, v: int) -> int:
        # Whether the model's heads split over v ranks is checked when the engine loads it.
        if v < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        return v
