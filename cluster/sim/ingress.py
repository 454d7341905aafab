"""Ingress routers: each holds its own routing-policy object per pool and sees only what a
real Ray Serve router sees.

What a router knows (and nothing more):
  * the replicas of each pool that are up and not draining (Serve's replica set);
  * each replica's routing-stats reports, taken every stats period and delivered after
    `report_lag_s` (so they are always stale by lag .. lag + period);
  * the requests it dispatched itself (its policy's own bookkeeping: reservations etc.);
  * each replica's current number of ongoing requests (`queue_len` of the views, what
    Serve's queue-length probes return; see router/routing/policies/base.py).

Serve's `max_ongoing_requests`: the router offers its ranked list; the first replica
below the cap takes the request. When every replica is at the cap, Serve backs off and
retries; here the request waits in the router's FIFO queue and is retried whenever a
slot frees anywhere in that pool (a retry ranks again, with what the router knows then).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.sim.clock import EventQueue
from cluster.sim.replica import SimReplica
from router.routing.types import ReplicaReport, ReplicaView


@dataclass
class Pool:
    """The replicas of one role ("mixed", "prefill" or "decode")."""

    role: str
    replicas: dict[int, SimReplica] = field(default_factory=dict)  # key -> replica, creation order
    routers: list[SimRouter] = field(default_factory=list)
    _rotation: int = 0

    def live(self) -> list[SimReplica]:
        return [r for r in self.replicas.values() if r.accepting]

    def slot_freed(self) -> None:
        """A request left a replica of this pool (or a replica joined it): let the routers
        retry their queues, starting with a different router each time (no favourite)."""
        n = len(self.routers)
        if n == 0:
            return
        start = self._rotation % n
        self._rotation += 1
        for i in range(n):
            self.routers[(start + i) % n].drain_queue(self.role)


@dataclass
class Pending:
    """One request waiting for (or routed to) a replica of a pool."""

    routing_request: Any  # router.routing.policies.RoutingRequest
    dispatch: Callable[[SimReplica], None]  # sends it to the chosen replica
    enqueued_at: float = 0.0


class SimRouter:
    def __init__(self, index: int, policies: dict[str, Any], pools: dict[str, Pool], clock: EventQueue,
                 max_ongoing_requests: int) -> None:
        self.index = index
        self.policies = policies  # role -> policy object (router.routing.policies.make_policy)
        self.pools = pools
        self.clock = clock
        self.max_ongoing_requests = max_ongoing_requests
        self.reports: dict[int, ReplicaReport] = {}
        self.queues: dict[str, deque[Pending]] = {role: deque() for role in pools}
        self.num_queued_total = 0  # requests that ever had to wait for a slot
        # Age of the chosen replica's report at each dispatch (inf: none yet): what "stale" means here.
        self.num_dispatched = 0
        self.report_age_sum = 0.0
        self.min_report_age = float("inf")
        self.num_dispatched_unreported = 0
        self.modes: dict[str, int] = {}  # decisions by the policy's mode (router/routing/scoring.py MODE_*), if it has modes

    @property
    def num_queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def submit(self, role: str, pending: Pending) -> None:
        queue = self.queues[role]
        if queue or not self._try_dispatch(role, pending):
            pending.enqueued_at = self.clock.now
            queue.append(pending)
            self.num_queued_total += 1

    def drain_queue(self, role: str) -> None:
        queue = self.queues[role]
        while queue and self._try_dispatch(role, queue[0]):
            queue.popleft()

    def _try_dispatch(self, role: str, pending: Pending) -> bool:
        pool = self.pools[role]
        live = pool.live()
        if not live:
            return False
        cap = self.max_ongoing_requests
        if all(r.num_ongoing >= cap for r in live):
            return False  # no need to rank: nobody would take it
        now = self.clock.now
        reports = self.reports
        views = [ReplicaView(r.key, reports.get(r.key), queue_len=r.num_ongoing) for r in live]
        policy = self.policies[role]
        order = policy.rank(pending.routing_request, views, now)
        mode = getattr(policy, "last_mode", "")
        if mode:
            self.modes[mode] = self.modes.get(mode, 0) + 1
        for key in order:
            replica = pool.replicas.get(key)
            if replica is None or not replica.accepting or replica.num_ongoing >= cap:
                continue
            self._note_age(reports.get(key), now)
            policy.on_dispatch(pending.routing_request, key, now)
            pending.dispatch(replica)
            return True
        return False

    def _note_age(self, report: ReplicaReport | None, now: float) -> None:
        self.num_dispatched += 1
        if report is None:
            self.num_dispatched_unreported += 1
            return
        age = now - report.timestamp
        self.report_age_sum += age
        self.min_report_age = min(self.min_report_age, age)

    def stats(self) -> dict[str, float | int]:
        num_reported = self.num_dispatched - self.num_dispatched_unreported
        return {
            "index": self.index,
            "num_dispatched": self.num_dispatched,
            "num_queued_total": self.num_queued_total,
            "num_dispatched_unreported": self.num_dispatched_unreported,
            "mean_report_age_s": self.report_age_sum / num_reported if num_reported else None,
            "min_report_age_s": self.min_report_age if num_reported else None,
            "modes": dict(self.modes),
        }

    def complete(self, role: str, request_id: str, replica_key: int) -> None:
        self.policies[role].on_complete(request_id, replica_key, self.clock.now)

    def receive_report(self, role: str, replica_key: int, report: ReplicaReport) -> None:
        self.reports[replica_key] = report
        self.policies[role].on_report(replica_key, report, self.clock.now)

    def forget(self, replica_key: int) -> None:
        self.reports.pop(replica_key, None)

