"""kvserve's KV-headroom routing as a RoutingPolicy: router/headroom.py's rank_replicas with
router/reservations.py's ReservationLedger, used exactly as router/request_router.py uses
them (reserve the need on the top rank at choice time, move it when the request was sent
elsewhere, release it on completion, stop counting it once a later report shows it). The
scoring lives in router/headroom.py only."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from router.headroom import HeadroomParams, ReplicaKey, ReplicaReport, ReplicaView, rank_replicas
from router.policies.base import RoutingRequest
from router.routing_view import LocalRoutingView, RoutingView

# Ledger housekeeping at most this often (as router/request_router.py).
_PRUNE_INTERVAL_S = 1.0


class HeadroomPolicy:
    name = "headroom"

    def __init__(self, params: HeadroomParams | None = None, seed: int = 0, view: RoutingView | None = None) -> None:
        self.params = params or HeadroomParams()
        # The routing view (router/routing_view.py): private unless the caller shares one
        # between routers (Redis under Serve, one object in the simulator).
        self.ledger: RoutingView = view if view is not None else LocalRoutingView(self.params.report_lag_s)
        self._rng = random.Random(seed)
        self._last_prune_s = -float("inf")
        self.last_mode = ""  # router/headroom.py's MODE_*

    def _view(self, view: ReplicaView) -> ReplicaView:
        if view.report is not None:
            self.ledger.observe_report(view.key, view.report.timestamp)
        unreflected = self.ledger.unreflected(view.key)
        return replace(view, unreflected_blocks=unreflected.blocks, unreflected_requests=unreflected.requests)

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        if now - self._last_prune_s >= _PRUNE_INTERVAL_S:
            self._last_prune_s = now
            self.ledger.prune(now, None, self.params.unconfirmed_ttl_s, self.params.reservation_ttl_s)
        ranking = rank_replicas(request.profile, [self._view(v) for v in views], self.params, now, self._rng)
        self.last_mode = ranking.mode
        if ranking.order:
            self.ledger.reserve(request.request_id, ranking.order[0], ranking.need_blocks, now)
        return list(ranking.order)

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaKey, now: float) -> None:
        self.ledger.routed(request.request_id, replica)

    def on_complete(self, request_id: str, replica: ReplicaKey, now: float) -> None:
        self.ledger.complete(request_id, replica)

    def on_report(self, replica: ReplicaKey, report: ReplicaReport, now: float) -> None:
        self.ledger.observe_report(replica, report.timestamp)
