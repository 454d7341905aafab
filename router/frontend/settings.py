"""What the ingress needs to know, built by cluster/ from the user's config.

A frozen dataclass (not the pydantic schema) so that router/ does not depend on cluster/.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from router.frontend.auth import DEFAULT_ADMIN_API_KEYS_ENV, DEFAULT_API_KEYS_ENV
from router.frontend.key_limits import StateStoreFactory
from router.frontend.lora_policy import LoRAPolicy
from router.frontend.responses_api.store import ResponseStoreSpec
from router.routing import DEFAULT_RETRY_AFTER_S, ColdStartBound

# Prefill/decode disaggregation (router/frontend/disagg.py): requests per ingress replica admitted
# but not yet decoding (waiting for their prefill or for a decode replica); one more is
# answered 429 before any work is done.
MAX_WAITING_FOR_DECODE = 256


@dataclass(frozen=True)
class IngressSettings:
    served_model_name: str
    tokenizer_path: str  # a local directory or a Hub id (tokenizer files only are read)
    max_queued_requests: int = 1024  # weighted by n; beyond it: 429 at once
    # Requests one ingress replica takes in at once, from arrival until their engine call
    # is sent; a burst beyond it waits its turn in arrival order (router/frontend/intake.py).
    # 0: no window (every request of a burst advances one await at a time, in lockstep).
    intake_window: int = 16
    max_body_bytes: int = 4 * 1024**2  # beyond it: 413
    # The whole body must arrive within this long (408 otherwise): slow clients cannot
    # hold handlers open.
    body_read_timeout_s: float = 30.0
    max_n: int = 16
    # Prompts in one completions request (a list of prompts): each is an engine request.
    max_prompts_per_request: int = 64
    request_timeout_s: float = 600.0
    # Times one engine request is resumed on another replica after its replica died
    # (router/frontend/migration.py); 0 turns migration off.
    max_migrations: int = 2
    trust_remote_code: bool = False
    # How long /metrics waits for the workers' stats before answering without them.
    stats_timeout_s: float = 2.0
    # API keys (router/frontend/auth.py): the environment variable with the keys (plaintext or
    # `sha256:<hex>`, comma-separated); unset or empty: authentication off.
    api_keys_env: str | None = DEFAULT_API_KEYS_ENV
    # Admin API keys (same format): the only keys that may load or unload adapters and reset
    # the prefix cache; they serve requests too.
    admin_api_keys_env: str | None = DEFAULT_ADMIN_API_KEYS_ENV
    # Per API key, one budget across every model of the ingress; None: no limit. Counted per
    # ingress replica, or cluster-wide when `state_store` is set.
    max_concurrent_requests_per_key: int | None = None
    tokens_per_minute_per_key: int | None = None
    # Where the per-key limits are counted: None, this replica; else a factory built once
    # per replica (cluster/state_store.py: Redis, with this replica as the fallback).
    state_store: StateStoreFactory | None = None
    # Where the per-key limits are counted when not in `state_store`: the app-wide store of a
    # multi-model ingress (cluster/app.py), so that a key's limits are one budget across every
    # model while each model's `state_store` keeps its run-time adapters in its own
    # namespace. None: `state_store`.
    key_limits_store: StateStoreFactory | None = None
    # Each API key's prompts get a prefix-cache partition of their own (the key's id salts
    # the block hashes): no key can learn from `cached_tokens` what another sent.
    isolate_prefix_cache_per_key: bool = False
    # Priority bands (lower first; router/routing/admission.py, worker/scheduling/scheduler.py): each listed
    # key id's default band, also the best it may ask for; unlisted keys: `default_key_priority`.
    key_priorities: Mapping[str, int] = field(default_factory=dict, compare=False)  # compare=False: unhashable
    # The band of a key not in `key_priorities` (default and best); None: the worst listed
    # band (0 when none is listed), so that a newly added key never outranks a listed one.
    default_key_priority: int | None = None
    # Weighted fair shares within a band (router/routing/fair_queue.py): each listed key id's
    # weight in the hold queue's rotation and its share of a full queue; unlisted keys: 1.
    key_weights: Mapping[str, int] = field(default_factory=dict, compare=False)

    # Models per API key: key id -> the served models it may use (their adapters too); any
    # other model is answered as unknown (404). Unlisted keys: every model.
    key_models: Mapping[str, Sequence[str]] = field(default_factory=dict, compare=False)

    @property
    def cold_start(self) -> ColdStartBound:
        """The bound on a request's wait for a worker replica to take it."""
        retry = self.cold_start_retry_after_s
        return ColdStartBound(self.cold_start_max_wait_s, DEFAULT_RETRY_AFTER_S if retry is None else retry)

    @property
    def unlisted_key_priority(self) -> int:
        """The band of a key that `key_priorities` does not list."""
        if self.default_key_priority is not None:
            return self.default_key_priority
        return max(self.key_priorities.values(), default=0)
    # /metrics without an API key (e.g. for a Prometheus scraper) when keys are on.
    metrics_public: bool = False
    # Admission control (router/routing/admission.py): while no worker replica can take a request
    # (KV headroom, and at most `admission_max_waiting_per_replica` requests waiting there),
    # hold it here in a queue fair between API keys, at most `admission_queue_size` requests
    # per ingress replica (one more: 429 with Retry-After) and `admission_max_wait_s` each
    # (then 429; None: until the request's own timeout). 0 turns it off. Stale stats never
    # hold a request.
    admission_queue_size: int = 256
    admission_max_wait_s: float | None = None
    admission_max_waiting_per_replica: int = 8
    # Scale to zero (router/routing/cold_start.py): a request waits at most this long for a
    # worker replica to take it (a pool at zero replicas starts one for it meanwhile), then
    # 503 with Retry-After `cold_start_retry_after_s` (the pool's start-up time; None: 60 s).
    # `cold_start_max_wait_s` None: no bound but the request's own timeout.
    cold_start_max_wait_s: float | None = 300.0
    cold_start_retry_after_s: float | None = None
    # The model's pools may go to zero replicas (workers.autoscaling.scale_to_zero): /health
    # then counts a pool without replicas as healthy and does not ask it (a call queued at
    # an empty pool is demand: every probe would start a replica).
    scale_to_zero: bool = False
    # Tool calls in chat output (router/frontend/tool_calling/parsers.py): hermes | llama3_json | auto (from
    # the chat template's text).
    tool_call_parser: str = "auto"
    # Reasoning in chat output (router/frontend/reasoning/): think | harmony | none | auto
    # (harmony for gpt-oss's template, think when it speaks of <think>).
    reasoning_parser: str = "auto"
    # Set-up of the replica's own process, called first thing by the ingress (cluster/
    # injects it: tracing, cluster/tracing.py). None: nothing to set up.
    setup: Callable[[], object] | None = None
    # LoRA adapters served under their own names, (name, PEFT directory), and whether more
    # can be loaded at run time (/v1/load_lora_adapter: router/frontend/lora_modules.py).
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_enabled: bool = False
    # Run-time adapter updates: off unless configured, confined and bounded (router/frontend/lora_policy.py).
    lora_policy: LoRAPolicy = LoRAPolicy()
    # Stored responses of /v1/responses (router/frontend/responses_api/store.py): in Redis when
    # cluster/ sets a url (state.redis_url), else in each replica's memory; TTL and bounds.
    response_store: ResponseStoreSpec = ResponseStoreSpec()
