"""kvserve's KV-headroom routing as a RoutingPolicy: router/ranking.py's rank_replicas with a
routing view (router/routing_view.py: the reservation ledger plus prefix hints): reserve the
need, the uncached prompt tokens and the decode blocks on the top rank at choice time, move
them when the request was sent elsewhere, release them on completion, stop counting them
once a later report shows the request; learn which replica got which prefix, and which
replica served each session last (router/sessions.py, which also counts each replica's
active sessions for new ones), and the mean uncached prompt a dispatch carries (the load
gate's unit of move cost). The scoring lives in router/ranking.py only."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from router.headroom import HeadroomParams, ReplicaKey, ReplicaReport, ReplicaView
from router.policies.base import RoutingRequest
from router.ranking import rank_replicas
from router.routing_view import LocalRoutingView, RoutingView
from router.sessions import SessionTable

# Ledger housekeeping at most this often (as router/request_router.py).
_PRUNE_INTERVAL_S = 1.0
# Sessions remembered for soft affinity (least recently used forgotten first).
_MAX_SESSIONS = 1 << 16
# Weight of one dispatch in the mean uncached prompt tokens (an exponential average over
# roughly the last 1/_WORK_ALPHA dispatches: follows a workload's shift within seconds).
_WORK_ALPHA = 0.02


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
        self._block_size: int | None = None  # the replicas' KV block size, from their reports
        # session id -> the replica that served it last (soft affinity), and active sessions
        # per replica (new sessions spread by them).
        self.sessions = SessionTable(self.params.session_idle_s, _MAX_SESSIONS)
        # Mean uncached prompt tokens per dispatched request (0 until the first one).
        self.request_tokens = 0.0

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
        session = counts = None
        if request.session_id is not None:
            active = self.sessions.active_counts(now)  # expires idle sessions first
            session = self.sessions.replica_of(request.session_id)
            counts = active if session is None else None  # only a new session is spread
        ranking = rank_replicas(request.profile, [self._view(v) for v in views], self.params, now, self._rng,
                                hints=self._hints(request, views), session_replica=session,
                                session_counts=counts, request_tokens=self.request_tokens)
        self.last_mode = ranking.mode
        if ranking.order:
            top = ranking.order[0]
            self.ledger.reserve(request.request_id, top, ranking.need_blocks, now,
                                prefill_tokens=dict(ranking.prefill_tokens), decode_blocks=ranking.decode_blocks)
            tokens = ranking.prefill_tokens.get(top, request.prompt_len)
            self.request_tokens = tokens if self.request_tokens == 0 else (
                self.request_tokens + _WORK_ALPHA * (tokens - self.request_tokens))
        return list(ranking.order)

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaKey, now: float) -> None:
        self.ledger.routed(request.request_id, replica)
        report_bs = self._block_size
        if report_bs is not None:
            self.ledger.learn_prefix(replica, request.profile.block_hashes(report_bs), now)
        if request.session_id is not None:
            self.sessions.touch(request.session_id, replica, now)

    def on_complete(self, request_id: str, replica: ReplicaKey, now: float) -> None:
        self.ledger.complete(request_id, replica)

    def on_report(self, replica: ReplicaKey, report: ReplicaReport, now: float) -> None:
        self._block_size = report.block_size
        self.ledger.observe_report(replica, report.timestamp)
