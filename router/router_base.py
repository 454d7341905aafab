"""What every kvserve Serve request router shares (router/request_router.py's
KVHeadroomRouter, router/policy_router.py's PolicyRouter): the routing-relevant part of a
`generate` call, and forgetting replicas Serve dropped."""
from __future__ import annotations

from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.headroom import ReplicaKey, RequestProfile
from router.serve_internals import router_now_s


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


def request_session_id(pending_request: PendingRequest | None) -> str | None:
    """The `generate` call's session id (soft affinity), when the request carries one."""
    if pending_request is None:
        return None
    request = pending_request.args[0] if pending_request.args else pending_request.kwargs.get("request")
    session_id = getattr(request, "session_id", None)
    return session_id if isinstance(session_id, str) and session_id else None


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
