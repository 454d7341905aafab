"""Admission control (router/routing/admission.py) with the request router's routing view: the work
the view says was sent to a replica since its report counts against that replica, and with
the view shared through Redis (router/routing/redis_view.py) that is every ingress's work, so two
ingresses do not each admit into the same room. Also what the Serve router
(router/routing/serve_router.py) gives admission: its count of sent generate calls, and a view
kept relative to the newest reports between its decisions."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from router.routing.admission import REASON_FITS, AdmissionController, judge
from router.routing.admission_source import RouterSnapshotSource
from router.routing.types import RoutingParams, RequestProfile
from router.routing.redis_view import RedisRoutingView
from router.routing.reservations import NOTHING, Unreflected
from router.routing.routing_view import RoutingView
from tests.support.redis_server import RedisServer
from tests.unit.router.routing.test_routing_view import close, eventually, redis_views

BS = 16
PARAMS = RoutingParams(expected_output_tokens=32, report_lag_s=0.05)


def stats(free: int, timestamp: float) -> dict[str, Any]:
    """A replica's routing stats as Serve hands them to the router."""
    return {"free_blocks": free, "total_blocks": 200, "block_size": BS, "num_waiting": 0, "timestamp": timestamp}


def profile() -> RequestProfile:
    return RequestProfile(list(range(1, 65)), 32)  # 64 prompt + 32 decode tokens = 6 blocks


def handle_of(router: Any) -> SimpleNamespace:
    """A DeploymentHandle as router/serve_internals.py's initialized_request_router_of reads it."""
    return SimpleNamespace(_router=SimpleNamespace(_asyncio_router=SimpleNamespace(_request_router=router)))


class IngressRouter:
    """What RouterSnapshotSource reads of an ingress's PolicyRouter (router/routing/serve_router.py)
    running the headroom policy on `view`."""

    def __init__(self, view: RoutingView, replica_stats: dict[str, dict[str, Any]]) -> None:
        self.params = PARAMS
        self.view = view
        self._uses_view = True
        self.num_dispatched = 0
        self.curr_replicas = {k: SimpleNamespace(replica_id=k, routing_stats=s) for k, s in replica_stats.items()}

    def report(self, replica: str, replica_stats: dict[str, Any]) -> None:
        self.curr_replicas = {**self.curr_replicas, replica: SimpleNamespace(replica_id=replica, routing_stats=replica_stats)}


async def ingress_b_holding(a: RedisRoutingView, b: RedisRoutingView, t0: float,
                            now: list[float]) -> tuple[IngressRouter, AdmissionController, asyncio.Task[Any]]:
    """Ingress A's router sent a 7-block request to r1 (12 free at its report); ingress B
    has one request in flight and holds the next one, which the report alone would let go."""
    await a.sync(["r1"])
    a.reserve("x", "r1", {"r1": 7}, t0, prefill_tokens=64, decode_blocks=2)
    a.routed("x", "r1")

    async def b_sees_a() -> bool:
        await b.sync(["r1"])
        return b.unreflected("r1") == Unreflected(7, 1, 64, 2)

    await eventually(b_sees_a, "b to read a's reservation")
    router = IngressRouter(b, {"r1": stats(12, t0)})
    source = RouterSnapshotSource(handle_of(router), clock=lambda: now[0])
    c = AdmissionController(source, 8, 60.0, 4, poll_interval_s=3600.0, clock=lambda: now[0])
    await c.admit("k", [profile()])  # nothing in flight at B: goes; 6 blocks pending
    snap = source.snapshot()
    assert snap is not None and snap.unreflected == (Unreflected(7, 1, 64, 2),) and snap.routed_total == 0
    # The report alone: 12 free - 6 pending = the 6 needed. With A's 7 blocks: 5 left.
    assert judge([profile()], replace(snap, unreflected=()), c._pending, 4).admit
    held = asyncio.create_task(c.admit("k", [profile()]))
    await asyncio.sleep(0)  # let it reach the queue
    assert len(c.queue) == 1
    return router, c, held


async def test_an_ingress_holds_what_another_sent_until_it_completes(redis_server: RedisServer) -> None:
    t0 = time.time()
    a, b = redis_views(redis_server)
    _, c, held = await ingress_b_holding(a, b, t0, [t0])
    a.complete("x", "r1")

    async def b_sees_it_done() -> bool:
        await b.sync(["r1"])
        return b.unreflected("r1") == NOTHING

    await eventually(b_sees_it_done, "b to read a's completion")
    c.pump()
    assert len(c.queue) == 0  # granted by that pump
    assert (await held).verdict.reason == REASON_FITS
    await close(a, b)


async def test_an_ingress_holds_what_another_sent_until_a_report_shows_it(redis_server: RedisServer) -> None:
    t0 = time.time()
    now = [t0]
    a, b = redis_views(redis_server)
    router, c, held = await ingress_b_holding(a, b, t0, now)
    # r1 reports again a second later: A's request is in it now, and other work finished
    # (12 free again). Until B's router has observed the report, A's work counts twice.
    now[0] = t0 + 1.0
    router.report("r1", stats(12, t0 + 1.0))
    c.pump()
    assert len(c.queue) == 1
    b.observe_report("r1", t0 + 1.0)  # as PolicyRouter.update_replicas does when Serve delivers it
    c.pump()
    assert len(c.queue) == 0
    assert (await held).verdict.reason == REASON_FITS
    await close(a, b)


# -- the Serve router's side: a real PolicyRouter, as Serve drives it in the ingress -------------
class Replica:
    """A RunningReplica as the router sees it: id, routing stats, and Serve's queue probe."""

    def __init__(self, replica_id: Any, routing_stats: dict[str, Any]) -> None:
        self.replica_id = replica_id
        self.routing_stats = routing_stats
        self.node_id = None
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, deadline_s: float) -> int:
        return 0


def call(request_id: str, request: Any = None) -> SimpleNamespace:
    """A PendingRequest: a generate call carries its GenerateRequest, a health check nothing."""
    return SimpleNamespace(args=[request] if request is not None else [], kwargs={},
                           metadata=SimpleNamespace(internal_request_id=request_id),
                           routing_context=SimpleNamespace(should_backoff=False))


async def test_the_serve_router_counts_generate_sends_and_sees_each_report_as_it_arrives() -> None:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from router.routing.serve_router import PolicyRouter

    deployment = DeploymentID(name="worker", app_name="test")
    router = PolicyRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(expected_output_tokens=32, report_lag_s=0.05, warm_start=False, seed=0)
    replica = Replica(ReplicaID(unique_id="r1", deployment_id=deployment), stats(100, time.time()))
    router.update_replicas([replica])
    source = RouterSnapshotSource(handle_of(router))

    generate = call("g1", SimpleNamespace(prompt_token_ids=list(range(1, 65)), params=SimpleNamespace(max_tokens=32)))
    assert await router.choose_replicas([replica], generate) == [[replica]]
    router.on_request_routed(generate, replica.replica_id, None)
    health = call("h1")
    assert await router.choose_replicas([replica], health) == [[replica]]
    router.on_request_routed(health, replica.replica_id, None)
    assert router.num_hook_calls["routed"] == 2
    snap = source.snapshot()
    assert snap is not None and snap.routed_total == 1  # the health check is nothing the view counts
    # Its need (6 blocks, 2 of them decode), its 64 uncached prompt tokens.
    assert snap.unreflected == (Unreflected(6, 1, 64, 2),)

    # The next report shows the request: Serve delivers it through update_replicas, and the
    # view stops counting the request then, without waiting for this router's next decision.
    replica.routing_stats = stats(94, time.time() + 1.0)
    router.update_replicas([replica])
    snap = source.snapshot()
    assert snap is not None and snap.unreflected == (NOTHING,) and snap.routed_total == 1


async def test_a_router_without_a_view_gives_no_view() -> None:
    router = IngressRouter(NOTHING, {"r1": stats(12, time.time())})  # type: ignore[arg-type]
    router._uses_view = False  # a baseline policy keeps its own state
    snap = RouterSnapshotSource(handle_of(router)).snapshot()
    assert snap is not None and snap.unreflected == () and snap.routed_total is None


def test_a_call_that_completes_before_its_routed_hook_is_not_left_outstanding() -> None:
    """Serve registers a call's completion callback before it runs `on_request_routed`
    (which waits for the replica to accept): a call that ends at once can complete first.
    It must not stay counted on its replica; a rejected call, completed on one replica and
    routed to another, counts on the second until it completes there."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from router.routing.serve_router import PolicyRouter

    deployment = DeploymentID(name="worker", app_name="test")
    router = PolicyRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(expected_output_tokens=32, report_lag_s=0.05, warm_start=False, seed=0)
    r1, r2 = ReplicaID(unique_id="r1", deployment_id=deployment), ReplicaID(unique_id="r2", deployment_id=deployment)

    fast = call("fast")
    router.on_request_completed(r1, "fast")  # the completion first
    router.on_request_routed(fast, r1, None)
    assert router._outstanding[r1] == 0 and "fast" not in router._sent

    normal = call("normal")
    router.on_request_routed(normal, r1, None)
    assert router._outstanding[r1] == 1
    router.on_request_completed(r1, "normal")
    assert router._outstanding[r1] == 0

    rejected = call("rejected")
    router.on_request_completed(r1, "rejected")  # cancelled on r1 after its rejection
    router.on_request_routed(rejected, r2, None)  # then sent to r2
    assert (router._outstanding[r1], router._outstanding[r2]) == (0, 1)
    router.on_request_completed(r2, "rejected")
    assert (router._outstanding[r1], router._outstanding[r2]) == (0, 0)
