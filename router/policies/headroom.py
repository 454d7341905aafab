"""kvserve's KV-headroom routing as a RoutingPolicy: router/ranking.py's rank_replicas with a
routing view (router/routing_view.py: the reservation ledger plus prefix hints): reserve the
need, the uncached prompt tokens and the decode blocks on the top rank at choice time, move
them when the request was sent elsewhere, release them on completion, stop counting them
once a later report shows the request; learn which replica got which prefix, and which
replica served each session last. The scoring lives in router/ranking.py only."""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

from router.headroom import HeadroomParams, ReplicaKey, ReplicaReport, ReplicaView
from router.policies.base import RoutingRequest
from router.ranking import rank_replicas
from router.routing_view import LocalRoutingView, RoutingView

# Ledger housekeeping at most this often (as router/request_router.py).
_PRUNE_INTERVAL_S = 1.0
# Sessions remembered for soft affinity (least recently used forgotten first).
_MAX_SESSIONS = 1 << 16


class HeadroomPolicy:
    name = "headroom"

    def __init__(self, params: HeadroomParams | None = None, seed: int = 0, view: RoutingView | None = None) -> None:
        self.params = params or HeadroomParams()
        # The routing view (router/routing_view.py): private unless the caller shares one
        # between routers (Redis under Serve, one object in the simulator).
        self.ledger: RoutingView = view if view is not None else LocalRoutingView(self.params.report_lag_s)
        self._rng = random.Random(seed)
        self._last_prune_s = -float("inf")
        self.last_mode = ""  # router/ranking.py's MODE_*
        # session id -> the replica that served it last (soft affinity), bounded LRU.
        self._block_size: int | None = None  # the replicas' KV block size, from their reports
        self._sessions: OrderedDict[str, ReplicaKey] = OrderedDict()

    def _view(self, view: ReplicaView) -> ReplicaView:
        if view.report is not None:
            self.ledger.observe_report(view.key, view.report.timestamp)
        unreflected = self.ledger.unreflected(view.key)
        return replace(view, unreflected_blocks=unreflected.blocks, unreflected_requests=unreflected.requests,
                       unreflected_prefill_tokens=unreflected.prefill_tokens,
                       unreflected_decode_blocks=unreflected.decode_blocks)

    def _hints(self, request: RoutingRequest, views: Sequence[ReplicaView]) -> dict[ReplicaKey, int]:
        """Prefix owners routers learned from their dispatches, at the reports' block size."""
        bs = next((v.report.block_size for v in views if v.report is not None), None)
        if bs is None:
            return {}
        self._block_size = bs  # on_dispatch learns the prefix at this block size
        return self.ledger.prefix_owner_hints(request.profile.block_hashes(bs))

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        if now - self._last_prune_s >= _PRUNE_INTERVAL_S:
            self._last_prune_s = now
            self.ledger.prune(now, None, self.params.unconfirmed_ttl_s, self.params.reservation_ttl_s)
        session = self._sessions.get(request.session_id) if request.session_id is not None else None
        ranking = rank_replicas(request.profile, [self._view(v) for v in views], self.params, now, self._rng,
                                hints=self._hints(request, views), session_replica=session)
        self.last_mode = ranking.mode
        if ranking.order:
            self.ledger.reserve(request.request_id, ranking.order[0], ranking.need_blocks, now,
                                prefill_tokens=dict(ranking.prefill_tokens), decode_blocks=ranking.decode_blocks)
        return list(ranking.order)

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaKey, now: float) -> None:
        self.ledger.routed(request.request_id, replica)
        report_bs = self._block_size
        if report_bs is not None:
            self.ledger.learn_prefix(replica, request.profile.block_hashes(report_bs), now)
        if request.session_id is not None:
            self._sessions[request.session_id] = replica
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > _MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def on_complete(self, request_id: str, replica: ReplicaKey, now: float) -> None:
        self.ledger.complete(request_id, replica)

    def on_report(self, replica: ReplicaKey, report: ReplicaReport, now: float) -> None:
        self._block_size = report.block_size
        self.ledger.observe_report(replica, report.timestamp)
