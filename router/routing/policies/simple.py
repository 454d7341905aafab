"""Load-only baselines: round robin, Serve's power of two choices, least KV usage."""
from __future__ import annotations

import random
from collections.abc import Sequence

from router.routing.types import ReplicaKey, ReplicaView, power_of_two
from router.routing.policies.base import RoutingRequest, StatelessHooks, healthy, kv_usage, sorted_keys


class RoundRobinPolicy(StatelessHooks):
    """Each request starts one place further along the candidate list (then the rest in
    order, so a refusal falls through to the next replica)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        keys = [v.key for v in healthy(views)]
        if not keys:
            return []
        start = self._next % len(keys)
        self._next += 1
        return keys[start:] + keys[:start]


class PowerOfTwoPolicy(StatelessHooks):
    """Ray Serve's default: two random replicas, the shorter queue first, then the rest in
    random order (router/routing/types.py's power_of_two, the headroom policy's own fallback)."""

    name = "pow2"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        return power_of_two(healthy(views), self._rng)


class LeastKVPolicy(StatelessHooks):
    """AIBrix's least-kv-cache / production-stack style: the lowest KV usage at the last
    report first (ties: shorter queue, then candidate order). It sees nothing of the
    requests sent since that report, so a burst between two reports herds onto one replica:
    that is the baseline's known weakness, kept on purpose."""

    name = "least_kv"

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        return sorted_keys(healthy(views), lambda v: (kv_usage(v.report), v.queue_len))
