"""The request router in this process, as admission control's SnapshotSource
(router/routing/admission.py): the reports the worker handle's router holds and, for a view-aware
policy, its routing view's unreflected work and its send count."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from router.routing.admission import Clock, RoutingSnapshot
from router.routing.types import RoutingParams, ReplicaReport
from router.routing.reservations import Unreflected


class RouterSnapshotSource:
    """Reads the reports the worker handle's request router holds (it runs on Serve's router
    thread; its replica dict and each replica's stats dict are replaced, not mutated, so a
    copy taken here is consistent). Reports are parsed once per new timestamp.

    A view-aware router's view is read too, off the router's thread: its figures are ints
    (a read torn between two of them is off by one request for one judge), and
    RedisRoutingView answers from the copy its last sync read (no Redis round trip here)."""

    def __init__(self, handle: Any, clock: Clock = time.time) -> None:
        self._handle = handle
        self._clock = clock
        self._parsed: dict[Any, ReplicaReport | None] = {}

    def snapshot(self) -> RoutingSnapshot | None:
        from router.serve_internals import initialized_request_router_of

        router = initialized_request_router_of(self._handle)
        params = getattr(router, "params", None)
        if router is None or not isinstance(params, RoutingParams):
            return None
        if getattr(getattr(router, "policy", None), "name", "") == "pow2":
            return None  # pow2 stands for Serve's own router, which holds nothing back
        for _ in range(3):
            try:
                replicas = list(router.curr_replicas.values())
                unreflected, routed_total = _router_view(router, replicas)
                break
            except RuntimeError:  # a dict changed size under us (router thread); retry
                continue
        else:
            return None
        reports = tuple(self._report(replica.replica_id, replica.routing_stats) for replica in replicas)
        live = {replica.replica_id for replica in replicas}
        for gone in [k for k in self._parsed if k not in live]:
            del self._parsed[gone]
        return RoutingSnapshot(reports, params, self._clock(), unreflected, routed_total)

    def _report(self, replica_id: Any, stats: dict[str, Any] | None) -> ReplicaReport | None:
        cached = self._parsed.get(replica_id)
        if cached is not None and stats and stats.get("timestamp") == cached.timestamp:
            return cached
        report = ReplicaReport.from_stats(stats)
        self._parsed[replica_id] = report
        return report


def _router_view(router: Any, replicas: Sequence[Any]) -> tuple[tuple[Unreflected, ...], int | None]:
    """The router's view of each replica and its send count; ((), None) when its policy
    keeps no view (baselines). The count is read first: a request is in the view from its
    reservation (choice) on, before its send counts, so a send between the two reads is
    counted twice for one judge, never missed."""
    if not getattr(router, "_uses_view", False):
        return (), None
    routed_total = int(router.num_dispatched)
    return tuple(router.view.unreflected(replica.replica_id) for replica in replicas), routed_total
