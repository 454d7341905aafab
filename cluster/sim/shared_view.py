"""The routing view several ingress routers share (contract 3 of router v2), on the virtual clock.

A real deployment shares one view through Redis (router/routing/redis_view.py); here the routers
of a pool hold the SAME in-process LocalRoutingView, which is what Redis makes of it:
one ledger of unreflected work and one prefix-hint table for every router. A private
view per router (SimConfig.shared_view=False) is the herding failure the shared one fixes.

`shared_view_rtt_s` models the round trip to Redis: a router's writes (reservations,
their moves and releases, learned prefixes) reach the shared state that long after the
router made them, so a burst split across routers within one round trip still herds a
little, as it would against a real Redis. Reads see the shared state as it is then.
Report observations are applied at once (each router learns of a report by itself, and
the ledger's cutoff only moves forward, so order does not matter).

Writes are replayed through the event queue in the order they were made (equal delays,
ties in scheduling order), so a reserve is always applied before its routed/complete.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from cluster.sim.clock import EventQueue
from router.routing.reservations import PerReplica, ReplicaKey, Unreflected
from router.routing.routing_view import LocalRoutingView, RoutingView


class DelayedView:
    """A RoutingView whose writes land on `shared` `rtt_s` virtual seconds after they are made."""

    def __init__(self, shared: LocalRoutingView, clock: EventQueue, rtt_s: float) -> None:
        if rtt_s < 0:
            raise ValueError("shared_view_rtt_s must be >= 0")
        self.shared = shared
        self.clock = clock
        self.rtt_s = rtt_s

    def _later(self, fn, *args) -> None:  # noqa: ANN001 (a bound method of the shared view)
        self.clock.after(self.rtt_s, fn, *args)

    # -- reads: the shared state now -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.shared)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.shared

    def replica_of(self, request_id: str) -> ReplicaKey | None:
        return self.shared.replica_of(request_id)

    def unreflected(self, replica: ReplicaKey) -> Unreflected:
        return self.shared.unreflected(replica)

    def outstanding(self, replica: ReplicaKey) -> int:
        return self.shared.outstanding(replica)

    def prefix_owner_hints(self, block_hashes: Sequence[int],
                           not_before: Mapping[ReplicaKey, float] | None = None) -> dict[ReplicaKey, int]:
        return self.shared.prefix_owner_hints(block_hashes, not_before)

    # -- writes: one round trip later ------------------------------------------------------------
    def reserve(self, request_id: str, replica: ReplicaKey, need_by_replica: Mapping[ReplicaKey, int], now: float,
                prefill_tokens: PerReplica = 0, decode_blocks: int = 0) -> None:
        self._later(self.shared.reserve, request_id, replica, dict(need_by_replica), now, prefill_tokens,
                    decode_blocks)

    def routed(self, request_id: str, replica: ReplicaKey) -> None:
        self._later(self.shared.routed, request_id, replica)

    def complete(self, request_id: str, replica: ReplicaKey | None = None) -> None:
        self._later(self.shared.complete, request_id, replica)

    def learn_prefix(self, replica: ReplicaKey, block_hashes: Sequence[int], now: float) -> None:
        self._later(self.shared.learn_prefix, replica, tuple(block_hashes), now)

    def observe_report(self, replica: ReplicaKey, report_timestamp: float) -> None:
        self.shared.observe_report(replica, report_timestamp)

    def prune(self, now: float, live_replicas: set[ReplicaKey] | None, unconfirmed_ttl_s: float, ttl_s: float) -> int:
        return self.shared.prune(now, live_replicas, unconfirmed_ttl_s, ttl_s)


def pool_views(num_routers: int, rtt_s: float, report_lag_s: float, clock: EventQueue) -> list[RoutingView]:
    """The shared view as each of a pool's routers sees it: the same LocalRoutingView for
    all (behind a DelayedView each when rtt_s > 0)."""
    view = LocalRoutingView(report_lag_s)
    if rtt_s == 0:
        return [view] * num_routers
    return [DelayedView(view, clock, rtt_s) for _ in range(num_routers)]
