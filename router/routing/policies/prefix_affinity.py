"""SGLang's cache-aware router (sgl-router "cache_aware" policy) as a ranking.

Per request, with load(r) = requests outstanding on r (view.queue_len):

  1. Imbalanced (max load - min load > balance_abs_threshold AND
     max load > balance_rel_threshold * min load): shortest queue first.
  2. Otherwise look the prompt up in the router's own prefix record (router/routing/policies/
     prefix_index.py: what this router sent where). If the best match covers more than
     cache_threshold of the prompt, that replica first (ties: lower load); else the replica
     with the smallest record first (most room to cache a new prefix).
  The rest follow by load, so a refusal falls to the least-loaded.

The chosen replica's record gets the prompt at choice time (SGLang inserts on selection, so
the next request of a burst already sees it), and the replica Serve really used gets it too
if that was another. Defaults are sgl-router's: cache_threshold 0.5, balance_abs_threshold
32, balance_rel_threshold 1.0001, max_tree_size 2**24 characters (~2**22 tokens at ~4
characters a token, here 2**18 blocks of 16 tokens). SGLang matches characters; this matches
whole blocks of `block_size` tokens (a partial last block never counts).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.routing.types import ReplicaKey, ReplicaView
from router.routing.policies.base import RoutingRequest, StatelessHooks, healthy, sorted_keys
from router.routing.policies.prefix_index import PrefixIndex


@dataclass(frozen=True)
class PrefixAffinityOptions:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    block_size: int = 16
    max_tree_blocks: int = 2**18

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")


def imbalanced(loads: Sequence[int], abs_threshold: float, rel_threshold: float) -> bool:
    if len(loads) < 2:
        return False
    lo, hi = min(loads), max(loads)
    return hi - lo > abs_threshold and hi > lo * rel_threshold


class PrefixAffinityPolicy(StatelessHooks):
    name = "prefix_affinity"

    def __init__(self, options: PrefixAffinityOptions | None = None) -> None:
        self.options = options or PrefixAffinityOptions()
        self.index = PrefixIndex(self.options.max_tree_blocks)
        self.last_mode = ""  # "balance" | "cache" | "spread": the rule that chose the first rank

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        views = healthy(views)
        if not views:
            return []
        opts = self.options
        by_load = sorted_keys(views, lambda v: v.queue_len)
        hashes = request.profile.block_hashes(opts.block_size)
        if imbalanced([v.queue_len for v in views], opts.balance_abs_threshold, opts.balance_rel_threshold):
            self.last_mode = "balance"
            first = by_load[0]
        else:
            depth = self.index.match(hashes, [v.key for v in views])
            best = sorted_keys(views, lambda v: (-depth[v.key], v.queue_len))[0]
            match_rate = depth[best] * opts.block_size / request.prompt_len if request.prompt_len else 0.0
            if match_rate > opts.cache_threshold:
                self.last_mode = "cache"
                first = best
            else:
                self.last_mode = "spread"
                first = sorted_keys(views, lambda v: (self.index.size(v.key), v.queue_len))[0]
        self.index.insert(first, hashes)
        return [first] + [k for k in by_load if k != first]

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaKey, now: float) -> None:
        # Serve may have sent it below the first rank: that replica now caches it too.
        self.index.insert(replica, request.profile.block_hashes(self.options.block_size))
