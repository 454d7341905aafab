"""llm-d's sticky-until-saturated routing as a ranking.

Stay on the cache-warm replica (the longest cached prefix of the prompt) until its
uncached-token backlog, this request included, exceeds what it can prefill within
`target_s` (llm-d: 14 s); then go to the least-loaded replica.

    cached(q, r)   = max(blocks of q in r's reported prefix hashes (its KV cache, as llm-d's
                         precise scorer learns from KV events),
                         blocks of q this router itself sent to r (router/routing/policies/prefix_index.py))
                     in tokens
    uncached(q, r) = prompt_len(q) - cached(q, r)
    backlog(r)     = reported num_waiting_prompt_tokens(r)
                     + uncached tokens this router sent to r since r's last report
                       (router/routing/reservations.py's ledger, counting tokens instead of blocks)
    saturated(r)   = backlog(r) + uncached(q, r) > prefill_tokens_per_s * target_s

Least-loaded: fewest outstanding requests (view.queue_len), then the smallest backlog.
`prefill_tokens_per_s` is one replica's prefill throughput; llm-d gets it from a profile of
the model server, callers here pass the modelled figure (benchmarks.routing derives it from
the step-cost model). The default is only a placeholder of the right order for an 8B model
on one H200.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.routing.types import RoutingParams, ReplicaKey, ReplicaReport, ReplicaView
from router.routing.policies.base import RoutingRequest, healthy, sorted_keys
from router.routing.policies.prefix_index import PrefixIndex
from router.routing.reservations import ReservationLedger


@dataclass(frozen=True)
class StickyOptions:
    prefill_tokens_per_s: float = 20_000.0
    target_s: float = 14.0
    block_size: int = 16  # of the router's own prefix record
    max_tree_blocks: int = 2**18

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.target_s <= 0:
            raise ValueError("prefill_tokens_per_s and target_s must be > 0")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")

    @property
    def saturation_tokens(self) -> float:
        return self.prefill_tokens_per_s * self.target_s


class StickyPolicy:
    name = "sticky"

    def __init__(self, options: StickyOptions | None = None, params: RoutingParams | None = None) -> None:
        self.options = options or StickyOptions()
        self.params = params or RoutingParams()
        self.index = PrefixIndex(self.options.max_tree_blocks)
        self.ledger = ReservationLedger(self.params.report_lag_s)
        self.last_mode = ""  # "sticky" | "saturated" | "cold"

    def cached_tokens(self, request: RoutingRequest, views: Sequence[ReplicaView]) -> dict[ReplicaKey, int]:
        profile = request.profile
        bs = self.options.block_size
        own = self.index.match(profile.block_hashes(bs)[: profile.cacheable_blocks(bs)], [v.key for v in views])
        cached = {}
        for v in views:
            tokens = own[v.key] * bs
            if v.report is not None:
                rbs = v.report.block_size
                tokens = max(tokens, profile.cached_blocks(rbs, v.report.prefix_hashes) * rbs)
            cached[v.key] = tokens
        return cached

    def backlog(self, view: ReplicaView) -> int:
        reported = view.report.num_waiting_prompt_tokens if view.report is not None else 0
        return reported + self.ledger.unreflected(view.key).blocks

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        views = healthy(views)
        if not views:
            return []
        for v in views:
            if v.report is not None:
                self.ledger.observe_report(v.key, v.report.timestamp)
        cached = self.cached_tokens(request, views)
        uncached = {k: max(request.prompt_len - c, 0) for k, c in cached.items()}
        backlog = {v.key: self.backlog(v) for v in views}
        by_load = sorted_keys(views, lambda v: (v.queue_len, backlog[v.key]))
        warm = sorted_keys(views, lambda v: (-cached[v.key], backlog[v.key]))[0]
        if cached[warm] <= 0:
            self.last_mode, first = "cold", by_load[0]
        elif backlog[warm] + uncached[warm] > self.options.saturation_tokens:
            self.last_mode, first = "saturated", by_load[0]
        else:
            self.last_mode, first = "sticky", warm
        order = [first] + [k for k in by_load if k != first]
        self.ledger.reserve(request.request_id, first, uncached, now)
        self.index.insert(first, request.profile.block_hashes(self.options.block_size))
        return order

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaKey, now: float) -> None:
        self.ledger.routed(request.request_id, replica)
        self.index.insert(replica, request.profile.block_hashes(self.options.block_size))

    def on_complete(self, request_id: str, replica: ReplicaKey, now: float) -> None:
        self.ledger.complete(request_id, replica)

    def on_report(self, replica: ReplicaKey, report: ReplicaReport, now: float) -> None:
        self.ledger.observe_report(replica, report.timestamp)
