"""The one user-facing configuration schema of kvserve.

The same `KVServeConfig` is read by the CLI (`kvserve serve --config FILE`), by
`serve run cluster.app:app_builder` / a serveConfigV2 `args:` block (the application
builder validates its args with it), and by the Helm chart (which renders its values into
those args). It is the edge of the system, so it is pydantic with `extra="forbid"`;
inside, it builds the engine's own frozen dataclasses (`worker.config.EngineConfig`).

A minimal YAML file:

    model: /models/Llama-3.2-1B-Instruct     # or a Hub id, or omitted (embedded default)
    workers: {num_replicas: 2}

Every section and field is optional; unknown keys are errors that name the closest
known key.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


class ConfigError(ValueError):
    """An invalid configuration, with one readable line per problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}


def parse_bytes(value: Any) -> Any:
    """`268435456`, `"256MiB"`, `"1GiB"`, `"512MB"` -> bytes (other types pass through)."""
    if not isinstance(value, str):
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(f"not a byte size: {value!r} (examples: 268435456, '256MiB', '2GiB')")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    if "I" in unit:  # KiB, MiB, ... (binary)
        scale = 1024 ** ("KMGT".index(unit[0]) + 1)
    else:  # K, KB, M, MB, ... (decimal), B or nothing (bytes)
        scale = _UNITS[unit if unit in ("", "B") else unit[0]]
    return int(number * scale)


class ModelSection(_Section):
    # A local directory or a Hugging Face Hub id. None: the embedded default model.
    path: str | None = None
    # The `model` name clients send. Default: the directory's name for a local path, the
    # id for a Hub id, "kvserve-tiny" for the embedded default.
    served_model_name: str | None = None
    trust_remote_code: bool = False
    seed: int = Field(0, ge=0)

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
        local = Path(self.path).expanduser()
        if local.is_dir() or self.path.startswith((".", "/", "~")):
            return local.resolve().name
        return self.path  # a Hub id, e.g. "meta-llama/Llama-3.2-1B"


class EngineSection(_Section):
    block_size: int = Field(16, gt=0, le=256)
    # CPU: the KV tensors get exactly this many bytes ("256MiB" style accepted).
    kv_cache_bytes: int = Field(256 * 1024**2, gt=0)
    # GPU: the KV budget as a fraction of the device's memory.
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    # An exact number of KV blocks (tests, capacity experiments); overrides both budgets.
    num_blocks: int | None = Field(None, gt=0)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int = Field(2048, ge=2)
    enable_prefix_caching: bool = True
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # auto | cpu | cuda | sim:<profile> (a simulated device, worker/sim/: h200, h100,
    # a100-80gb, l4, a fitted profile's name or a JSON path; no weights are loaded, the
    # model directory only gives the tokenizer).
    device: str = "auto"
    model_shape: str | None = None  # sim device: a named shape (llama-3-8b, ...) or a config.json
    time_dilation: float = Field(1.0, gt=0)  # sim device: wall seconds per modelled second
    attention_backend: Literal["auto", "torch", "flash", "triton"] = "auto"
    enable_cuda_graphs: bool = True  # CUDA only: decode steps replayed as CUDA graphs
    num_threads: int | None = Field(None, ge=1)  # torch CPU threads per worker

    @field_validator("kv_cache_bytes", mode="before")
    @classmethod
    def _bytes(cls, v: Any) -> Any:
        return parse_bytes(v)

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


# kvserve's own policy (cluster/autoscaling.py), by either of its import paths; both run
# as the class, which Serve instantiates with the typed fields below as `policy_kwargs`.
KVSERVE_POLICY = "cluster.autoscaling:QueueDepthPolicy"
KVSERVE_POLICIES = (KVSERVE_POLICY, "cluster.autoscaling:queue_depth_policy")
# The typed fields that are QueueDepthPolicy's constructor arguments.
KVSERVE_POLICY_FIELDS = (
    "role",
    "target_waiting_per_replica",
    "target_waiting_prompt_tokens_per_replica",
    "kv_usage_ceiling",
    "scale_to_zero",
)


class AutoscalingSection(_Section):
    min_replicas: int = Field(1, ge=0)  # 0 only with scale_to_zero: true
    max_replicas: int = Field(4, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    # -- kvserve's queue-depth / KV-usage policy (cluster/autoscaling.py:QueueDepthPolicy).
    # mixed/decode pools size on waiting requests, prefill pools on waiting prompt tokens;
    # every pool also on KV usage.
    role: Literal["mixed", "prefill", "decode"] = "mixed"
    target_waiting_per_replica: float = Field(4.0, gt=0)
    target_waiting_prompt_tokens_per_replica: float = Field(8192.0, gt=0)
    kv_usage_ceiling: float = Field(0.85, gt=0, le=1)  # used/all KV blocks per replica, mean
    # Let an idle pool go to zero replicas (then a request waits for a model load).
    scale_to_zero: bool = False
    # -- Serve's built-in policy (`policy: serve`) aims at this many ongoing requests per replica.
    target_ongoing_requests: float = Field(64.0, gt=0)
    # -- Timing, applied by Serve to whichever policy runs. A change happens once it has been
    # wanted continuously for the delay; metrics are averaged over look_back_period_s.
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    # Serve warns (and will refuse in a later release) unless this exceeds metrics_interval_s.
    look_back_period_s: float = Field(30.0, gt=0)
    # How often replicas (and handles) push their stats to Serve's controller. Ray 2.60 reads
    # this AutoscalingConfig field (deprecated, default 10 s); its successor environment
    # variable RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S is defined but not read.
    metrics_interval_s: float = Field(10.0, gt=0)
    # The scaling policy, "module:function_or_class". Default: kvserve's policy above;
    # "serve": Serve's built-in policy; anything else: a custom policy, given policy_kwargs
    # (when it is a class). For kvserve's policy, policy_kwargs may carry the typed fields
    # above instead (they are moved there).
    policy: str = KVSERVE_POLICY
    policy_kwargs: dict[str, Any] = Field(default_factory=dict)

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
        return self.policy in KVSERVE_POLICIES

    def kvserve_policy_kwargs(self) -> dict[str, Any]:
        """QueueDepthPolicy's constructor arguments (JSON-serialisable, as Serve requires)."""
        return {name: getattr(self, name) for name in KVSERVE_POLICY_FIELDS}


class WorkersSection(_Section):
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
    resources: dict[str, float] = Field(default_factory=dict)
    tensor_parallel_size: int = 1
    autoscaling: AutoscalingSection | None = None
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    # A replica Serve removes (scale-down, redeploy, shutdown) gets this long to finish its
    # running requests before it is killed (Serve's graceful_shutdown_timeout_s); requests
    # still running then are cut, and the ingress resumes them on another replica
    # (ingress.max_migrations). It also bounds how long a scale-down or shutdown takes.
    drain_timeout_s: float = Field(60.0, ge=0)

    @field_validator("resources")
    @classmethod
    def _resources_are_custom(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if name.upper() in ("CPU", "GPU", "MEMORY"):
                raise ValueError(f"{name!r} is not a custom resource; use num_cpus / num_gpus")
            if amount < 0:
                raise ValueError(f"resource {name!r}: amount must be >= 0, got {amount}")
        return v

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp_is_positive(cls, v: int) -> int:
        # Whether the model's heads split over v ranks is checked when the engine loads it.
        if v < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        return v


class IngressSection(_Section):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, ge=0)
    # Requests (weighted by `n`) one ingress replica holds at once, streaming or
    # waiting for a worker; one more is answered 429 at once instead of piling up.
    max_queued_requests: int = Field(1024, ge=1)
    max_body_bytes: int = Field(4 * 1024**2, gt=0)  # larger bodies: 413
    max_n: int = Field(16, ge=1)  # bound on `n` (choices per request)
    request_timeout_s: float = Field(600.0, gt=0)
    # A stream whose worker replica dies is resumed on another one (prompt + the tokens
    # already sent; greedy output unchanged) at most this many times; 0: fail it (503).
    max_migrations: int = Field(2, ge=0)
    # API keys (router/auth.py): the environment variable holding them, comma-separated,
    # each a plaintext key or `sha256:<hex digest>` (hashed at start-up; plaintext is not
    # kept). Unset or empty: authentication off. The Helm chart fills KVSERVE_API_KEYS
    # from a Secret.
    api_keys_env: str | None = "KVSERVE_API_KEYS"
    # Per API key (429 beyond): requests in flight, and tokens per minute (prompt +
    # max_tokens charged at admission, the unused part refunded). Counted per ingress
    # replica, or cluster-wide with `state.redis_url`.
    max_concurrent_requests_per_key: int | None = Field(None, ge=1)
    tokens_per_minute_per_key: int | None = Field(None, ge=1)
    # Serve /metrics without an API key (for a Prometheus scraper) when keys are on.
    metrics_public: bool = False

    @field_validator("max_body_bytes", mode="before")
    @classmethod
    def _bytes(cls, v: Any) -> Any:
        return parse_bytes(v)


class StateSection(_Section):
    """Shared state of the ingress replicas (cluster/state_store.py). With `redis_url` set,
    the per-key limits (ingress.max_concurrent_requests_per_key, tokens_per_minute_per_key)
    are counted cluster-wide in Redis instead of per ingress replica; while Redis is
    unreachable each replica counts on its own and serving goes on."""

    # redis://host:6379/0 or rediss:// (TLS). No password here: it would show in the
    # Serve config; it is read from the environment variable below.
    redis_url: str | None = None
    redis_password_env: str | None = "KVSERVE_REDIS_PASSWORD"
    # Prefix of every Redis key this app writes. Default: "kvserve:<app_name>".
    key_prefix: str | None = Field(None, min_length=1, max_length=128)
    # Each Redis call waits at most this long before the replica falls back to its own counts.
    socket_timeout_s: float = Field(0.2, gt=0, le=10)
    # A concurrency slot of an ingress replica that died frees itself after this long
    # (live replicas renew theirs every third of it).
    lease_ttl_s: float = Field(30.0, ge=1, le=3600)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 -- raises on a port that is not a number
        except ValueError as e:
            raise ValueError(f"not a valid URL ({e})") from None
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ValueError("must be redis://HOST[:PORT][/DB] or rediss://HOST[:PORT][/DB]")
        if parts.password is not None:
            # Never echo the URL back: it holds the password.
            raise ValueError("must not contain a password; put it in the variable named by state.redis_password_env")
        return v


class HTTPSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class GRPCSection(_Section):
    port: int = Field(9000, ge=0, le=65535)
    enabled: bool = True


class RoutingSection(_Section):
    # kv_headroom: router/request_router.py:KVHeadroomRouter. pow2: Serve's default. The
    # baselines (router/policies/) run through router/policy_router.py:PolicyRouter.
    router: Literal["kv_headroom", "pow2", "round_robin", "least_kv", "prefix_affinity", "sticky"] = "kv_headroom"
    stats_period_s: float = Field(1.0, gt=0)
    router_kwargs: dict[str, Any] = Field(default_factory=dict)


class DisaggregationSection(_Section):
    """Prefill/decode disaggregation (router/disagg.py): two worker pools instead of one
    mixed pool. Each pool is a worker deployment with its own replicas, resources and
    autoscaling (give them `role: prefill` / `role: decode`); both use the routing section's
    router. The `workers` section is then unused."""

    prefill: WorkersSection = WorkersSection()
    decode: WorkersSection = WorkersSection()
    # Requests per ingress replica admitted but not yet decoding (waiting for their prefill
    # or for a decode replica); one more is answered 429 before any work is done.
    max_waiting_for_decode: int = Field(256, ge=1)


class KVServeConfig(_Section):
    app_name: str = "kvserve"
    route_prefix: str = "/"
    model: ModelSection = ModelSection()
    engine: EngineSection = EngineSection()
    workers: WorkersSection = WorkersSection()
    ingress: IngressSection = IngressSection()
    http: HTTPSection = HTTPSection()
    grpc: GRPCSection = GRPCSection()
    routing: RoutingSection = RoutingSection()
    state: StateSection = StateSection()
    disaggregation: DisaggregationSection | None = None

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
        e = self.engine
        return EngineConfig(
            model=ModelConfig(
                model=self.model.resolved_path(),
                dtype=e.dtype,
                device=e.device,
                attention_backend=e.attention_backend,
                enable_cuda_graphs=e.enable_cuda_graphs,
                seed=self.model.seed,
                num_threads=e.num_threads,
                trust_remote_code=self.model.trust_remote_code,
                tensor_parallel_size=self.workers.tensor_parallel_size,
                model_shape=e.model_shape,
                time_dilation=e.time_dilation,
            ),
            cache=CacheConfig(
                block_size=e.block_size,
                kv_cache_bytes=e.kv_cache_bytes,
                gpu_memory_utilization=e.gpu_memory_utilization,
                enable_prefix_caching=e.enable_prefix_caching,
                num_blocks_override=e.num_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=e.max_num_seqs,
                max_num_batched_tokens=e.max_num_batched_tokens,
                max_model_len=e.max_model_len,
            ),
        )


# Fields whose bad value is not repeated in the error (a URL may carry a password).
_UNECHOED_FIELDS = frozenset({"redis_url"})


def format_validation_error(error: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem: dotted path, what is wrong, and for a typo the closest key."""
    lines = []
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        path = ".".join(loc) or "(top level)"
        if item["type"] == "extra_forbidden":
            known = _known_fields(root, loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            where = ".".join(loc[:-1]) or "the top level"
            lines.append(f"{path}: unknown key{hint} (known keys in {where}: {', '.join(sorted(known))})")
        else:
            message = item["msg"].removeprefix("Value error, ")
            got = repr(item.get("input"))
            if loc and loc[-1] in _UNECHOED_FIELDS:  # may hold a secret
                got = message
            lines.append(f"{path}: {message}" + ("" if got in message else f" (got {got})"))
    return "invalid kvserve configuration:\n  " + "\n  ".join(lines)


def _known_fields(root: type[BaseModel], parents: list[str]) -> list[str]:
    model: Any = root
    for part in parents:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = _section_type(field.annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _section_type(annotation: Any) -> Any:
    """`X | None` -> X for section-typed fields."""
    for arg in getattr(annotation, "__args__", (annotation,)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return annotation
