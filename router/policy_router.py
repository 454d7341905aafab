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
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from router import tracing
from router.headroom import ReplicaReport, ReplicaView, power_of_two
from router.policies import RoutingPolicy, RoutingRequest, make_policy, split_policy_kwargs
from router.policies.base import healthy
from router.request_router import ReplicaStateRouter, request_profile
from router.serve_internals import router_now_s

# Requests chosen but never routed nor completed (cancelled before Serve sent them) are
# forgotten beyond this many.
_MAX_PENDING = 10_000


class PolicyRouter(ReplicaStateRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure({})

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with RequestRouterConfig.request_router_kwargs: `policy` (a name),
        `seed` (int, optional), HeadroomParams fields and the policy's own options."""
        self._configure(kwargs)

    def _configure(self, kwargs: dict[str, Any]) -> None:
        kwargs = dict(kwargs)
        seed = kwargs.pop("seed", None)
        name, params, options = split_policy_kwargs(kwargs)
        rng_seed = int(seed) if seed is not None else random.randrange(2**32)
        self.policy: RoutingPolicy = make_policy(name, params, rng_seed, **options)
        self.params = params
        self._rng = random.Random(rng_seed + 1)
        self._reports: dict[ReplicaID, ReplicaReport | None] = {}
        self._pending: dict[str, RoutingRequest] = {}  # chosen, not yet routed
        self._sent: dict[str, ReplicaID] = {}  # routed, not yet completed
        self._outstanding: Counter[ReplicaID] = Counter()
        # Decisions by the policy's mode (its `last_mode`, or its name) and "pow2" for calls
        # without token ids; lifecycle hook calls. For metrics and tests.
        self.num_decisions_by_mode: Counter[str] = Counter()
        self.num_hook_calls: Counter[str] = Counter()

    # ------------------------------------------------------------------ choosing

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        now = self._start_choice(pending_request)
        views = [self._view(replica, now) for replica in candidate_replicas]
        request = self._routing_request(pending_request)
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
        request = RoutingRequest(request_id, profile.prompt_token_ids, profile.max_tokens)
        if len(self._pending) >= _MAX_PENDING:
            self._pending.clear()
        self._pending[request_id] = request
        return request

    def _view(self, replica: RunningReplica, now: float) -> ReplicaView:
        replica_id = replica.replica_id
        stats = replica.routing_stats
        report = self._reports.get(replica_id)
        if report is None or not stats or stats.get("timestamp") != report.timestamp:
            report = ReplicaReport.from_stats(stats)
            self._reports[replica_id] = report
            if report is not None:
                self.policy.on_report(replica_id, report, now)
        queue_len = self._replica_queue_len_cache.get(replica_id) if self._use_replica_queue_len_cache else None
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
        request = self._pending.pop(request_id, None)
        if request is not None:
            self.policy.on_dispatch(request, replica_id, router_now_s(self))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.num_hook_calls["completed"] += 1
        if self._sent.get(internal_request_id) == replica_id:
            del self._sent[internal_request_id]
            self._outstanding[replica_id] -= 1
        self._pending.pop(internal_request_id, None)
        self.policy.on_complete(internal_request_id, replica_id, router_now_s(self))

    def _forget_gone_replicas(self, live: set[ReplicaID]) -> None:
        for replica_id in [r for r in self._reports if r not in live]:
            del self._reports[replica_id]
        for replica_id in [r for r in self._outstanding if r not in live]:
            del self._outstanding[replica_id]

    # ------------------------------------------------------------------ introspection

    def routing_view(self) -> dict[str, dict[str, Any]]:
        """Per replica (unique id): the last stats seen (prefix_hashes replaced by their
        count) and this router's outstanding requests there. Safe from another thread."""
        for _ in range(3):
            try:
                out: dict[str, dict[str, Any]] = {}
                for replica in list(self.curr_replicas.values()):
                    stats = dict(replica.routing_stats or {})
                    stats["prefix_hashes"] = len(stats.get("prefix_hashes") or ())
                    out[replica.replica_id.unique_id] = {
                        "stats": stats,
                        "outstanding": self._outstanding.get(replica.replica_id, 0),
                    }
                return out
            except RuntimeError:  # a dict changed size under us (router thread); retry
                continue
        return {}
