"""PolicyRouter: any routing policy of router/policies/ as a Ray Serve 2.60 request router.

    RequestRouterConfig(
        request_router_class="router.policy_router:PolicyRouter",
        request_router_kwargs={"policy": "prefix_affinity",   # a name in POLICY_NAMES
                               "stats_period_s": 1.0,           # HeadroomParams fields
                               "balance_abs_threshold": 32},    # the policy's own options
        request_routing_stats_period_s=1.0,
    )

It is fed exactly as router/request_router.py's KVHeadroomRouter (read its docstring for how
Serve drives a router: one instance per handle process, choose_replicas on the router's
event loop, on_request_routed after the replica accepted, on_request_completed once per sent
request): the replicas' routing stats parsed into ReplicaReports (a new one is passed to the
policy's on_report), the request's token ids from the `generate` call
(request_router.request_profile), and Serve's queue-length cache as each view's queue_len
(this router's own outstanding count where the cache holds nothing). Calls other than
`generate` carry no token ids and are ranked by power of two choices, as in KVHeadroomRouter.

So the real cluster runs the same policy objects as the discrete-event simulator
(cluster/sim/), and every baseline can be compared side by side through real Serve.

The routing view (router/routing_view.py) a view-aware policy (headroom) keeps its
reservations and prefix hints in: private (LocalRoutingView) unless request_router_kwargs
carry `shared_view` (router/redis_view.py's SharedViewSpec as a dict), then shared by every
router copy (one per ingress replica) through Redis; its read is awaited before each
decision (`RedisRoutingView.sync`: one round trip at most, bounded wait).

Warm start (`warm_start`, default on): before its first decision a router asks every
candidate replica for its routing stats now (serve_internals.fetch_routing_stats), so a
router that starts or restarts knows what each replica caches from its first request on,
not one stats period later.
"""
from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from router import tracing
from router.headroom import HeadroomParams, ReplicaReport, ReplicaView, power_of_two
from router.policies import RoutingPolicy, RoutingRequest, make_policy, split_policy_kwargs
from router.policies.base import healthy
from router.redis_view import RedisRoutingView, SharedViewSpec
from router.router_base import ReplicaStateRouter, request_profile, request_session_id
from router.routing_view import LocalRoutingView, RoutingView
from router.serve_internals import cached_queue_len, fetch_routing_stats, router_now_s

logger = logging.getLogger("ray.serve")

# Requests chosen but never routed nor completed (cancelled before Serve sent them) are
# forgotten beyond this many.
_MAX_PENDING = 10_000
# Warm start: how long the first decision waits for the replicas' stats at most.
WARM_START_TIMEOUT_S = 2.0


def make_view(shared_view: Mapping[str, Any] | None, params: HeadroomParams) -> RoutingView:
    """The router's routing view: shared through Redis when `shared_view` (a SharedViewSpec
    as a dict) is given, else private."""
    if shared_view is None:
        return LocalRoutingView(params.report_lag_s)
    return RedisRoutingView(SharedViewSpec.from_dict(shared_view), params.report_lag_s)


class PolicyRouter(ReplicaStateRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure({})

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with RequestRouterConfig.request_router_kwargs: `policy` (a name),
        `seed` (int, optional), `shared_view` (a SharedViewSpec dict, optional),
        `warm_start` (bool, default True), HeadroomParams fields and the policy's own options."""
        self._configure(kwargs)

    def _configure(self, kwargs: dict[str, Any]) -> None:
        kwargs = dict(kwargs)
        seed = kwargs.pop("seed", None)
        shared_view = kwargs.pop("shared_view", None)
        self._warm_start = bool(kwargs.pop("warm_start", True))
        name, params, options = split_policy_kwargs(kwargs)
        rng_seed = int(seed) if seed is not None else random.randrange(2**32)
        self.view: RoutingView = make_view(shared_view, params)
        self.policy: RoutingPolicy = make_policy(name, params, rng_seed, view=self.view, **options)
        # Baselines keep their own state: only a policy that took the view needs it read.
        self._uses_view = getattr(self.policy, "ledger", None) is self.view
        self.params = params
        self._warm_stats: dict[ReplicaID, dict[str, Any]] = {}  # stats pulled at start
        self._warmed = not self._warm_start
        self._rng = random.Random(rng_seed + 1)
        self._reports: dict[ReplicaID, ReplicaReport | None] = {}
        self._pending: dict[str, RoutingRequest] = {}  # chosen, not yet routed
        self._sent: dict[str, ReplicaID] = {}  # routed, not yet completed
        self._outstanding: Counter[ReplicaID] = Counter()
        # Decisions by the policy's mode (its `last_mode`, or its name) and "pow2" for calls
        # without token ids; lifecycle hook calls. For metrics and tests.
        self.num_decisions_by_mode: Counter[str] = Counter()
        self.num_hook_calls: Counter[str] = Counter()
        # Requests with token ids (generate calls) sent: the ones a view-aware policy counts
        # in its view. Admission control (router/admission.py) matches them to its grants;
        # num_hook_calls["routed"] also counts health checks, aborts, model_info calls.
        self.num_dispatched = 0

    # ------------------------------------------------------------------ choosing

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if not self._warmed:
            await self._warm_up(candidate_replicas)
        request = self._routing_request(pending_request)
        if request is not None and self._uses_view and isinstance(self.view, RedisRoutingView):
            await self.view.sync([replica.replica_id for replica in candidate_replicas])
        now = self._start_choice(pending_request)
        views = [self._view(replica, now) for replica in candidate_replicas]
        if request is None:
            order, mode = power_of_two(healthy(views), self._rng), "pow2"
        else:
            order = self.policy.rank(request, views, now)
            mode = getattr(self.policy, "last_mode", "") or self.policy.name
        self.num_decisions_by_mode[mode] += 1
        tracing.record_route(pending_request, mode, order, len(candidate_replicas), now)
        return self._ranks(candidate_replicas, order)

    def _routing_request(self, pending_request: PendingRequest | None) -> RoutingRequest | None:
        if pending_request is None:
            return None
        request_id = pending_request.metadata.internal_request_id
        known = self._pending.get(request_id)
        if known is not None:  # a retry: same object, hashes already memoised
            return known
        profile = request_profile(pending_request)
        if profile is None:
            return None
        request = RoutingRequest(request_id, profile.prompt_token_ids, profile.max_tokens,
                                 request_session_id(pending_request))
        if len(self._pending) >= _MAX_PENDING:
            self._pending.clear()
        self._pending[request_id] = request
        return request

    async def _warm_up(self, candidates: list[RunningReplica]) -> None:
        """Once, before the first decision: every candidate's stats as they are now."""
        self._warmed = True

        async def pull(replica: RunningReplica) -> None:
            try:
                self._warm_stats[replica.replica_id] = await fetch_routing_stats(replica)
            except Exception as e:  # noqa: BLE001 -- a replica that cannot answer is routed as before
                logger.debug("warm start: no stats from %s (%s)", replica.replica_id, e)

        try:
            async with asyncio.timeout(WARM_START_TIMEOUT_S):
                await asyncio.gather(*(pull(r) for r in candidates))
        except TimeoutError:
            logger.info("warm start: %d of %d replicas answered within %.1f s", len(self._warm_stats),
                        len(candidates), WARM_START_TIMEOUT_S)

    def _stats(self, replica: RunningReplica) -> dict[str, Any]:
        """The controller's last poll of the replica, or what warm start pulled if newer."""
        stats = replica.routing_stats
        warm = self._warm_stats.get(replica.replica_id)
        if warm is None:
            return stats
        if stats and float(stats.get("timestamp", 0.0)) >= float(warm.get("timestamp", 0.0)):
            del self._warm_stats[replica.replica_id]  # the controller caught up
            return stats
        return warm

    def _report(self, replica: RunningReplica, now: float) -> ReplicaReport | None:
        """The replica's last report, parsed once; a new one is passed to the policy."""
        replica_id = replica.replica_id
        stats = self._stats(replica)
        report = self._reports.get(replica_id)
        if report is None or not stats or stats.get("timestamp") != report.timestamp:
            report = ReplicaReport.from_stats(stats)
            self._reports[replica_id] = report
            if report is not None:
                self.policy.on_report(replica_id, report, now)
        return report

    def _view(self, replica: RunningReplica, now: float) -> ReplicaView:
        replica_id = replica.replica_id
        report = self._report(replica, now)
        queue_len = cached_queue_len(self, replica_id)
        if queue_len is None:
            queue_len = self._outstanding[replica_id]
        return ReplicaView(replica_id, report, queue_len=queue_len)

    # ------------------------------------------------------------------ lifecycle hooks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        self.num_hook_calls["routed"] += 1
        previous = self._sent.pop(request_id, None)
        if previous is not None:
            self._outstanding[previous] -= 1
        self._sent[request_id] = replica_id
        self._outstanding[replica_id] += 1
        if self._uses_view and self.view.replica_of(request_id) not in (None, replica_id):
            self.num_hook_calls["moved"] += 1  # Serve sent it to a lower rank than the reservation's
        request = self._pending.pop(request_id, None)
        if request is not None:
            self.num_dispatched += 1
            self.policy.on_dispatch(request, replica_id, router_now_s(self))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.num_hook_calls["completed"] += 1
        if self._sent.get(internal_request_id) == replica_id:
            del self._sent[internal_request_id]
            self._outstanding[replica_id] -= 1
        self._pending.pop(internal_request_id, None)
        self.policy.on_complete(internal_request_id, replica_id, router_now_s(self))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this on the router's loop with every new replica set, and with every
        changed report: the policy sees a report now, not at this router's next decision, so
        its view's unreflected work is always counted against the newest reports. Admission
        control reads the view between decisions (router/admission.py), while requests are
        held and this router may decide nothing for a long time."""
        super().update_replicas(replicas)
        now = router_now_s(self)
        for replica in replicas:
            self._report(replica, now)

    def _forget_gone_replicas(self, live: set[ReplicaID]) -> None:
        for replica_id in [r for r in self._reports if r not in live]:
            del self._reports[replica_id]
        for replica_id in [r for r in self._outstanding if r not in live]:
            del self._outstanding[replica_id]
        for replica_id in [r for r in self._warm_stats if r not in live]:
            del self._warm_stats[replica_id]
        if self._uses_view:
            self.view.prune(router_now_s(self), live, self.params.unconfirmed_ttl_s, self.params.reservation_ttl_s)

    # ------------------------------------------------------------------ introspection

    def routing_view(self) -> dict[str, dict[str, Any]]:
        """Per replica (unique id): the last stats seen (prefix_hashes replaced by their
        count), this router's outstanding requests there and, for a view-aware policy, the
        work promised there since its report as this router's view has it (shared: every
        router's). Safe from another thread (copies)."""
        for _ in range(3):
            try:
                out: dict[str, dict[str, Any]] = {}
                for replica in list(self.curr_replicas.values()):
                    stats = dict(replica.routing_stats or {})
                    stats["prefix_hashes"] = len(stats.get("prefix_hashes") or ())
                    entry: dict[str, Any] = {"stats": stats, "outstanding": self._outstanding.get(replica.replica_id, 0)}
                    if self._uses_view:
                        unreflected = self.view.unreflected(replica.replica_id)
                        entry["unreflected_blocks"] = unreflected.blocks
                        entry["unreflected_requests"] = unreflected.requests
                    out[replica.replica_id.unique_id] = entry
                return out
            except RuntimeError:  # a dict changed size under us (router thread); retry
                continue
        return {}
