"""The engine's own configuration: frozen dataclasses, built by cluster/ from the user schema."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # CPU: the KV tensors get exactly this many bytes. GPU: ignored when
    # gpu_memory_utilization is set (the budget is a fraction of free memory then).
    kv_cache_bytes: int = 256 * 1024**2
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Tests force tiny pools (to provoke preemption) with an exact block count.
    num_blocks_override: int | None = None
    # KV tiers below the device (worker/kvcache/tiers.py): evicted prefix blocks move down
    # instead of vanishing. Host memory (pinned on a GPU), 0: no tiers.
    host_kv_cache_bytes: int = 0
    # A local directory under the host tier (None: none), bounded to this many bytes.
    disk_kv_cache_dir: str | None = None
    disk_kv_cache_bytes: int = 16 * 1024**3
    # A directory shared by replicas (a shared volume): computed prefix blocks are written
    # there, and a replica loads what another one computed (None: none).
    shared_kv_store_dir: str | None = None
    shared_kv_store_bytes: int = 64 * 1024**3
    # The environment variable holding the key that authenticates disk-tier entries (an
    # HMAC over each): required with a shared store, used by the local disk when set.
    kv_store_key_env: str = "KVSERVE_KV_STORE_KEY"
    # A disk-tier read that takes longer is given up (the prefix is recomputed); a store
    # call running longer makes the tiers skip the disk and check_health fail.
    tier_io_timeout_s: float = 30.0
    # The KV pool's element type: auto (the model's dtype) or fp8 (e4m3, one scale per
    # tensor: worker/attention/kv_quant.py), half of bf16's bytes per token.
    kv_cache_dtype: str = "auto"
    # KV kept across a session's pauses (kv/retention.py): a finished turn of a request with
    # a session id keeps its cached blocks this long (0: off), evicted only after every
    # other free block, at most session_kv_max_share of the pool; under pressure they are
    # evicted oldest session first, and move to the host tier when there is one.
    session_kv_ttl_s: float = 300.0
    session_kv_max_share: float = 0.5

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.host_kv_cache_bytes < 0 or self.disk_kv_cache_bytes <= 0 or self.shared_kv_store_bytes <= 0:
            raise ValueError("host_kv_cache_bytes must be >= 0, disk_kv_cache_bytes and shared_kv_store_bytes > 0")
        if self.session_kv_ttl_s < 0 or not 0.0 < self.session_kv_max_share <= 1.0:
            raise ValueError("session_kv_ttl_s must be >= 0 and session_kv_max_share in (0, 1], got "
                             f"{self.session_kv_ttl_s} and {self.session_kv_max_share}")
        if self.tier_io_timeout_s <= 0:
            raise ValueError(f"tier_io_timeout_s must be > 0, got {self.tier_io_timeout_s}")
        below_host = self.disk_kv_cache_dir is not None or self.shared_kv_store_dir is not None
        if below_host and not self.host_kv_cache_bytes:
            raise ValueError("disk_kv_cache_dir and shared_kv_store_dir are tiers under the host tier: "
                             "set host_kv_cache_bytes too")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # None: the model's own context length (max_position_embeddings), capped by what the
    # KV pool can hold; build_engine resolves it (and logs a cap).
    max_model_len: int | None = None
    # An ITL target (worker/scheduling/step_budget.py): a step that carries decodes takes no more
    # prefill tokens than keep its predicted time within this. None: the token budget only.
    max_step_time_s: float | None = None
    # While a better priority band is in use on the replica, the prompt chunks of worse
    # bands get at most this many tokens per step together, so that a better band's
    # request never arrives behind a long step (worker/scheduling/band_prefill.py). 0: no limit.
    worse_band_prefill_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.worse_band_prefill_tokens < 0:
            raise ValueError(f"worse_band_prefill_tokens must be >= 0, got {self.worse_band_prefill_tokens}")
        if self.max_step_time_s is not None and self.max_step_time_s <= 0:
            raise ValueError(f"max_step_time_s must be > 0, got {self.max_step_time_s}")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # local directory or Hub id
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | sim:<profile name or JSON path> (worker/sim/)
    attention_backend: str = "auto"  # auto | torch | flash | triton
    # CUDA only: replay decode-only steps as CUDA graphs (worker/runner/cuda_graphs.py); ignored on CPU.
    enable_cuda_graphs: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    trust_remote_code: bool = False
    # >1: rank 0 (this process) leads N-1 rank actors (worker/tp/); needs a running Ray.
    tensor_parallel_size: int = 1
    # Simulated device only: the model shape the cost model prices (a named shape or a
    # config.json path; None: `model`'s own config.json), and wall seconds per modelled second.
    model_shape: str | None = None
    time_dilation: float = 1.0
    # A real device under a step-time budget (SchedulerConfig.max_step_time_s): the device
    # profile its step times are predicted with (h200, h100, a100-80gb, l4, or a `kvserve
    # calibrate` JSON); measured step times correct its level as the engine runs.
    step_time_profile: str | None = None


# PEFT adapters above this rank are refused: the batched LoRA matmuls pad every resident
# adapter to max_lora_rank, so a larger bound would cost every step.
MAX_SUPPORTED_LORA_RANK = 64


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (worker/lora/). Off unless `enable` (or adapters are given)."""

    enable: bool = False
    # Adapters resident for steps (device slots); a step mixes at most this many.
    max_loras: int = 4
    # Every resident adapter is padded to this rank; larger adapters are refused at load.
    max_lora_rank: int = 16
    # Adapters kept loaded in host memory (LRU); None: max_loras.
    max_cpu_loras: int | None = None
    # Adapters known at start-up: (name, PEFT directory).
    modules: tuple[tuple[str, str], ...] = ()
    # Each adapter file is at most this many bytes (checked with stat before it is read).
    max_adapter_bytes: int = 2 * 1024**3

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_SUPPORTED_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_SUPPORTED_LORA_RANK}], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.max_adapter_bytes < 1:
            raise ValueError(f"max_adapter_bytes must be >= 1, got {self.max_adapter_bytes}")

    @property
    def enabled(self) -> bool:
        return self.enable or bool(self.modules)

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (worker/spec/): off unless `method` is set. A decode row of an
    eligible request carries up to `num_tokens` draft tokens, verified in the same step."""

    # None: off | "ngram" (prompt lookup, worker/spec/ngram.py) | "draft_model" (a small model
    # of the same tokenizer drafting greedily, worker/spec/draft_model.py)
    method: str | None = None
    num_tokens: int = 4  # draft tokens proposed per decode row (k)
    draft_model: str | None = None  # draft_model: its checkpoint directory
    # ngram: the longest suffix of the sequence, between these lengths, found earlier in
    # its own tokens is the match whose continuation is proposed.
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)} "
                             f"(or unset: off), got {self.method!r}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"speculative num_tokens must be in [1, 16], got {self.num_tokens}")
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("speculative method draft_model needs draft_model (a checkpoint directory), "
                             "and draft_model needs that method")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative ngram_min and ngram_max need 1 <= min <= max, got "
                             f"{self.ngram_min} and {self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    lora: LoRAConfig = LoRAConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
