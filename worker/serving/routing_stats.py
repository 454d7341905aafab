"""The routing-stats record: what a worker replica reports through Ray Serve's routing
stats and the router reads (re-exported by worker/api.py, the module router/ imports).
Plain data, torch-free and Ray-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from kv.kv_events import KVEventBatch


@dataclass(frozen=True)
class RoutingStats:
    """What a worker replica reports through Ray Serve's routing stats (its
    `record_routing_stats`), and what the KV-headroom router reads (router/routing/types.py's
    ReplicaReport). Serve carries it as a dict: `to_dict()`."""

    free_blocks: int  # free KV blocks, evictable cached ones included
    total_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_waiting_prompt_tokens: int
    reserved_blocks: int  # blocks the waiting requests will need at admission
    prefix_hashes: list[int]  # cached full-block hashes (kv.block_hash chain)
    timestamp: float  # time.time() when taken
    healthy: bool  # False: the router stops choosing this replica (Serve will replace it)
    # Mixed GPU types: this replica's throughput relative to the reference device the
    # router's RoutingParams.prefill_tokens_per_s describes, and its own prefill rate when
    # it knows one (0: unknown). The router weighs work and load shares by them.
    capacity_weight: float = 1.0
    prefill_tokens_per_s: float = 0.0  # measured, in device seconds (worker/engine/step_meters.py)
    # KV blocks the replica's requests will still grow into (forecast per request from its
    # max_tokens and the observed output lengths), and the observed mean output length of
    # requests that finished normally (0.0: none yet). worker/serving/routing_report.py.
    decode_growth_blocks: int = 0
    mean_output_tokens: float = 0.0
    # Sequences the engine runs at once (0: not said): a request sent while fewer run
    # starts at once instead of waiting.
    max_num_seqs: int = 0
    # LoRA residency, not requests in flight: the adapters in device slots (a request
    # needs no load) and those read into host memory (a device copy only), worker/lora/.
    lora_resident: tuple[str, ...] = ()
    lora_loaded: tuple[str, ...] = ()
    # The resident adapters that running sequences use (their slots cannot take another
    # adapter until those finish), and the replica's number of slots (0: not said).
    lora_active: tuple[str, ...] = ()
    max_loras: int = 0
    # Prefix block hashes held below the device (KV tiers, docs/kv-tiers.md), most recent
    # first: the router credits them as loads, not recomputation.
    host_prefix_hashes: list[int] = field(default_factory=list)
    disk_prefix_hashes: list[int] = field(default_factory=list)
    # Prompt tokens its running sequences have yet to prefill (chunked prefill): work the
    # waiting figure does not show, seconds of it behind one long prompt.
    num_running_prompt_tokens: int = 0
    # KV events (kv/kv_events.py, worker/kvcache/event_stream.py): the engine instance's stream
    # id ("": the replica sends none, the router goes by the hash lists above alone), the
    # latest batch number, the recent batches, and the batch the hash lists above are
    # exact at: the router's exact index applies the batches and rebuilds from the lists
    # only on its first report, a new epoch or a missed batch (router/routing/kv_index.py).
    kv_epoch: str = ""
    kv_seq: int = 0
    kv_events: list[KVEventBatch] = field(default_factory=list)
    kv_snapshot_seq: int = 0
    # time.time() when the epoch started or the cache was last cleared: prefix hints the
    # router learned before it are void.
    kv_since: float = 0.0
    # The replica's KV geometry (kv/kv_geometry.py): blocks_for_tokens(n) is
    # kv_full_groups * ceil(n / block_size) plus, per sliding-window group, the window's
    # blocks; kv_bytes_per_block sizes one pool block (0: not said). A plain full-attention
    # replica reports 1 and (): one block per block_size tokens, as before these fields.
    kv_full_groups: int = 1
    kv_sliding_windows: tuple[int, ...] = ()
    kv_bytes_per_block: int = 0
    # Free blocks kept for paused sessions (kv/retention.py). Already part of free_blocks:
    # they are evicted (last) for any request that needs them, so they take no headroom;
    # their hashes lead prefix_hashes, so a capped snapshot still shows them.
    retained_blocks: int = 0

    def to_dict(self) -> dict[str, object]:
        # Not dataclasses.asdict: that deep-copies prefix_hashes on every report.
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Keys of the routing-stats dict (the contract with router/routing/serve_router.py).
ROUTING_STATS_KEYS = tuple(f.name for f in fields(RoutingStats))
