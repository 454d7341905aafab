"""What one simulation runs on: its frozen SimConfig (the cluster, the router, the engine
and the workload's knobs) and the SimDevice (the simulated device's runner, KV pool and
links) built from it. cluster/sim/run.py runs them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.config import WorkersSection
from cluster.sim.autoscale import AutoscaleOptions
from cluster.sim.disagg import DisaggOptions
from cluster.sim.planner import SimPlannerOptions
from cluster.sim.tiers import SimTierOptions
from router.routing.types import RoutingParams
from worker.config import CacheConfig, SchedulerConfig
from worker.costs.shapes import ModelShape

_SCHEDULER = SchedulerConfig()
_CACHE = CacheConfig()
# Policies built on a RoutingView (router/routing/routing_view.py), which SimConfig.shared_view can share.
VIEW_POLICIES = frozenset({"headroom"})


@dataclass(frozen=True)
class SimConfig:
    shape: str = "llama-3-8b"  # worker/sim/shapes name, or a config.json path
    profile: str = "h200"  # worker/sim/profiles name, or a profile JSON path
    num_replicas: int = 8  # the mixed pool (ignored when disaggregated)
    router: str = "round_robin"  # router.routing.policies.POLICY_NAMES
    policy_params: RoutingParams | None = None  # None: defaults, with this config's period and lag
    # The policy's own options (router.routing.policies.make_policy's **options, e.g. sticky's
    # prefill_tokens_per_s), as (name, value) pairs so the config stays frozen and hashable.
    policy_options: tuple[tuple[str, Any], ...] = ()
    # The request path outside the engine that a real cluster adds before the router's
    # decision: HTTP proxy -> ingress -> Serve dispatch (and the first token's way back,
    # lumped in here). Each request reaches its ingress router this long after its arrival;
    # TTFT and E2E still count from the arrival. 0: not modelled. A MEASURED input (see
    # benchmarks/routing/validate_cluster.py), never fitted to a result.
    dispatch_latency_s: float = 0.0
    # The same path as a measured distribution (seconds, e.g. a calibration run's per-request
    # residuals): each request's latency is drawn from these, seeded by `seed`, instead of
    # the constant. The path is right-skewed, and a TTFT p50 shifts by more than the path's median when the engine's TTFT spreads.
    dispatch_latency_samples: tuple[float, ...] = ()
    num_ingress: int = 1
    # Several ingress routers: True gives every router of a pool the SAME routing view (the
    # unreflected work and prefix hints they all promised: what Redis shares in a real
    # deployment, cluster/sim/shared_view.py), False a private one each (each router sees
    # only its own dispatches: the herding failure). Only policies that read a view
    # (headroom) can share one.
    shared_view: bool = False
    shared_view_rtt_s: float = 0.0  # a shared view's writes reach the others this much later (Redis RTT)
    ingress_assignment: str = "round_robin"  # or "session": a session always uses one router
    stats_period_s: float = 1.0
    report_lag_s: float = 0.05  # a report reaches the routers this long after it is taken
    max_ongoing_requests: int = WorkersSection.model_fields["max_ongoing_requests"].default
    block_size: int = _CACHE.block_size
    max_num_seqs: int = _SCHEDULER.max_num_seqs
    max_num_batched_tokens: int = _SCHEDULER.max_num_batched_tokens
    max_step_time_s: float | None = None  # the engines' step-time budget (worker/scheduling/step_budget.py)
    max_model_len: int = 0  # 0: the shape's max_position_embeddings
    gpu_memory_utilization: float = _CACHE.gpu_memory_utilization
    num_blocks: int | None = None  # overrides the KV size the cost model derives
    kv_cache_dtype: str = _CACHE.kv_cache_dtype  # "fp8": one byte per KV element (half of bf16's)
    enable_prefix_caching: bool = True
    # KV kept across a session's pauses on every replica (CacheConfig's fields, kv/retention.py;
    # 0: off, plain LRU as vLLM and SGLang evict).
    session_kv_ttl_s: float = _CACHE.session_kv_ttl_s
    session_kv_max_share: float = _CACHE.session_kv_max_share
    lora: SimLoRA | None = None  # LoRA adapters on every replica (cluster/sim/lora.py); None: base model only
    disagg: DisaggOptions = field(default_factory=DisaggOptions)
    tiers: SimTierOptions = field(default_factory=SimTierOptions)  # KV tiers below each device (off by default)
    # Prefix hashes a replica's KV snapshot carries per tier (device, host, disk): the
    # worker's cap (None). Routers score from the index the KV events keep; the snapshot
    # counts only where the index rebuilds (a router's first report, a gap).
    max_report_hashes: int | None = None
    # Speculative decoding on every replica (worker/sim/spec.py): draft tokens per decode row
    # (0: off) and the workload's chance that each draft is accepted.
    spec_num_tokens: int = 0
    spec_acceptance: float = 0.0
    autoscale: AutoscaleOptions | None = None
    # The SLO planner (cluster/sim/planner.py) sizes the pools instead of `autoscale`.
    planner: SimPlannerOptions | None = None
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 100.0
    # End the run as soon as enough requests missed the TTFT SLO that its TTFT p99 misses it
    # whatever the rest do (metrics.late_requests_proving_p99_miss): a rate search needs
    # only the verdict, and an overloaded run is the most expensive one to finish.
    stop_at_slo_miss: bool = False
    keep_token_times: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.spec_num_tokens < 0 or not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError(f"spec_num_tokens must be >= 0 and spec_acceptance in [0, 1], got "
                             f"{self.spec_num_tokens} and {self.spec_acceptance}")
        if self.num_replicas < 1 and not self.disagg.enabled:
            raise ValueError("num_replicas must be >= 1")
        if self.num_ingress < 1:
            raise ValueError("num_ingress must be >= 1")
        if self.ingress_assignment not in ("round_robin", "session"):
            raise ValueError("ingress_assignment must be 'round_robin' or 'session'")
        if self.stats_period_s <= 0 or self.report_lag_s < 0:
            raise ValueError("stats_period_s must be > 0 and report_lag_s >= 0")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        if self.dispatch_latency_s < 0 or any(x < 0 for x in self.dispatch_latency_samples):
            raise ValueError("dispatch_latency_s and dispatch_latency_samples must be >= 0")
        if self.shared_view_rtt_s < 0:
            raise ValueError("shared_view_rtt_s must be >= 0")
        if self.lora is not None and self.disagg.enabled:
            raise ValueError("LoRA adapters are not simulated with disaggregated pools (the KV export does not "
                             "carry the adapter)")
        if self.autoscale is not None and self.planner is not None:
            raise ValueError("autoscale and planner both size the pools: choose one")
        if self.shared_view and self.router not in VIEW_POLICIES:
            raise ValueError(f"shared_view needs a policy that reads a routing view {sorted(VIEW_POLICIES)}, "
                             f"not {self.router!r}")

    def routing_params(self) -> RoutingParams:
        if self.policy_params is not None:
            return self.policy_params
        return RoutingParams(stats_period_s=self.stats_period_s, report_lag_s=self.report_lag_s)


@dataclass(frozen=True)
class SimDevice:
    """What the simulator needs of the simulated device: the runner to hand each engine
    (its `last_step_s` is the modelled time of the step it just ran), the KV pool size, the vocabulary and the KV bytes a token
    takes (for transfers). `from_config` builds it from worker/sim (shape + profile)."""

    make_runner: Callable[[int], Any]  # num_blocks -> runner (num_blocks, execute(plan), last_step_s)
    num_blocks: int
    vocab_size: int
    kv_bytes_per_token: int
    max_model_len: int
    # What LoRA adapters' loads are priced from (cluster/sim/lora.py): None where unknown.
    shape: ModelShape | None = None
    host_to_device_bytes_per_s: float | None = None
    # Effective bytes/s of the links below the device (KV tiers); 0: the profile has none.
    host_link_bandwidth: float = 0.0
    disk_read_bandwidth: float = 0.0

    @classmethod
    def from_config(cls, config: SimConfig) -> SimDevice:
        from worker.costs.cost_model import StepCostModel
        from worker.costs.profiles import load_profile
        from worker.sim.runner import SimRunner
        from worker.costs.shapes import load_shape

        shape, profile = load_shape(config.shape), load_profile(config.profile)
        if config.kv_cache_dtype == "fp8":  # worker/attention/kv_quant.py's e4m3 pool
            shape = replace(shape, kv_dtype_bytes=1)
        cost = StepCostModel(shape, profile)
        num_blocks = config.num_blocks or cost.num_kv_blocks(config.block_size, config.gpu_memory_utilization)
        return cls(
            make_runner=lambda n: SimRunner(cost, n, config.block_size, shape.vocab_size, sleep=False,
                                            spec_acceptance=config.spec_acceptance),
            num_blocks=num_blocks,
            vocab_size=shape.vocab_size,
            kv_bytes_per_token=shape.kv_bytes_per_token(),
            max_model_len=shape.max_position_embeddings,
            shape=shape,
            host_to_device_bytes_per_s=profile.host_link_bandwidth,
            host_link_bandwidth=profile.effective_host_link_bandwidth,
            disk_read_bandwidth=profile.effective_disk_read_bandwidth,
        )
