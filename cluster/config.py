"""The one user-facing configuration schema of kvserve.

The same `KVServeConfig` is read by the CLI (`kvserve serve --config FILE`), by
`serve run cluster.app:app_builder` / a serveConfigV2 `args:` block (the application
builder validates its args with it), and by the Helm chart (which renders its values into
those args). It is the edge of the system, so it is pydantic with `extra="forbid"`;
inside, each layer owns frozen dataclasses (the engine's `worker.config.EngineConfig`, the
ingress's `router.frontend.settings.IngressSettings`, the router's `router.routing.types.RoutingParams`,
...). A section field that configures one of them takes its default from it, and the
dataclass is built from the section by one mapping (cluster/config_fields.py): no default
is written twice.

A minimal YAML file:

    model: /models/Llama-3.2-1B-Instruct     # or a Hub id, or omitted (embedded default)
    workers: {num_replicas: 2}

Every section and field is optional; unknown keys are errors that name the closest
known key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from cluster.config_errors import ConfigError, format_validation_error
from cluster.config_fields import ByteSize, OrString, Section, build, default_of, parse_bytes
from cluster.ingress_config import IngressSection, StateSection
from cluster.listen_config import GRPCSection, HTTPSection
from cluster.lora_config import LoRASection
from cluster.speculative_config import SpeculativeSection
from cluster.pool_config import (  # noqa: F401 -- re-exported: part of the one schema
    KVSERVE_POLICIES,
    KVSERVE_POLICY,
    KVSERVE_POLICY_FIELDS,
    AutoscalingSection,
    WorkersSection,
)
from cluster.state_store import RedisStoreSpec
from cluster.tracing import ObservabilitySection
from router.routing.redis_view import SharedViewSpec
from router.frontend.responses_api.store import ResponseStoreSpec
from router.routing.types import RoutingParams
from router.frontend.settings import MAX_WAITING_FOR_DECODE, IngressSettings
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

__all__ = [
    "AutoscalingSection", "ConfigError", "KVServeConfig", "WorkersSection", "parse_bytes",
    "KVSERVE_POLICY", "KVSERVE_POLICIES", "KVSERVE_POLICY_FIELDS",
]

# EngineSection.num_blocks is CacheConfig.num_blocks_override.
_CACHE_RENAMES = {"num_blocks_override": "num_blocks"}
# StateSection.redis_password_env is RedisStoreSpec.password_env.
_REDIS_RENAMES = {"password_env": "redis_password_env"}


class ModelSection(Section):
    # A local directory or .gguf file, or a Hugging Face Hub id. None: the embedded default model.
    path: str | None = None
    # The `model` name clients send. Default: the directory's (file's) name for a local path, the
    # id for a Hub id, "kvserve-tiny" for the embedded default.
    served_model_name: str | None = None
    trust_remote_code: bool = default_of(ModelConfig, "trust_remote_code")
    seed: int = Field(default_of(ModelConfig, "seed"), ge=0)

    def resolved_path(self) -> str:
        if self.path is not None:
            return self.path
        from worker.default_model import default_model_path

        return default_model_path()

    def resolved_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.path is None:
            from worker.default_model import DEFAULT_MODEL_NAME

            return DEFAULT_MODEL_NAME
        from worker.model_path import is_hub_id  # the workers' rule for the same value

        if is_hub_id(self.path):
            return self.path  # e.g. "meta-llama/Llama-3.2-1B"
        return Path(self.path).expanduser().resolve().name


class EngineSection(Section):
    """The engine's settings: fields of worker.config's ModelConfig, CacheConfig and
    SchedulerConfig (defaults there), with the bounds a user's value must respect."""

    block_size: int = Field(default_of(CacheConfig, "block_size"), gt=0, le=256)
    # CPU: the KV tensors get exactly this many bytes ("256MiB" style accepted).
    kv_cache_bytes: ByteSize = Field(default_of(CacheConfig, "kv_cache_bytes"), gt=0)
    # GPU: the KV budget as a fraction of the device's memory.
    gpu_memory_utilization: float = Field(default_of(CacheConfig, "gpu_memory_utilization"), gt=0.0, le=1.0)
    # An exact number of KV blocks (tests, capacity experiments); overrides both budgets.
    num_blocks: int | None = Field(default_of(CacheConfig, "num_blocks_override"), gt=0)
    max_num_seqs: int = Field(default_of(SchedulerConfig, "max_num_seqs"), ge=1)
    max_num_batched_tokens: int = Field(default_of(SchedulerConfig, "max_num_batched_tokens"), ge=1)
    # An ITL target: a step carrying decodes takes no more prefill tokens than keep its
    # predicted time within this (worker/scheduling/step_budget.py). A real device predicts with
    # step_time_profile; a simulated one with its own cost model.
    max_step_time_s: float | None = Field(default_of(SchedulerConfig, "max_step_time_s"), gt=0)
    step_time_profile: str | None = default_of(ModelConfig, "step_time_profile")
    # While a better priority band is in use on a replica, worse bands' prompt chunks get
    # at most this many tokens per step together (worker/scheduling/band_prefill.py); 0: no limit.
    worse_band_prefill_tokens: int = Field(default_of(SchedulerConfig, "worse_band_prefill_tokens"), ge=0)
    # None: the model's context length, capped by what the KV cache holds.
    max_model_len: int | None = Field(default_of(SchedulerConfig, "max_model_len"), ge=2)
    enable_prefix_caching: bool = default_of(CacheConfig, "enable_prefix_caching")
    # KV tiers below the device (docs/kv-tiers.md): host memory for evicted prefix blocks
    # (0: none), and an optional local directory under it with its byte bound.
    host_kv_cache_bytes: ByteSize = Field(default_of(CacheConfig, "host_kv_cache_bytes"), ge=0)
    disk_kv_cache_dir: str | None = default_of(CacheConfig, "disk_kv_cache_dir")
    disk_kv_cache_bytes: ByteSize = Field(default_of(CacheConfig, "disk_kv_cache_bytes"), gt=0)
    # A directory every replica mounts (a shared volume): a replica loads prefix blocks
    # another one computed.
    shared_kv_store_dir: str | None = default_of(CacheConfig, "shared_kv_store_dir")
    shared_kv_store_bytes: ByteSize = Field(default_of(CacheConfig, "shared_kv_store_bytes"), gt=0)
    # The env var holding the key that authenticates the tiers' entries (required with a
    # shared store; the chart fills it from kvTiers.sharedStore.keySecret).
    kv_store_key_env: str = default_of(CacheConfig, "kv_store_key_env")
    # A disk-tier call slower than this is given up; the replica reports itself unhealthy.
    tier_io_timeout_s: float = Field(default_of(CacheConfig, "tier_io_timeout_s"), gt=0)
    # KV kept across a session's pauses (x-session-id): a finished turn's blocks are kept
    # this long (0: off), evicted last, at most this share of the pool (kv/retention.py).
    session_kv_ttl_s: float = Field(default_of(CacheConfig, "session_kv_ttl_s"), ge=0)
    session_kv_max_share: float = Field(default_of(CacheConfig, "session_kv_max_share"), gt=0.0, le=1.0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = default_of(ModelConfig, "dtype")
    # The KV pool's element type: auto (the model's dtype) or fp8 (e4m3: half of bf16's bytes).
    kv_cache_dtype: Literal["auto", "fp8"] = default_of(CacheConfig, "kv_cache_dtype")
    # auto | cpu | cuda | sim:<profile> (a simulated device, worker/sim/: h200, h100,
    # a100-80gb, l4, a fitted profile's name or a JSON path; no weights are loaded, the
    # model directory only gives the tokenizer).
    device: str = default_of(ModelConfig, "device")
    # sim device: a named shape (llama-3-8b, ...) or a config.json
    model_shape: str | None = default_of(ModelConfig, "model_shape")
    # sim device: wall seconds per modelled second
    time_dilation: float = Field(default_of(ModelConfig, "time_dilation"), gt=0)
    attention_backend: Literal["auto", "torch", "flash", "triton"] = default_of(ModelConfig, "attention_backend")
    # CUDA only: decode steps replayed as CUDA graphs.
    enable_cuda_graphs: bool = default_of(ModelConfig, "enable_cuda_graphs")
    # torch CPU threads per worker
    num_threads: int | None = Field(default_of(ModelConfig, "num_threads"), ge=1)
    # Speculative decoding, off by default (cluster/speculative_config.py).
    speculative: SpeculativeSection = SpeculativeSection()

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two (8, 16, 32, ...), got {v}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        from worker.sim.device import check_device

        check_device(v)
        return v

    @field_validator("model_shape")
    @classmethod
    def _model_shape(cls, v: str | None, info: ValidationInfo) -> str | None:
        from worker.sim.device import check_model_shape

        check_model_shape(v, info.data.get("device", "auto"))
        return v

    @model_validator(mode="after")
    def _speculative_device(self) -> EngineSection:
        if self.speculative.method is not None and self.device.startswith("sim:"):
            raise ValueError("speculative decoding does not run on a simulated device (the simulator "
                             "prices it from an acceptance rate instead)")
        return self


class RoutingSection(Section):
    # The routing policy (router/routing/policies/), run by router/routing/serve_router.py's
    # PolicyRouter; pow2 is Serve's default algorithm. "kv_headroom" is accepted for "headroom" (in
    # the Literal so that the Helm schema accepts it too) and stored as "headroom".
    router: Literal["headroom", "pow2", "round_robin", "least_kv", "prefix_affinity", "sticky", "kv_headroom"] = "headroom"
    # How often worker replicas report their routing stats. The one value for both Serve's
    # report period and the router's staleness judgement (RoutingParams.stats_period_s).
    stats_period_s: float = Field(default_of(RoutingParams, "stats_period_s"), gt=0)
    # Further RoutingParams fields (router/routing/types.py), e.g. {load_gate_threshold: 2}.
    router_kwargs: dict[str, Any] = Field(default_factory=dict)
    # With state.redis_url set: the ingress replicas' routers share one routing view in Redis
    # (every router's reservations and prefix hints: router/routing/redis_view.py), so that several
    # ingress replicas do not herd onto the replica that looked best at the last report.
    # Redis down: each router routes on its own view until it is back.
    shared_view: bool = True
    # per_decision: one Redis round trip before each decision (what other routers sent a
    # moment ago counts); cached: read in the background every shared_view_refresh_s (no
    # round trip in the decision, other routers' last refresh_s of dispatches unseen).
    shared_view_mode: Literal["per_decision", "cached"] = default_of(SharedViewSpec, "mode")
    shared_view_refresh_s: float = Field(default_of(SharedViewSpec, "refresh_s"), gt=0)
    # Before its first decision a router (a started or restarted ingress replica) asks every
    # worker replica for its routing stats, so it knows what each caches from the start.
    warm_start: bool = True

    @field_validator("router", mode="before")
    @classmethod
    def _router_alias(cls, value: Any) -> Any:
        return "headroom" if value == "kv_headroom" else value

    @model_validator(mode="after")
    def _known_router_kwargs(self) -> RoutingSection:
        if self.router == "headroom":
            self.routing_params()  # a typo or a bad value fails here, not in Serve
        return self

    def routing_params(self) -> RoutingParams:
        """The KV-headroom router's parameters; router_kwargs win over the typed fields."""
        return RoutingParams.from_kwargs({"stats_period_s": self.stats_period_s, **self.router_kwargs})


class DisaggregationSection(Section):
    """Prefill/decode disaggregation (router/frontend/disagg.py): two worker pools instead of one
    mixed pool. Each pool is a worker deployment with its own replicas, resources and
    autoscaling (give them `role: prefill` / `role: decode`); both use the routing section's
    router. The `workers` section is then unused."""

    prefill: WorkersSection = WorkersSection()
    decode: WorkersSection = WorkersSection()
    # Requests per ingress replica admitted but not yet decoding (waiting for their prefill
    # or for a decode replica); one more is answered 429 before any work is done.
    max_waiting_for_decode: int = Field(MAX_WAITING_FOR_DECODE, ge=1)


class ModelEntry(Section):
    """One model of a `models:` list (cluster/models_config.py): the model section's fields
    (`name` is its served_model_name), and its own engine, pools and adapters. An omitted
    `engine` key keeps the top-level engine's value; an omitted workers, disaggregation or
    lora section is the top-level one."""

    name: str | None = Field(None, min_length=1, max_length=128)
    path: str | None = None
    trust_remote_code: bool = default_of(ModelConfig, "trust_remote_code")
    seed: int = Field(default_of(ModelConfig, "seed"), ge=0)
    engine: EngineSection | None = None
    workers: WorkersSection | None = None
    disaggregation: DisaggregationSection | None = None
    lora: LoRASection | None = None

    def model_section(self) -> ModelSection:
        return ModelSection(path=self.path, served_model_name=self.name, trust_remote_code=self.trust_remote_code,
                            seed=self.seed)


class KVServeConfig(Section):
    app_name: str = "kvserve"
    route_prefix: str = Field("/", json_schema_extra={"pattern": "^/"})  # see _prefix
    # `model: /path/or/hub-id` is short for `model: {path: ...}` (_model_shorthand below).
    model: Annotated[ModelSection, OrString("short for {path: ...}")] = ModelSection()
    engine: EngineSection = EngineSection()
    workers: WorkersSection = WorkersSection()
    ingress: IngressSection = IngressSection()
    http: HTTPSection = HTTPSection()
    grpc: GRPCSection = GRPCSection()
    routing: RoutingSection = RoutingSection()
    state: StateSection = StateSection()
    disaggregation: DisaggregationSection | None = None
    observability: ObservabilitySection = ObservabilitySection()  # tracing: cluster/tracing.py
    lora: LoRASection = LoRASection()  # multi-LoRA serving: cluster/lora_config.py
    # Many models on one cluster (cluster/models_config.py): each its own pools behind the one
    # ingress, routed by the request's `model`. Empty: the one model of `model:`.
    models: list[ModelEntry] = Field(default_factory=list)

    @field_validator("model", mode="before")
    @classmethod
    def _model_shorthand(cls, v: Any) -> Any:
        # `model: /path/or/hub-id` is short for `model: {path: ...}`.
        return {"path": v} if isinstance(v, str) else v

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must start with '/', got {v!r}")
        return v

    @model_validator(mode="after")
    def _direct_ingress_without_tls(self) -> KVServeConfig:
        # gRPC TLS is a listener kvserve adds to Serve's gRPC proxy (router/frontend/grpc_api/tls.py),
        # which direct ingress replaces with HAProxy.
        if self.http.direct_ingress is True and self.grpc.enabled and self.grpc.tls_port is not None:
            raise ValueError("http.direct_ingress: gRPC TLS (grpc.tls_port) needs Serve's gRPC proxy; "
                             "terminate TLS in front of HAProxy, or turn direct ingress off")
        return self

    @model_validator(mode="after")
    def _models_are_distinct(self) -> KVServeConfig:
        from cluster.models_config import check_models  # it builds KVServeConfig views: a cycle at import

        check_models(self)
        return self

    @model_validator(mode="after")
    def _planner_has_a_cost_model(self) -> KVServeConfig:
        # The SLO planner prices steps with the step-cost model: refuse a pool with SLO
        # targets that has none, here rather than in Serve's controller. With `models:`
        # each model's view is checked with its own model and engine.
        if self.models:
            return self
        pools = [self.workers] + ([self.disaggregation.prefill, self.disaggregation.decode]
                                  if self.disaggregation is not None else [])
        if any(p.autoscaling is not None and p.autoscaling.slo is not None for p in pools):
            from cluster.slo_config import cost_model_names

            cost_model_names(self.engine, self.model.path or "")
        return self

    # -- loading -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> KVServeConfig:
        """Validate, turning pydantic's errors into one readable line per problem."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, cls)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> KVServeConfig:
        import yaml

        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def with_overrides(self, overrides: dict[str, Any]) -> KVServeConfig:
        """A copy with dotted-key overrides applied (`{"http.port": 8001}`), re-validated."""
        data = self.model_dump()
        for key, value in overrides.items():
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return type(self).from_dict(data)

    # -- building the engine's config ---------------------------------------------------
    def engine_config(self) -> EngineConfig:
        """worker.config's EngineConfig, field by field from the model/engine sections."""
        model = build(
            ModelConfig, self.engine, self.model,
            model=self.model.resolved_path(), tensor_parallel_size=self.workers.tensor_parallel_size,
        )
        cache = build(CacheConfig, self.engine, renames=_CACHE_RENAMES)
        return EngineConfig(model=model, cache=cache, scheduler=build(SchedulerConfig, self.engine),
                            lora=self.lora.lora_config(), speculative=self.engine.speculative.speculative_config())

    def ingress_settings(self, state_store: Any = None) -> IngressSettings:
        """router.frontend.settings' IngressSettings from the ingress and model sections."""
        return build(
            IngressSettings, self.ingress, self.model,
            served_model_name=self.model.resolved_name(), tokenizer_path=self.model.resolved_path(),
            state_store=state_store, lora_modules=self.lora.module_items, lora_enabled=self.lora.lora_config().enabled,
            lora_policy=self.lora.policy(), response_store=self.response_store_spec(),
            cold_start_retry_after_s=self.cold_start_retry_after_s(), scale_to_zero=self.scales_to_zero(),
        )

    def scales_to_zero(self) -> bool:
        """Whether any of the model's pools may go to zero replicas."""
        pools = [self.workers] + ([self.disaggregation.prefill, self.disaggregation.decode]
                                  if self.disaggregation is not None else [])
        return any(p.autoscaling is not None and p.autoscaling.scale_to_zero for p in pools)

    def cold_start_retry_after_s(self) -> float | None:
        """The Retry-After of a request no replica took in time: ingress.cold_start_retry_after_s,
        else the start-up time the pool's planner is given (its serving pool: the decode
        pool when disaggregated), else None (the ingress's default)."""
        if self.ingress.cold_start_retry_after_s is not None:
            return self.ingress.cold_start_retry_after_s
        pool = self.disaggregation.decode if self.disaggregation is not None else self.workers
        if pool.autoscaling is not None and pool.autoscaling.slo is not None:
            return pool.autoscaling.slo.startup_s
        return None

    def response_store_spec(self) -> ResponseStoreSpec:
        """Where /v1/responses keeps stored responses: Redis when state.redis_url is set
        (every ingress replica sees them), else each replica's memory."""
        s = self.state
        if s.redis_url is None:
            return ResponseStoreSpec()
        return ResponseStoreSpec(url=s.redis_url, key_prefix=self.redis_key_prefix(),
                                 password_env=s.redis_password_env, socket_timeout_s=s.socket_timeout_s)

    def shared_view_spec(self) -> SharedViewSpec | None:
        """Where the routers share their view: Redis when state.redis_url is set and
        routing.shared_view is on, else None (each router's view is private)."""
        s, r = self.state, self.routing
        if s.redis_url is None or not r.shared_view:
            return None
        return SharedViewSpec(
            url=s.redis_url, key_prefix=self.redis_key_prefix(), password_env=s.redis_password_env,
            socket_timeout_s=s.socket_timeout_s, mode=r.shared_view_mode, refresh_s=r.shared_view_refresh_s,
        )

    def redis_store_spec(self) -> RedisStoreSpec | None:
        """Where the ingress replicas count per-key limits: Redis when `state.redis_url` is
        set (cluster/state_store.py), else None (each replica on its own)."""
        s = self.state
        if s.redis_url is None:
            return None
        return build(RedisStoreSpec, s, renames=_REDIS_RENAMES, url=s.redis_url, key_prefix=self.redis_key_prefix())

    def redis_key_prefix(self) -> str:
        """Prefix of every Redis key this app writes, the per-key limits' and the shared
        routing view's alike: state.key_prefix, else "kvserve:<app_name>"."""
        return self.state.key_prefix or f"kvserve:{self.app_name}"
