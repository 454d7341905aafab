"""Two ingress replicas sharing one routing view through a real redis-server (issue 13).

Real Serve: a `Relay` deployment with TWO replicas plays the ingress (each replica holds a
handle to the worker deployment, so each has its own PolicyRouter copy, as each kvserve
ingress replica does), in front of two FakeWorker replicas (tests/integration/fake_worker.py:
no model, test-set stats). The worker deployment's router kwargs carry `shared_view`, so
both router copies count each other's reservations through Redis (router/routing/redis_view.py).

The worker stats period is long (30 s) on purpose: within a test no new report reflects
any dispatch, so what keeps the routers from over-committing a replica is the view alone,
and what a router knows about a replica's cache at its first request comes from warm start
(it pulls every replica's stats before its first decision), not from the controller's polls.

Covered: a burst through both ingress replicas never promises the prefix owner more blocks
than it has (private views would each fill it: tests/unit/router/routing/test_routing_view.py shows that
herding); Redis killed mid-burst -> every request is still served; a router that starts
after a prefix was cached (as a restarted ingress's does) routes it to its owner on its
first request.
"""
from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from kv.block_hash import hash_full_blocks
from router.routing.redis_view import SharedViewSpec
from tests.integration.fake_worker import CONTROL_NAMESPACE, FakeControl, FakeWorker
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_until
from worker.api import GenerateRequest, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK_SIZE = 16
STATS_PERIOD_S = 30.0
OWNER_FREE_BLOCKS = 12  # replica 0 caches PREFIX but has room for a few requests only
PREFIX = list(range(1, 49))  # 3 full blocks
WAIT_S = 60.0


def request(prompt: list[int], max_tokens: int = 8, hold: bool = False) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, extra={"hold": True} if hold else {})
    return GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, params=params)


class Relay:
    """The ingress stand-in: forwards generate to the worker deployment through its own
    handle (its own router copy) and answers with the stream's first item (where the
    request landed) plus its own replica id; the rest of the stream drains here."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.draining: set[asyncio.Task[None]] = set()

    async def route(self, req: GenerateRequest) -> dict[str, Any]:
        stream = self.worker.options(stream=True).generate.remote(req)
        first = await stream.__anext__()
        task = asyncio.get_running_loop().create_task(self._drain(stream))
        self.draining.add(task)
        task.add_done_callback(self.draining.discard)
        return {**first, "relay": serve.get_replica_context().replica_id.unique_id}

    @staticmethod
    async def _drain(stream: Any) -> None:
        async for _ in stream:
            pass


@dataclass
class Cluster:
    app: str
    relay: Any  # DeploymentHandle of the two Relay replicas
    control: Any  # ActorHandle[FakeControl]
    redis: RedisServer
    key_prefix: str

    def route(self, req: GenerateRequest) -> dict[str, Any]:
        return self.relay.route.remote(req).result(timeout_s=WAIT_S)


@pytest.fixture(scope="module")
def cluster(serve_cluster: Any, redis_server: RedisServer) -> Iterator[Cluster]:
    app = f"shared-{uuid.uuid4().hex[:6]}"
    control_name = f"{app}-control"
    control = FakeControl.options(name=control_name, namespace=CONTROL_NAMESPACE).remote()
    # Set before the replicas register: ordinals 0 and 1 start from these states.
    ray.get(control.set_state.remote(0, free_blocks=OWNER_FREE_BLOCKS, prefix_hashes=hash_full_blocks(PREFIX, BLOCK_SIZE)))
    ray.get(control.set_state.remote(1, free_blocks=1000, prefix_hashes=[]))
    key_prefix = f"kvserve-test:{app}"
    shared = SharedViewSpec(url=redis_server.url, key_prefix=key_prefix, socket_timeout_s=1.0, decision_wait_s=1.0)
    worker = serve.deployment(FakeWorker).options(
        name="fake_worker", num_replicas=2, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0.1},
        request_router_config=RequestRouterConfig(
            request_router_class="router.routing.serve_router:PolicyRouter",
            request_router_kwargs={"stats_period_s": STATS_PERIOD_S, "stale_after_periods": 100.0,
                                   "shared_view": shared.to_dict()},
            request_routing_stats_period_s=STATS_PERIOD_S,
        ),
    ).bind(control_name, block_size=BLOCK_SIZE)
    relay = serve.deployment(Relay).options(name="relay", num_replicas=2, ray_actor_options={"num_cpus": 0.1})
    handle = serve.run(relay.bind(worker), name=app, route_prefix=f"/{app}")
    wait_until(lambda: len(ray.get(control.replica_ids.remote())) == 2, WAIT_S, 0.05, message="workers to register")
    try:
        yield Cluster(app, handle, control, redis_server, key_prefix)
    finally:
        ray.get(control.release.remote())
        serve.delete(app)
        ray.kill(control)


def test_a_burst_through_both_ingress_replicas_never_overcommits_the_prefix_owner(cluster: Cluster) -> None:
    """16 requests sharing PREFIX (each needs 2 blocks beyond it), held in flight, one after
    another through the two relays. The owner has 12 free blocks: one router alone would
    send it 6; two private views up to 6 each; the shared view 6 in all."""
    results = [cluster.route(request(PREFIX + [1000 + i] * 16, hold=True)) for i in range(16)]
    try:
        relays = Counter(r["relay"] for r in results)
        assert len(relays) == 2, f"the burst did not go through both ingress replicas: {relays}"
        blocks_on_owner = sum(r["blocks"] for r in results if r["ordinal"] == 0)
        on_owner = sum(r["ordinal"] == 0 for r in results)
        # One decision may race the other router's write still on its way: 2 blocks of slack.
        assert 0 < blocks_on_owner <= OWNER_FREE_BLOCKS + 2, (blocks_on_owner, results)
        assert on_owner < len(results), "nothing spilled to the other replica"
        # Both router copies wrote the shared view (the hints of their dispatches). A router
        # publishes its hints in a task of its own after the dispatch, which may still be on
        # its way when the request's first item is back: wait for it, bounded.
        def writers() -> set[str]:
            return {fields["router"] for _, fields in cluster.redis.client().xrange(f"{cluster.key_prefix}:hints")}

        wait_until(lambda: len(writers()) == 2, WAIT_S, message=lambda: f"hints from both routers: {writers()}")
    finally:
        ray.get(cluster.control.release.remote())


def test_serving_goes_on_when_redis_is_killed_mid_burst(cluster: Cluster) -> None:
    done: list[dict[str, Any]] = []

    def one(i: int) -> dict[str, Any]:
        result = cluster.route(request([5000 + i] * 40))
        done.append(result)
        return result

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        wait_until(lambda: len(done) >= 6, WAIT_S, 0.02, message="requests before the outage")
        with cluster.redis.stopped():
            mark = len(done)
            wait_until(lambda: len(done) >= min(mark + 6, 24), WAIT_S, 0.02, message="requests during the outage")
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert len(results) == 24 and all(r["ordinal"] in (0, 1) for r in results)


def test_a_router_that_starts_after_a_prefix_was_cached_routes_it_to_the_owner_first(cluster: Cluster) -> None:
    """Replica 0 (12 free blocks) caches a new prefix now; replica 1 has 1000 free blocks.
    The controller's last poll (30 s period) predates the cache: a router going by it would
    pick replica 1. A router started now (a new handle in this process: its own router,
    as a restarted ingress replica has) pulls the replicas' stats before its first decision."""
    prefix = list(range(7000, 7048))
    hashes = hash_full_blocks(PREFIX, BLOCK_SIZE) + hash_full_blocks(prefix, BLOCK_SIZE)
    ray.get(cluster.control.set_state.remote(0, prefix_hashes=hashes))
    fresh = serve.get_deployment_handle("fake_worker", cluster.app)
    stream = fresh.options(stream=True).generate.remote(request(prefix + [1] * 16))
    first = next(iter(stream))
    for _ in stream:
        pass
    assert first["ordinal"] == 0 and first["cached"] == 3, first
