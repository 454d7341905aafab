"""PolicyRouter: the one Ray Serve RequestRouter adapter; it runs any routing policy of
router/routing/policies/ (headroom by default) on the worker deployment.

    RequestRouterConfig(
        request_router_class="router.routing.serve_router:PolicyRouter",
        request_router_kwargs={"policy": "prefix_affinity",   # a name in POLICY_NAMES
                               "stats_period_s": 1.0,           # RoutingParams fields
                               "balance_abs_threshold": 32},    # the policy's own options
        request_routing_stats_period_s=1.0,
    )

The decision is `choose_replicas` -> `policy.rank` (router/routing/policies/): the adapter
turns Serve's replicas into ReplicaViews (the last routing-stats report plus the queue
length) and the `generate` call into a RoutingRequest, and returns the policy's order one
replica per rank. Calls other than `generate` carry no token ids and are ranked by power of
two choices. The discrete-event simulator (cluster/sim/) runs the same policy objects.

How Serve 2.60 drives it (read from ray/serve/_private/router.py and request_router/):
  * Serve cloudpickles this class BY VALUE (RequestRouterConfig registers this module for
    pickle-by-value) and builds one instance per DeploymentHandle process: in every caller
    of the worker deployment (each ingress replica; the driver for a driver-side handle).
    Module-level state here is therefore per copy, not shared; router.routing.types and kv/
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

Several router copies (one per ingress replica) each see only their own dispatches unless
they share a view: with private views they herd onto the replica that looked best at the
last report (tests/unit/router/routing/test_routing_view.py shows it). A view-aware policy
(headroom) keeps its reservations and prefix hints in a routing view
(router/routing/routing_view.py): private (LocalRoutingView) unless request_router_kwargs
carry `shared_view` (router/routing/redis_view.py's SharedViewSpec as a dict; cluster/app.py
sets it when state.redis_url is set), then shared by every copy through Redis, its read
awaited before each decision (`RedisRoutingView.sync`: one round trip at most, bounded
wait). Reservations stop counting once a report taken after the dispatch arrives: that
report shows every router's requests, so even private views re-converge once per stats
period.

Warm start (`warm_start`, default on): before its first decision a router asks every
candidate replica for its routing stats now (serve_internals.fetch_routing_stats), so a
router that starts or restarts knows what each replica caches from its first request on,
not one stats period later.
"""
from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router import tracing
from router.routing.types import (
    RoutingParams, ReplicaKey, ReplicaReport, ReplicaView, RequestProfile, power_of_two, request_hash_root,
)
from router.routing.policies import RoutingPolicy, RoutingRequest, make_policy, split_policy_kwargs
from router.routing.kv_index import KVIndex
from router.routing.policies.base import healthy
from router.routing.redis_view import RedisRoutingView, SharedViewSpec
from router.routing.routing_view import LocalRoutingView, RoutingView
from router.serve_internals import cached_queue_len, fetch_routing_stats, router_now_s

logger = logging.getLogger("ray.serve")

# Requests chosen but never routed nor completed (cancelled before Serve sent them) are
# forgotten beyond this many.
_MAX_PENDING = 10_000
# Completions seen before their routed hook, kept for it (a rejected call's never comes).
_MAX_COMPLETED_FIRST = 10_000
# Warm start: how long the first decision waits for the replicas' stats at most.
WARM_START_TIMEOUT_S = 2.0


def make_view(shared_view: Mapping[str, Any] | None, params: RoutingParams) -> RoutingView:
    """The router's routing view: shared through Redis when `shared_view` (a SharedViewSpec
    as a dict) is given, else private."""
    if shared_view is None:
        return LocalRoutingView(params.report_lag_s)
    return RedisRoutingView(SharedViewSpec.from_dict(shared_view), params.report_lag_s)


def call_request(pending_request: PendingRequest | None) -> Any:
    """The request object a call carries: its first argument, or its `request` keyword (a
    GenerateRequest for `generate`); None without a pending request."""
    if pending_request is None:
        return None
    return pending_request.args[0] if pending_request.args else pending_request.kwargs.get("request")


def request_profile(pending_request: PendingRequest | None) -> RequestProfile | None:
    """The routing-relevant part of a `WorkerReplica.generate(GenerateRequest)` call, or None
    for any other call (stats, model_info, abort...), which is routed by power-of-two."""
    request = call_request(pending_request)
    token_ids = getattr(request, "prompt_token_ids", None)
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        return None
    params = getattr(request, "params", None)
    max_tokens = getattr(params, "max_tokens", 0)
    if not isinstance(max_tokens, int):
        max_tokens = 0
    # Hashed from the chain root the worker caches it under (its cache salt, its LoRA
    # adapter), so a salted or adapter prefix is found where it lives.
    root = request_hash_root(getattr(params, "cache_keys", ()), getattr(request, "lora_name", None),
                             getattr(request, "lora_path", None))
    return RequestProfile(prompt_token_ids=token_ids, max_tokens=max_tokens, hash_root=root,
                          lora_name=getattr(request, "lora_name", None))


def request_session_id(pending_request: PendingRequest | None) -> str | None:
    """The `generate` call's session id (soft affinity), when the request carries one."""
    session_id = getattr(call_request(pending_request), "session_id", None)
    return session_id if isinstance(session_id, str) and session_id else None


class PolicyRouter(RequestRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure({})

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with RequestRouterConfig.request_router_kwargs: `policy` (a name),
        `seed` (int, optional), `shared_view` (a SharedViewSpec dict, optional),
        `warm_start` (bool, default True), RoutingParams fields and the policy's own options."""
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
        self.kv_index = KVIndex()  # what each replica caches, from its KV events
        self._pending: dict[str, RoutingRequest] = {}  # chosen, not yet routed
        self._sent: dict[str, ReplicaID] = {}  # routed, not yet completed
        # Completed before routed: Serve registers a call's completion callback before its
        # `on_request_routed` (which waits for the replica's accept), so a call that ends
        # at once can complete first. Kept, oldest first and bounded (a rejected call
        # completes on a replica it is never routed to), until its routed hook comes.
        self._completed_first: OrderedDict[tuple[str, ReplicaID], None] = OrderedDict()
        self._outstanding: Counter[ReplicaID] = Counter()
        # Decisions by the policy's mode (its `last_mode`, or its name) and "pow2" for calls
        # without token ids; lifecycle hook calls. For metrics and tests.
        self.num_decisions_by_mode: Counter[str] = Counter()
        self.num_hook_calls: Counter[str] = Counter()
        # Requests with token ids (generate calls) sent: the ones a view-aware policy counts
        # in its view. Admission control (router/routing/admission.py) matches them to its grants;
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
        # A call that names `replica_id` (release_kv after a disaggregated transfer) goes to
        # that replica, which holds the pinned blocks; if it is gone, so are its blocks and
        # any replica answers (a no-op there).
        target = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if target:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
        if not self._warmed:
            await self._warm_up(candidate_replicas)
        request = self._routing_request(pending_request)
        if request is not None and self._uses_view and isinstance(self.view, RedisRoutingView):
            await self.view.sync([replica.replica_id for replica in candidate_replicas])
        if pending_request is not None:
            # Without this, Serve retries immediately (no backoff) when every rank refuses.
            pending_request.routing_context.should_backoff = True
        now = router_now_s(self)
        views = [self._view(replica, now) for replica in candidate_replicas]
        if request is None:
            order, mode = power_of_two(healthy(views), self._rng), "pow2"
        else:
            order = self.policy.rank(request, views, now)
            mode = getattr(self.policy, "last_mode", "") or self.policy.name
        self.num_decisions_by_mode[mode] += 1
        tracing.record_route(call_request(pending_request), mode, order, len(candidate_replicas), now)
        # One replica per rank: within a rank Serve would pick by queue length itself.
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        return [[by_id[key]] for key in order]

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
                                 request_session_id(pending_request), profile.hash_root, profile.lora_name)
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
            except Exception as e:  # noqa: BLE001 -- no warm stats: its first report counts, as it would anyway
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
            if report is not None:
                report = self._indexed(replica_id, stats, report)
            self._reports[replica_id] = report
            if report is not None:
                self.policy.on_report(replica_id, report, now)
        return report

    def _indexed(self, replica_id: ReplicaID, stats: Mapping[str, Any], report: ReplicaReport) -> ReplicaReport:
        """The report with the exact index's hash sets (router/routing/kv_index.py) in place
        of its capped snapshot, when the replica sends KV events."""
        return self.kv_index.indexed(replica_id, stats, report)

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
        key = (request_id, replica_id)
        if key in self._completed_first:  # it ended before this hook: nothing outstanding
            del self._completed_first[key]
        else:
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
        else:  # not routed yet: its routed hook must not count it
            self._completed_first[(internal_request_id, replica_id)] = None
            while len(self._completed_first) > _MAX_COMPLETED_FIRST:
                self._completed_first.popitem(last=False)
        self._pending.pop(internal_request_id, None)
        self.policy.on_complete(internal_request_id, replica_id, router_now_s(self))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this on the router's loop with every new replica set, and with every
        changed report: the policy sees a report now, not at this router's next decision, so
        its view's unreflected work is always counted against the newest reports. Admission
        control reads the view between decisions (router/routing/admission.py), while requests are
        held and this router may decide nothing for a long time."""
        super().update_replicas(replicas)
        self._forget_gone_replicas({replica.replica_id for replica in replicas})
        now = router_now_s(self)
        for replica in replicas:
            self._report(replica, now)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_gone_replicas(set(self.curr_replicas))

    def _forget_gone_replicas(self, live: set[ReplicaID]) -> None:
        """Per-replica state (reports, counts, the view's entries) goes as soon as Serve
        drops a replica from the set or reports its actor dead."""
        for replica_id in [r for r in self._reports if r not in live]:
            del self._reports[replica_id]
        for replica_id in [r for r in self._outstanding if r not in live]:
            del self._outstanding[replica_id]
        for replica_id in [r for r in self._warm_stats if r not in live]:
            del self._warm_stats[replica_id]
        self.kv_index.forget(live)
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
                    for key in ("prefix_hashes", "host_prefix_hashes", "disk_prefix_hashes", "kv_events"):
                        stats[key] = len(stats.get(key) or ())
                    entry: dict[str, Any] = {"stats": stats, "outstanding": self._outstanding.get(replica.replica_id, 0)}
                    held = self.kv_index.get(replica.replica_id)
                    if held is not None:
                        entry["kv_index"] = {"epoch": held.epoch, "seq": held.seq, "device": len(held.device),
                                             "host": len(held.host), "disk": len(held.disk)}
                    if self._uses_view:
                        unreflected = self.view.unreflected(replica.replica_id)
                        entry["unreflected_blocks"] = unreflected.blocks
                        entry["unreflected_requests"] = unreflected.requests
                    out[replica.replica_id.unique_id] = entry
                return out
            except RuntimeError:  # a dict changed size under us (router thread); retry
                continue
        return {}
