"""KVHeadroomRouter: the KV-headroom policy (router/headroom.py) as a Ray Serve 2.60 router.

Use it on the worker deployment:

    RequestRouterConfig(
        request_router_class="router.request_router:KVHeadroomRouter",
        # request_router_kwargs (HeadroomParams fields) and request_routing_stats_period_s,
        # the latter derived from the params' stats_period_s:
        **HeadroomParams(...).serve_router_config(),
    )

How Serve 2.60 drives it (read from ray/serve/_private/router.py and request_router/):
  * Serve cloudpickles this class BY VALUE (RequestRouterConfig registers this module for
    pickle-by-value) and builds one instance per DeploymentHandle process: in every caller
    of the worker deployment (each ingress replica; the driver for a driver-side handle).
    Module-level state here is therefore per copy, not shared; router.headroom and kv/
    are imported normally (they must be importable wherever the handle lives).
  * `choose_replicas(candidate_replicas, pending_request)` runs on the router's event loop
    (a separate thread in the caller process) once per routing attempt. Arguments are
    already resolved, so `pending_request.args[0]` is the GenerateRequest itself (a
    DeploymentResponse passed as the argument would arrive as an ObjectRef; the ingress
    must pass the GenerateRequest by value). The returned ranks are tried in order; within
    one rank Serve picks the shortest queue, so every rank here holds one replica. A rank
    is skipped when the replica refuses (max_ongoing_requests reached).
  * `on_request_routed(pending_request, replica_id, result)` is called only after the
    replica ACCEPTED the request (the rejection protocol, on for every caller outside Ray
    Client), i.e. one round trip after the choice. Reserving there would let a burst
    herd, so the reservation is taken in `choose_replicas` on the top-ranked replica and
    only moved here if Serve sent the request to a lower rank.
  * `on_request_completed(replica_id, internal_request_id)` fires once per SENT request,
    when its result (a whole stream for a streaming call) finishes, fails, is cancelled or
    was rejected; it is scheduled onto the router's loop with call_soon_threadsafe, so it
    can arrive after a retry of the same request was already chosen (the ledger ignores a
    completion from another replica than the live reservation's).
  * `replica.routing_stats` is the dict the replica's `record_routing_stats` returned last:
    the controller polls each replica every request_routing_stats_period_s and broadcasts
    changed stats to the routers, so it is one period plus a broadcast old. Until the first
    report it is {} (-> power-of-two for that replica).

Several router copies (one per ingress replica) each see only their own dispatches. That is
the "private views herd together" failure mode; mitigations here:
  * proportional ranking: each copy spreads its share of a burst in proportion to
    headroom, so N copies together still spread in proportion instead of all choosing the
    emptiest replica (which absolute-headroom routing with private views would do);
  * reservations stop counting as soon as a report taken after the dispatch arrives;
    that report shows every router's requests, so private views re-converge once per
    stats period;
  * `headroom_share` (set it to 1/N for N ingress replicas) bounds the over-commitment of
    N private views within one period.
A shared view (reservations in Redis, keyed by replica and report timestamp) is later work
(cluster/ owns the state store).
"""
from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.reservations import ReservationLedger
from router.serve_internals import cached_queue_len, router_now_s
from router.headroom import (
    HeadroomParams,
    ReplicaKey,
    ReplicaReport,
    ReplicaView,
    RequestProfile,
    rank_replicas,
)

logger = logging.getLogger("ray.serve")

# Ledger housekeeping at most this often (drops reservations Serve never confirmed).
_PRUNE_INTERVAL_S = 1.0
# Memoised request hashes are dropped beyond this many (requests that never completed).
_MAX_PROFILES = 10_000


def request_profile(pending_request: PendingRequest | None) -> RequestProfile | None:
    """The routing-relevant part of a `WorkerReplica.generate(GenerateRequest)` call, or None
    for any other call (stats, model_info, abort...), which is routed by power-of-two."""
    if pending_request is None:
        return None
    request = pending_request.args[0] if pending_request.args else pending_request.kwargs.get("request")
    token_ids = getattr(request, "prompt_token_ids", None)
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        return None
    max_tokens = getattr(getattr(request, "params", None), "max_tokens", 0)
    if not isinstance(max_tokens, int):
        max_tokens = 0
    return RequestProfile(prompt_token_ids=token_ids, max_tokens=max_tokens)


class ReplicaStateRouter(RequestRouter):
    """A Serve router that keeps state per replica (reports, reservations): it forgets a
    replica as soon as Serve drops it from the set or reports its actor dead."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_gone_replicas({replica.replica_id for replica in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_gone_replicas(set(self.curr_replicas))

    def _forget_gone_replicas(self, live: set[ReplicaID]) -> None:
        raise NotImplementedError

    def _start_choice(self, pending_request: PendingRequest | None) -> float:
        """The routing attempt's time (the router's clock)."""
        if pending_request is not None:
            # Without this, Serve retries immediately (no backoff) when every rank refuses.
            pending_request.routing_context.should_backoff = True
        return router_now_s(self)

    @staticmethod
    def _ranks(candidates: list[RunningReplica], order: Sequence[ReplicaKey]) -> list[list[RunningReplica]]:
        """One replica per rank: within a rank Serve would pick by queue length itself."""
        by_id = {replica.replica_id: replica for replica in candidates}
        return [[by_id[key]] for key in order]


class KVHeadroomRouter(ReplicaStateRouter):
    """Ranks worker replicas by KV headroom (router/headroom.py) and tracks the blocks it
    promised each replica since that replica's last report."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure(HeadroomParams())

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with RequestRouterConfig.request_router_kwargs (HeadroomParams fields)."""
        self._configure(HeadroomParams.from_kwargs(kwargs))

    def _configure(self, params: HeadroomParams) -> None:
        self._params = params
        self._ledger = ReservationLedger(params.report_lag_s)
        self._reports: dict[ReplicaID, ReplicaReport | None] = {}
        self._profiles: dict[str, RequestProfile] = {}
        self._rng = random.Random()
        self._last_prune_s = 0.0
        # Routing decisions by policy mode (headroom / load_gate / pow2) and lifecycle hook
        # calls (routed / completed), for metrics and tests.
        self.num_decisions_by_mode: Counter[str] = Counter()
        self.num_hook_calls: Counter[str] = Counter()

    @property
    def params(self) -> HeadroomParams:
        return self._params

    # ------------------------------------------------------------------ choosing

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        now = self._start_choice(pending_request)
        self._maybe_prune(now)
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        profile = self._profile(request_id, pending_request)
        views = [self._view(replica) for replica in candidate_replicas]
        ranking = rank_replicas(profile, views, self._params, now, self._rng)
        self.num_decisions_by_mode[ranking.mode] += 1
        if profile is not None and request_id is not None and ranking.order:
            # Counted at dispatch time: the next choice (maybe microseconds later, in the
            # same burst) already sees these blocks as taken.
            self._ledger.reserve(request_id, ranking.order[0], ranking.need_blocks, now)
        return self._ranks(candidate_replicas, ranking.order)

    def _profile(self, request_id: str | None, pending_request: PendingRequest | None) -> RequestProfile | None:
        if request_id is not None:
            cached = self._profiles.get(request_id)
            if cached is not None:
                return cached
        profile = request_profile(pending_request)
        if profile is not None and request_id is not None:
            if len(self._profiles) >= _MAX_PROFILES:
                self._profiles.clear()
            self._profiles[request_id] = profile
        return profile

    def _report(self, replica: RunningReplica) -> ReplicaReport | None:
        """The replica's parsed report; re-parsed only when a new one arrived."""
        stats = replica.routing_stats
        cached = self._reports.get(replica.replica_id)
        if cached is not None and stats and stats.get("timestamp") == cached.timestamp:
            return cached
        report = ReplicaReport.from_stats(stats)
        self._reports[replica.replica_id] = report
        if report is not None:
            self._ledger.observe_report(replica.replica_id, report.timestamp)
        return report

    def _view(self, replica: RunningReplica) -> ReplicaView:
        replica_id = replica.replica_id
        report = self._report(replica)
        unreflected = self._ledger.unreflected(replica_id)
        queue_len = cached_queue_len(self, replica_id)
        if queue_len is None:
            queue_len = self._ledger.outstanding(replica_id)
        return ReplicaView(replica_id, report, unreflected.blocks, unreflected.requests, queue_len)

    # ------------------------------------------------------------------ lifecycle hooks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        self.num_hook_calls["routed"] += 1
        if self._ledger.replica_of(request_id) not in (None, replica_id):
            self.num_hook_calls["moved"] += 1
        self._ledger.routed(request_id, replica_id)
        self._profiles.pop(request_id, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.num_hook_calls["completed"] += 1
        self._ledger.complete(internal_request_id, replica_id)
        self._profiles.pop(internal_request_id, None)

    def _forget_gone_replicas(self, live: set[ReplicaID]) -> None:
        for replica_id in [r for r in self._reports if r not in live]:
            del self._reports[replica_id]
        self._ledger.prune(
            router_now_s(self), live, self._params.unconfirmed_ttl_s, self._params.reservation_ttl_s
        )

    def _maybe_prune(self, now: float) -> None:
        if now - self._last_prune_s < _PRUNE_INTERVAL_S:
            return
        self._last_prune_s = now
        dropped = self._ledger.prune(now, None, self._params.unconfirmed_ttl_s, self._params.reservation_ttl_s)
        if dropped:
            logger.debug("KV-headroom router dropped %d abandoned reservations", dropped)

    # ------------------------------------------------------------------ introspection

    def routing_view(self) -> dict[str, dict[str, Any]]:
        """Per replica (unique id): the last stats seen (prefix_hashes replaced by their
        count) and this router's reservations. Safe to call from another thread (copies)."""
        for _ in range(3):
            try:
                replicas: Sequence[RunningReplica] = list(self.curr_replicas.values())
                out: dict[str, dict[str, Any]] = {}
                for replica in replicas:
                    stats = dict(replica.routing_stats or {})
                    stats["prefix_hashes"] = len(stats.get("prefix_hashes") or ())
                    unreflected = self._ledger.unreflected(replica.replica_id)
                    out[replica.replica_id.unique_id] = {
                        "stats": stats,
                        "unreflected_blocks": unreflected.blocks,
                        "unreflected_requests": unreflected.requests,
                        "outstanding": self._ledger.outstanding(replica.replica_id),
                    }
                return out
            except RuntimeError:  # a dict changed size under us (router thread); retry
                continue
        return {}
