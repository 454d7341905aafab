"""The ingress replicas' sections of the user's config: what one ingress replica admits
(queue bounds, body and `n` limits, API keys and per-key limits, admission control, tool
call parsing) and the shared state in Redis where the per-key limits are counted
cluster-wide.

Part of the one schema (cluster/config.py). The ingress's own settings are
`router.frontend.settings.IngressSettings` and the Redis store's `cluster.state_store.RedisStoreSpec`
(frozen dataclasses, with their defaults); the sections take their defaults from there and
hand them back through `build`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from cluster.config_fields import ByteSize, Section, default_of
from cluster.pool_config import CustomResources, IngressAutoscalingSection
from cluster.state_store import RedisStoreSpec
from router.frontend.settings import IngressSettings
from worker.sampling_params import MAX_PRIORITY

# StateSection.redis_url as a JSON-schema pattern: redis:// or rediss://, a host, an optional
# port and db, and no password (a user part without ':' is allowed).
REDIS_URL_PATTERN = r"^rediss?://([^\s:@/]+@)?(\[[0-9a-fA-F:.]+\]|[^\s:@/\[\]]+)(:[0-9]{1,5})?(/[0-9]*)?$"


class IngressSection(Section):
    # The chart runs two or more, on a CPU node group (docs/operations.md "Reliability": a node that
    # hosts an ingress replica takes that replica's streams with it when it dies).
    num_replicas: int = Field(1, ge=1)
    # Scale the ingress on streams per replica (Serve's policy); then num_replicas is unused.
    autoscaling: IngressAutoscalingSection | None = None
    num_cpus: float = Field(0.5, ge=0)
    # Custom Ray resources per ingress replica, e.g. {kvserve_ingress: 0.01} to keep the
    # ingress on the nodes that advertise it (the chart's ingress group) and off GPU hosts.
    resources: CustomResources = Field(default_factory=dict)
    # Without `resources`, keep the ingress replicas off the nodes that advertise GPUs when
    # the cluster has a CPU node: a GPU host that is lost (or preempted) would take every
    # stream its ingress replica carries with it, those on surviving workers too. false:
    # anywhere Ray puts them. cluster/app.py's ingress_placement says how.
    off_gpu_hosts: bool = True
    # Requests (weighted by `n`) one ingress replica holds at once, streaming or
    # waiting for a worker; one more is answered 429 at once instead of piling up.
    max_queued_requests: int = Field(default_of(IngressSettings, "max_queued_requests"), ge=1)
    # Requests one ingress replica takes in at once, from arrival until their engine call
    # is sent; a burst beyond it waits its turn in arrival order, so that the first
    # requests reach the workers while the rest are still being read (router/frontend/intake.py).
    # 0: no window.
    intake_window: int = Field(default_of(IngressSettings, "intake_window"), ge=0)
    max_body_bytes: ByteSize = Field(default_of(IngressSettings, "max_body_bytes"), gt=0)  # larger bodies: 413
    # The whole request body must arrive within this long (408 otherwise: slow clients).
    body_read_timeout_s: float = Field(default_of(IngressSettings, "body_read_timeout_s"), gt=0)
    max_n: int = Field(default_of(IngressSettings, "max_n"), ge=1)  # bound on `n` (choices per request)
    # Bound on the prompts of one completions request (a list of prompts); more: 400.
    max_prompts_per_request: int = Field(default_of(IngressSettings, "max_prompts_per_request"), ge=1)
    request_timeout_s: float = Field(default_of(IngressSettings, "request_timeout_s"), gt=0)
    # A stream whose worker replica dies is resumed on another one (prompt + the tokens
    # already sent; greedy output unchanged) at most this many times; 0: fail it (503).
    max_migrations: int = Field(default_of(IngressSettings, "max_migrations"), ge=0)
    # API keys (router/frontend/auth.py): the environment variable holding them, comma-separated,
    # each a plaintext key or `sha256:<hex digest>` (hashed at start-up; plaintext is not
    # kept). Unset or empty: authentication off. The Helm chart fills KVSERVE_API_KEYS
    # from a Secret.
    api_keys_env: str | None = default_of(IngressSettings, "api_keys_env")
    # Admin API keys (same format): the only keys that may load/unload LoRA adapters and
    # reset the prefix cache (403 for the others); they serve requests too. The Helm chart
    # fills KVSERVE_ADMIN_API_KEYS from a Secret when adminApiKeys is set.
    admin_api_keys_env: str | None = default_of(IngressSettings, "admin_api_keys_env")
    # Per API key (429 beyond): requests in flight, and tokens per minute (prompt +
    # max_tokens charged at admission, the unused part refunded). Counted per ingress
    # replica, or cluster-wide with `state.redis_url`.
    max_concurrent_requests_per_key: int | None = Field(default_of(IngressSettings, "max_concurrent_requests_per_key"), ge=1)
    tokens_per_minute_per_key: int | None = Field(default_of(IngressSettings, "tokens_per_minute_per_key"), ge=1)
    # Give each API key a prefix-cache partition of its own (its id salts the block hashes,
    # as vLLM's cache_salt does per request): no key learns from cached_tokens what another
    # sent, at the cost of no prefix sharing between keys. The Helm chart turns it on.
    isolate_prefix_cache_per_key: bool = default_of(IngressSettings, "isolate_prefix_cache_per_key")
    # Priority bands (vLLM's request `priority`: lower first): key id (the 12 hex digits
    # kvserve logs, sha256 of the key) -> its default band, also the best band it may ask for.
    # Held requests are offered best band first, and a full queue sheds the worst band first;
    # in the engine a better band may preempt a worse one. Unlisted keys: default_key_priority.
    key_priorities: dict[str, int] = Field(default_of(IngressSettings, "key_priorities"))
    # The band of a key not in key_priorities; unset: the worst band listed there (0 when
    # none is), so that a key added to the Secret never outranks the listed ones.
    default_key_priority: int | None = Field(default_of(IngressSettings, "default_key_priority"),
                                             ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # Within a band, held requests are served weighted round robin between keys: key id ->
    # its weight (a key of weight 3 is served up to 3 times in a row, and keeps up to 3x
    # the places of a weight-1 key when the queue is full). Unlisted keys: 1.
    key_weights: dict[str, PositiveInt] = Field(default_of(IngressSettings, "key_weights"))
    # Models per API key (cluster/models_config.py): key id -> the models (and their LoRA
    # adapters) it may use; any other model is answered as unknown (404 model_not_found,
    # docs/security.md) and left out of its /v1/models. Unlisted keys: every model.
    key_models: dict[str, list[str]] = Field(default_of(IngressSettings, "key_models"))
    # Serve /metrics without an API key (for a Prometheus scraper) when keys are on.
    metrics_public: bool = default_of(IngressSettings, "metrics_public")
    # Admission control (router/routing/admission.py): while no worker replica can take a request
    # (KV headroom, and at most admission_max_waiting_per_replica waiting there), hold it in
    # a queue fair between API keys: at most admission_queue_size requests per ingress
    # replica (0: off), each at most admission_max_wait_s (unset: request_timeout_s); beyond
    # either: 429 + Retry-After. Stale routing stats never hold a request.
    admission_queue_size: int = Field(default_of(IngressSettings, "admission_queue_size"), ge=0)
    admission_max_wait_s: float | None = Field(default_of(IngressSettings, "admission_max_wait_s"), gt=0)
    admission_max_waiting_per_replica: int = Field(default_of(IngressSettings, "admission_max_waiting_per_replica"), ge=0)
    # Scale to zero (docs/operations.md): a request waits at most cold_start_max_wait_s for a
    # worker replica to take it (held at the pool's handle, where it counts as demand, while
    # a pool at zero starts a replica), then 503 + Retry-After: cold_start_retry_after_s,
    # unset: the pool's autoscaling.slo.startup_s, else 60 s. null: no bound but
    # request_timeout_s. Keep it above the model's start-up time.
    cold_start_max_wait_s: float | None = Field(default_of(IngressSettings, "cold_start_max_wait_s"), gt=0)
    cold_start_retry_after_s: float | None = Field(default_of(IngressSettings, "cold_start_retry_after_s"), ge=0)
    # Tool calls in chat output: hermes (Hermes / Qwen <tool_call>), llama3_json (Llama 3.x),
    # deepseek_v3, mistral, or auto (chosen from the chat template's text).
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "deepseek_v3", "mistral", "harmony"] = default_of(IngressSettings, "tool_call_parser")
    # Reasoning output (router/frontend/reasoning/): reasoning_content in chat, reasoning items,
    # thinking blocks; auto: `harmony` for gpt-oss's template, `think` when it speaks of <think>.
    reasoning_parser: Literal["auto", "none", "think", "harmony"] = default_of(IngressSettings, "reasoning_parser")

    @model_validator(mode="after")
    def _one_replica_count(self) -> IngressSection:
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("set ingress.num_replicas or ingress.autoscaling, not both")
        return self

    def max_num_replicas(self) -> int:
        """The most ingress replicas that run at once (each holds a private router view)."""
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.num_replicas


class StateSection(Section):
    """Shared state of the ingress replicas (cluster/state_store.py). With `redis_url` set,
    the per-key limits (ingress.max_concurrent_requests_per_key, tokens_per_minute_per_key)
    are counted cluster-wide in Redis instead of per ingress replica; while Redis is
    unreachable each replica counts on its own and serving goes on."""

    # redis://host:6379/0 or rediss:// (TLS). No password here: it would show in the
    # Serve config; it is read from the environment variable below.
    # The pattern publishes _redis_url's rule in the JSON schema (the Helm chart's
    # values.schema.json), so `helm install` rejects a URL with a password before any pod.
    redis_url: str | None = Field(None, json_schema_extra={"pattern": REDIS_URL_PATTERN})
    redis_password_env: str | None = Field(default_of(RedisStoreSpec, "password_env"),
                                           json_schema_extra={"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"})
    # Prefix of every Redis key this app writes. Default: "kvserve:<app_name>".
    key_prefix: str | None = Field(None, min_length=1, max_length=128)
    # Each Redis call waits at most this long before the replica falls back to its own counts.
    socket_timeout_s: float = Field(default_of(RedisStoreSpec, "socket_timeout_s"), gt=0, le=10)
    # A concurrency slot of an ingress replica that died frees itself after this long
    # (live replicas renew theirs every third of it).
    lease_ttl_s: float = Field(default_of(RedisStoreSpec, "lease_ttl_s"), ge=1, le=3600)
    # While Redis is unreachable: local (each ingress replica counts on its own: up to N x
    # the limits with N replicas, shown by kvserve:limit_store_up 0 and a warning) or refuse
    # (requests of limited keys get 503 until Redis is back).
    when_down: Literal["local", "refuse"] = default_of(RedisStoreSpec, "when_down")

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
