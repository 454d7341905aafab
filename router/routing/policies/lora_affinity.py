"""The Gateway API Inference Extension's LoRA-aware scheduler (its endpoint picker's default
decision tree for a critical request), as a baseline for benchmarks.lora and the
simulator only: kvserve's routers serve with the headroom policy.

    low queue  (replicas with <= QUEUEING_THRESHOLD_LORA waiting requests)
      some  -> LoRA affinity -> least queue -> least KV  (over the low-queue replicas)
      none  -> least queue -> LoRA affinity -> least KV  (over all of them)
    then a uniformly random pick among what is left

    LoRA affinity: `affinity` = replicas where the adapter is active, `available` = the
    others with fewer than max_loras active adapters. Both non-empty: `affinity` with
    probability LORA_AFFINITY_THRESHOLD, else `available`; one empty: the other; both
    empty: the filter fails and the next filter gets its input unchanged.
    least queue / least KV: the replicas within (max - min) / n of the minimum.

The extension reads vLLM's metrics: the adapters of running and of waiting requests
(`running_lora_adapters`, `waiting_lora_adapters`) and `max_lora`. A kvserve replica
reports the adapters in its device slots (`lora_resident`), so those count as active here
(an idle slot stays resident until another adapter needs it, so a replica's slots look
full once warm, where vLLM's count falls as its adapters' requests end); max_lora is the
`max_loras` option. A request for the base model skips the affinity filter. Queue and KV
usage are the last report's: the extension counts nothing sent since its last scrape.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.routing.policies.base import RoutingRequest, StatelessHooks, healthy, kv_usage, sorted_keys
from router.routing.types import ReplicaKey, ReplicaView

# The extension's defaults (pkg/epp/scheduling/config: QUEUEING_THRESHOLD_LORA,
# LORA_AFFINITY_THRESHOLD).
QUEUEING_THRESHOLD_LORA = 128
LORA_AFFINITY_THRESHOLD = 0.999


@dataclass(frozen=True)
class LoraAffinityOptions:
    max_loras: int  # the replicas' lora.max_loras (vLLM's max_lora metric)
    queueing_threshold: int = QUEUEING_THRESHOLD_LORA
    affinity_threshold: float = LORA_AFFINITY_THRESHOLD

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.queueing_threshold < 0 or not 0.0 <= self.affinity_threshold <= 1.0:
            raise ValueError("max_loras must be >= 1, queueing_threshold >= 0, affinity_threshold in [0, 1]")


def _waiting(view: ReplicaView) -> int:
    return view.report.num_waiting if view.report is not None else 0


def _active(view: ReplicaView) -> frozenset[str]:
    return view.report.lora_resident if view.report is not None else frozenset()


def _within_first_range(views: list[ReplicaView], metric: Callable[[ReplicaView], float]) -> list[ReplicaView]:
    """The extension's least-queue / least-KV filter: the views whose metric lies within
    (max - min) / n of the minimum (never empty)."""
    values = [metric(v) for v in views]
    lo, hi = min(values), max(values)
    limit = lo + (hi - lo) / len(views)
    return [v for v, x in zip(views, values) if x <= limit]


class LoraAffinityPolicy(StatelessHooks):
    name = "lora_affinity"

    def __init__(self, options: LoraAffinityOptions, seed: int = 0) -> None:
        self.options = options
        self._rng = random.Random(seed)

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        candidates = healthy(views)
        if not candidates:
            return []
        chosen = self._pick(request, candidates)
        first = self._rng.choice(chosen)
        # The extension picks one replica; the rest follow for Serve's max_ongoing_requests
        # fallback, shortest reported queue first.
        rest = sorted_keys([v for v in candidates if v is not first], lambda v: (_waiting(v), kv_usage(v.report)))
        return [first.key, *rest]

    def _pick(self, request: RoutingRequest, views: list[ReplicaView]) -> list[ReplicaView]:
        low = [v for v in views if _waiting(v) <= self.options.queueing_threshold]
        if low:
            return self._least_kv(self._least_queue(self._affinity(request, low)))
        return self._least_kv(self._affinity(request, self._least_queue(views)))

    def _affinity(self, request: RoutingRequest, views: list[ReplicaView]) -> list[ReplicaView]:
        """The LoRA soft-affinity filter; on failure (no group) its input, as the tree passes on."""
        name = request.lora_name
        if name is None:
            return views
        affinity = [v for v in views if name in _active(v)]
        available = [v for v in views if name not in _active(v) and len(_active(v)) < self.options.max_loras]
        if affinity and available:
            return affinity if self._rng.random() < self.options.affinity_threshold else available
        return affinity or available or views

    @staticmethod
    def _least_queue(views: list[ReplicaView]) -> list[ReplicaView]:
        return _within_first_range(views, _waiting)

    @staticmethod
    def _least_kv(views: list[ReplicaView]) -> list[ReplicaView]:
        return _within_first_range(views, lambda v: kv_usage(v.report))
