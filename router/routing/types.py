"""What the KV-headroom routing policy reads and is tuned by (pure; no Ray import):
RoutingParams, a replica's parsed routing-stats report (ReplicaReport), a request's
prompt as the policy sees it (RequestProfile), a replica as a router sees it at choice
time (ReplicaView), staleness, and power of two choices (the fallback when stats are stale
and Serve's own default). The ranking and the work model are router/routing/scoring.py.
"""
from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass, field, fields

from kv.block_hash import ROOT_HASH, hash_full_blocks, root_hash
from kv.kv_geometry import KVGeometry
from worker.api import lora_cache_key

ReplicaKey = Hashable



@dataclass(frozen=True)
class RoutingParams:
    """Policy parameters (request_router_kwargs of the deployment's RequestRouterConfig)."""

    # Decode tokens counted per request: min(max_tokens, this), until the replica reports
    # its observed mean output length (ReplicaReport.mean_output_tokens), which replaces it.
    # Most requests stop well before max_tokens; counting all of it would make every
    # replica look full.
    expected_output_tokens: int = 256
    # Credit for a fully cached prompt, in rank_key units (1.0 = a whole replica's headroom).
    prefix_weight: float = 1.0
    # A replica with more than this many requests (per unit of capacity) over the least
    # loaded one takes no affinity and ranks after the others. Counted on the requests
    # ongoing there (Serve's queue length): a smaller limit trips on every burst a prefix
    # group sends its owner and turns affinity off exactly when it pays.
    load_gate_threshold: float = 8.0
    # ...or this fraction of the replica's share of the ongoing requests, when that is more
    # (router/routing/scoring.py gate_limits): the spread a busy cluster shows anyway.
    load_gate_fraction: float = 0.25
    # The period at which replicas report (RequestRouterConfig.request_routing_stats_period_s):
    # `serve_router_config()` sets Serve's period from this field, so the two cannot differ.
    stats_period_s: float = 1.0
    # Stats older than stale_after_periods * stats_period_s are stale.
    stale_after_periods: float = 3.0
    # A report reflects a dispatch only when taken at least this long after it (transit
    # to the replica + clock skew between hosts).
    report_lag_s: float = 0.05
    # Fraction of each replica's free blocks this router may promise. With N router
    # replicas (ingress replicas), 1/N keeps their private views from over-committing.
    headroom_share: float = 1.0
    # Reservations never confirmed by Serve (request cancelled before it was sent) are
    # dropped after this long; any reservation after reservation_ttl_s.
    unconfirmed_ttl_s: float = 60.0
    reservation_ttl_s: float = 3600.0
    # Prompt tokens per second a reference replica prefills (a replica's capacity_weight
    # scales it; a replica that reports its own measured figure overrides it). 40k: one
    # H200 on llama-3-8b at 2048-token chunks (worker/sim's cost model).
    prefill_tokens_per_s: float = 40_000.0
    # Affinity release: the prefix owner keeps the request while its queued prefill work
    # can be done within this long; the TTFT term of rank_key is in these units too. The
    # reported queue counts waiting prompts whole (their cached prefix is matched only at
    # admission), so this is generous: 2 s, the simulator's TTFT SLO.
    target_ttft_s: float = 2.0
    # rank_key credit for the replica that served the request's session last (soft).
    session_weight: float = 0.25
    # A session counts as active on its replica (router/routing/sessions.py: new sessions go where
    # the fewest are) until this long after its last turn; its soft affinity lasts as long.
    # The prefix hints' lifetime (router/routing/routing_view.py), so a session is not forgotten
    # while its history is still believed cached.
    session_idle_s: float = 300.0
    # KV tiers below a replica's device (docs/kv-tiers.md): a prefix block a replica holds in
    # its host tier or on its disk is loaded, not recomputed, so it earns credit at these
    # fractions of a device hit (Dynamo's selector's weights), and its load time counts in
    # the predicted TTFT at these rates, in prompt tokens per second (for the reference
    # replica: llama-3-8b's KV over an H200's host link and over a local NVMe disk).
    host_hit_weight: float = 0.75
    disk_hit_weight: float = 0.25
    host_load_tokens_per_s: float = 300_000.0
    disk_load_tokens_per_s: float = 40_000.0
    # LoRA adapters (docs/lora.md): a request for an adapter a replica holds in no device
    # slot waits for it: a copy from host memory when the replica has it loaded there, else
    # a read from storage and the copy. Both count in its predicted TTFT, so a replica that
    # holds the adapter wins while its queue is no longer than the load, and a hot adapter
    # spreads to more replicas as their queues grow (for the reference replica: a rank-16
    # adapter on every projection of llama-3-8b, about 80 MB).
    lora_swap_s: float = 0.005
    lora_load_s: float = 0.25
    # ... and where running sequences hold every slot, it first waits until all sequences of
    # one resident adapter have finished (the scheduler admits in order, so the requests
    # queued behind it wait too): about the rest of one request's decode, a ShareGPT-length
    # answer on the reference replica. Without it a replica that lacks the adapter looks a
    # load away, and spreading adapters by queue length fills every replica with more
    # adapters than its slots (benchmarks/lora.py).
    lora_slot_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.expected_output_tokens < 0:
            raise ValueError(f"expected_output_tokens must be >= 0, got {self.expected_output_tokens}")
        if self.prefix_weight < 0:
            raise ValueError(f"prefix_weight must be >= 0, got {self.prefix_weight}")
        if self.load_gate_threshold < 0 or self.load_gate_fraction < 0:
            raise ValueError("load_gate_threshold and load_gate_fraction must be >= 0")
        if self.stats_period_s <= 0 or self.stale_after_periods <= 0:
            raise ValueError("stats_period_s and stale_after_periods must be > 0")
        if min(self.host_hit_weight, self.disk_hit_weight) < 0:
            raise ValueError("host_hit_weight and disk_hit_weight must be >= 0")
        if min(self.host_load_tokens_per_s, self.disk_load_tokens_per_s) <= 0:
            raise ValueError("host_load_tokens_per_s and disk_load_tokens_per_s must be > 0")
        if min(self.lora_swap_s, self.lora_load_s, self.lora_slot_wait_s) < 0:
            raise ValueError("lora_swap_s, lora_load_s and lora_slot_wait_s must be >= 0")
        if self.report_lag_s < 0:
            raise ValueError(f"report_lag_s must be >= 0, got {self.report_lag_s}")
        if not 0.0 < self.headroom_share <= 1.0:
            raise ValueError(f"headroom_share must be in (0, 1], got {self.headroom_share}")
        if self.unconfirmed_ttl_s <= 0 or self.reservation_ttl_s <= 0:
            raise ValueError("unconfirmed_ttl_s and reservation_ttl_s must be > 0")
        if self.prefill_tokens_per_s <= 0 or self.target_ttft_s <= 0:
            raise ValueError("prefill_tokens_per_s and target_ttft_s must be > 0")
        if self.session_weight < 0:
            raise ValueError(f"session_weight must be >= 0, got {self.session_weight}")
        if self.session_idle_s <= 0:
            raise ValueError(f"session_idle_s must be > 0, got {self.session_idle_s}")

    @property
    def stale_after_s(self) -> float:
        return self.stale_after_periods * self.stats_period_s

    def serve_router_config(self) -> dict[str, object]:
        """RequestRouterConfig's fields for these parameters (besides the router class):
        Serve's report period is derived from stats_period_s, never set beside it."""
        return {"request_router_kwargs": asdict(self), "request_routing_stats_period_s": self.stats_period_s}

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object]) -> RoutingParams:
        """Build from request_router_kwargs; unknown keys are an error (typos must not pass)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown KV-headroom router parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ReplicaReport:
    """One routing-stats report (worker.api.RoutingStats), parsed once."""

    free_blocks: int
    total_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_waiting_prompt_tokens: int
    reserved_blocks: int
    # Chained block hashes the replica holds on its device. From the replica's KV events
    # (router/routing/kv_index.py: kv_exact, the index's live set, brought up to date at
    # each report), else the report's capped snapshot.
    prefix_hashes: Set[int]
    timestamp: float
    # False once the replica cannot serve (its engine loop stopped, a tensor-parallel rank
    # died): the router stops choosing it at its next report, before Serve's health check
    # replaces it.
    healthy: bool = True
    # The replica's throughput relative to the reference device (mixed GPU types), and its
    # own measured prefill rate (0: not measured; params.prefill_tokens_per_s x weight).
    capacity_weight: float = 1.0
    prefill_tokens_per_s: float = 0.0
    # KV blocks its queued and running requests will still grow into (forecast by the
    # replica, worker/serving/routing_report.py), and its observed mean output length (0: none yet).
    decode_growth_blocks: int = 0
    mean_output_tokens: float = 0.0
    max_num_seqs: int = 0  # sequences it runs at once (0: not reported)
    # LoRA adapters in its device slots and in its host memory (worker.api.RoutingStats).
    lora_resident: frozenset[str] = frozenset()
    lora_loaded: frozenset[str] = frozenset()
    lora_active: frozenset[str] = frozenset()  # resident adapters running sequences use
    max_loras: int = 0  # its device slots (0: not reported)
    # Prefix blocks held below its device (KV tiers), by tier.
    host_prefix_hashes: Set[int] = frozenset()
    disk_prefix_hashes: Set[int] = frozenset()
    # Prompt tokens its running sequences have yet to prefill (0: not reported).
    num_running_prompt_tokens: int = 0
    # The hash sets come from the router's exact index (kv_exact), and when the replica's
    # cache last started empty (its epoch's start or a clear, on the replica's clock): what
    # routers learned of it before then (prefix hints) no longer holds.
    kv_exact: bool = False
    kv_since: float = 0.0
    # Its KV geometry (kv/kv_geometry.py, worker.api.RoutingStats): blocks are its own, so
    # what a request needs there is counted by its groups and windows, never assumed.
    kv_full_groups: int = 1
    kv_sliding_windows: tuple[int, ...] = ()
    kv_bytes_per_block: int = 0
    # Free blocks it keeps for paused sessions (worker.api.RoutingStats): counted in
    # free_blocks, so headroom stays whole; their hashes are in prefix_hashes.
    retained_blocks: int = 0

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(self.block_size, self.kv_full_groups, self.kv_sliding_windows, self.kv_bytes_per_block)

    def request_blocks(self, request: RequestProfile, expected_output_tokens: int) -> int:
        """Blocks of this replica's pool the request will hold (prompt + expected decode),
        by its geometry; one per block_size tokens on a plain full-attention replica."""
        return self.geometry.blocks_for_tokens(request.num_tokens(expected_output_tokens))

    def prefix_blocks(self, num_cached_blocks: int) -> int:
        """Pool blocks a cached prefix of that many (group-0) blocks stands for here."""
        return self.geometry.blocks_for_tokens(num_cached_blocks * self.block_size)

    @property
    def token_capacity(self) -> int:
        """Tokens its whole pool holds for long sequences (load shares compare these)."""
        return self.geometry.token_capacity(self.total_blocks)

    @property
    def free_seqs(self) -> int:
        """Requests it would start at once: its free running slots (0 when unknown)."""
        return max(self.max_num_seqs - self.num_running, 0)

    @classmethod
    def from_stats(cls, stats: Mapping[str, object] | None) -> ReplicaReport | None:
        """None when the replica has not reported yet or the report is malformed."""
        if not stats:
            return None
        try:
            report = cls(
                free_blocks=int(stats["free_blocks"]),  # type: ignore[arg-type]
                total_blocks=int(stats["total_blocks"]),  # type: ignore[arg-type]
                block_size=int(stats["block_size"]),  # type: ignore[arg-type]
                num_running=int(stats.get("num_running", 0)),  # type: ignore[arg-type]
                num_waiting=int(stats.get("num_waiting", 0)),  # type: ignore[arg-type]
                num_waiting_prompt_tokens=int(stats.get("num_waiting_prompt_tokens", 0)),  # type: ignore[arg-type]
                reserved_blocks=int(stats.get("reserved_blocks", 0)),  # type: ignore[arg-type]
                prefix_hashes=frozenset(stats.get("prefix_hashes") or ()),  # type: ignore[arg-type]
                timestamp=float(stats["timestamp"]),  # type: ignore[arg-type]
                healthy=bool(stats.get("healthy", True)),
                capacity_weight=float(stats.get("capacity_weight") or 1.0),  # type: ignore[arg-type]
                prefill_tokens_per_s=float(stats.get("prefill_tokens_per_s") or 0.0),  # type: ignore[arg-type]
                # Absent from reports of replicas older than these fields: no growth known.
                decode_growth_blocks=int(stats.get("decode_growth_blocks") or 0),  # type: ignore[arg-type]
                mean_output_tokens=float(stats.get("mean_output_tokens") or 0.0),  # type: ignore[arg-type]
                max_num_seqs=int(stats.get("max_num_seqs") or 0),  # type: ignore[arg-type]
                lora_resident=frozenset(map(str, stats.get("lora_resident") or ())),  # type: ignore[call-overload]
                lora_loaded=frozenset(map(str, stats.get("lora_loaded") or ())),  # type: ignore[call-overload]
                lora_active=frozenset(map(str, stats.get("lora_active") or ())),  # type: ignore[call-overload]
                max_loras=int(stats.get("max_loras") or 0),  # type: ignore[arg-type]
                host_prefix_hashes=frozenset(stats.get("host_prefix_hashes") or ()),  # type: ignore[arg-type]
                disk_prefix_hashes=frozenset(stats.get("disk_prefix_hashes") or ()),  # type: ignore[arg-type]
                num_running_prompt_tokens=int(stats.get("num_running_prompt_tokens") or 0),  # type: ignore[arg-type]
                kv_since=float(stats.get("kv_since") or 0.0),  # type: ignore[arg-type]
                kv_full_groups=int(stats.get("kv_full_groups", 1)),  # type: ignore[arg-type]
                kv_sliding_windows=tuple(int(w) for w in stats.get("kv_sliding_windows") or ()),  # type: ignore[attr-defined]
                kv_bytes_per_block=int(stats.get("kv_bytes_per_block") or 0),  # type: ignore[arg-type]
                retained_blocks=int(stats.get("retained_blocks") or 0),  # type: ignore[arg-type]
            )
        except (KeyError, TypeError, ValueError):
            return None
        if (report.block_size <= 0 or report.capacity_weight <= 0 or report.prefill_tokens_per_s < 0
                or report.decode_growth_blocks < 0 or not report.mean_output_tokens >= 0
                or report.num_running_prompt_tokens < 0 or report.kv_full_groups < 0
                or not 0 <= report.retained_blocks <= report.free_blocks
                or any(w < 1 for w in report.kv_sliding_windows)
                or report.kv_full_groups + len(report.kv_sliding_windows) < 1):
            return None
        return report

    def expected_output_tokens(self, params: RoutingParams) -> int:
        """Decode tokens to count for a request sent here (before its max_tokens cap): the
        replica's observed mean output length, or the parameter while it has none."""
        if self.mean_output_tokens > 0:
            return max(round(self.mean_output_tokens), 1)
        return params.expected_output_tokens


def request_hash_root(cache_keys: Sequence[str] = (), lora_name: str | None = None,
                      lora_path: str | None = None) -> int:
    """The root a worker chains the request's block hashes from (worker/engine/core.py
    add_request): its cache keys (a tenant's salt), then its LoRA adapter's identity."""
    keys = tuple(cache_keys)
    if lora_name is not None and lora_path is not None:
        keys += (lora_cache_key(lora_name, lora_path),)
    return root_hash(keys)


@dataclass
class RequestProfile:
    """What the policy needs of a request: its token ids, max_tokens and the root of its
    block-hash chain (request_hash_root)."""

    prompt_token_ids: Sequence[int]
    max_tokens: int
    # The root of its block-hash chain (request_hash_root): a salted or adapter prompt
    # matches only blocks cached under the same root.
    hash_root: int = ROOT_HASH
    lora_name: str | None = None  # the LoRA adapter that serves it (None: the base model)
    _hashes_by_block_size: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks (kv.block_hash), memoised per block size."""
        hashes = self._hashes_by_block_size.get(block_size)
        if hashes is None:
            hashes = hash_full_blocks(self.prompt_token_ids, block_size, root=self.hash_root)
            self._hashes_by_block_size[block_size] = hashes
        return hashes

    def cacheable_blocks(self, block_size: int) -> int:
        """Most prompt blocks a cache hit can cover (the last prompt token is always computed)."""
        return max(self.prompt_len - 1, 0) // block_size

    def cached_blocks(self, block_size: int, prefix_hashes: Set[int]) -> int:
        """Leading blocks of the prompt whose chained hash the replica reports as cached."""
        if not prefix_hashes:
            return 0
        limit = self.cacheable_blocks(block_size)
        num = 0
        for h in self.block_hashes(block_size)[:limit]:
            if h not in prefix_hashes:
                break
            num += 1
        return num

    def tier_blocks(self, block_size: int, num_cached: int, host_hashes: Set[int],
                    disk_hashes: Set[int]) -> tuple[int, int]:
        """Blocks after the `num_cached` device hits that a replica's tiers hold, as (host,
        disk): the chain continues while each next block is in either."""
        if not host_hashes and not disk_hashes:
            return 0, 0
        num_host = num_disk = 0
        for h in self.block_hashes(block_size)[num_cached : self.cacheable_blocks(block_size)]:
            if h in host_hashes:
                num_host += 1
            elif h in disk_hashes:
                num_disk += 1
            else:
                break
        return num_host, num_disk

    def num_tokens(self, expected_output_tokens: int) -> int:
        """Tokens the request will hold: prompt plus expected decode tokens."""
        return self.prompt_len + min(max(self.max_tokens, 0), expected_output_tokens)

    def total_blocks(self, block_size: int, expected_output_tokens: int) -> int:
        """Blocks the request will hold on a plain full-attention replica (prompt and decode
        share the prompt's last partial block, hence one ceil over the sum); a replica's own
        geometry: ReplicaReport.request_blocks."""
        return -(-self.num_tokens(expected_output_tokens) // block_size)


@dataclass(frozen=True)
class ReplicaView:
    """A replica as this router sees it at choice time."""

    key: ReplicaKey
    report: ReplicaReport | None
    unreflected_blocks: int = 0  # reserved by this router, not yet in a report
    unreflected_requests: int = 0
    queue_len: int = 0  # requests outstanding there as far as this router knows (pow2)
    # Work promised since the report (the ledger's Unreflected): uncached prompt tokens still
    # to prefill, and the decode blocks those requests will grow into.
    unreflected_prefill_tokens: int = 0
    unreflected_decode_blocks: int = 0


def is_fresh(report: ReplicaReport | None, now: float, params: RoutingParams) -> bool:
    return report is not None and now - report.timestamp <= params.stale_after_s


def power_of_two(views: Sequence[ReplicaView], rng: random.Random) -> list[ReplicaKey]:
    """Two random replicas, shorter queue first (ties: random order), then the rest shuffled."""
    if not views:
        return []
    order = list(views)
    rng.shuffle(order)
    first, rest = order[:2], order[2:]
    first.sort(key=lambda v: v.queue_len)  # stable: ties keep the random order
    return [v.key for v in first + rest]
