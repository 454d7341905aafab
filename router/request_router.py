"""KVHeadroomRouter: the KV-headroom policy (router/headroom.py) as a Ray Serve 2.60 router.

Use it on the worker deployment:

    RequestRouterConfig(
        request_router_class="router.request_router:KVHeadroomRouter",
        # request_router_kwargs (HeadroomParams fields, optional shared_view / warm_start)
        # and request_routing_stats_period_s, derived from the params' stats_period_s:
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

Several router copies (one per ingress replica) each see only their own dispatches unless
they share a view: with private views they herd onto the replica that looked best at the
last report (tests/unit/test_routing_view.py shows it), so with `shared_view` in the kwargs
(cluster/app.py sets it when state.redis_url is set) every copy counts every copy's
reservations and prefix hints through Redis (router/redis_view.py). Reservations stop
counting once a report taken after the dispatch arrives: that report shows every router's
requests, so even private views re-converge once per stats period.

The ranking is router/policies/headroom.py's HeadroomPolicy (router/headroom.py's scoring),
run by router/policy_router.py's PolicyRouter: the simulator (cluster/sim/) and real Serve
run the same policy object.
"""
from __future__ import annotations

from typing import Any

from router.policy_router import PolicyRouter

HEADROOM_POLICY = "headroom"


class KVHeadroomRouter(PolicyRouter):
    """PolicyRouter running the headroom policy: ranks worker replicas by KV headroom and
    tracks the work it (or, with a shared view, every router) promised each replica since
    that replica's last report."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with RequestRouterConfig.request_router_kwargs: HeadroomParams
        fields, plus `shared_view` / `warm_start` / `seed` (router/policy_router.py)."""
        if "policy" in kwargs:
            raise ValueError("KVHeadroomRouter always runs the headroom policy; use PolicyRouter for another")
        self._configure({**kwargs, "policy": HEADROOM_POLICY})

    def _configure(self, kwargs: dict[str, Any]) -> None:
        super()._configure({**kwargs, "policy": HEADROOM_POLICY})
