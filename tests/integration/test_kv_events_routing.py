"""The router's exact KV index through real Serve (issue 29): after a prefix-cache reset, no
routing decision credits a replica with blocks it no longer holds, from 1 s on.

Real Serve and a real redis-server: two `Relay` replicas play the ingress (each holds a
handle to the worker deployment, so each has its own PolicyRouter, as each kvserve ingress
replica does; the router kwargs carry the shared Redis view), in front of two
FakeEngineWorker replicas: worker/serving/replica.py's WorkerReplica over the real engine core and
block pool (only the model runner is fake), so the KV events are the engine's own. The
replicas report every 0.5 s.

The truth a decision is checked against: every prompt is PREFIX (3 full blocks) plus a tail
of its own, both replicas cache PREFIX before the reset, the pools are far larger than
the test's prompts (nothing is evicted), nothing is sent in the first second after the
reset, and requests then run one at a time; so a replica holds PREFIX's 3 blocks exactly
when it has finished a request since the reset, and none otherwise. Every decision from
then on is checked, the first ones against an empty cluster.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from router.routing.redis_view import SharedViewSpec
from router.serve_internals import request_router_of
from tests.integration.fake_engine_worker import FakeEngineWorker
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_until
from worker.api import GenerateRequest, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK_SIZE = 16
STATS_PERIOD_S = 0.5
PREFIX = list(range(1, 49))  # 3 full blocks
WAIT_S = 60.0
WITHIN_S = 1.0  # the bound under test
WATCH_S = 2.5  # decisions are taken this long after the reset


def prompt(i: int) -> list[int]:
    """PREFIX and a tail of its own (i < 169): only PREFIX is shared."""
    return PREFIX + [50 + i % 13] * 8 + [50 + i // 13] * 9


class WarmableWorker(FakeEngineWorker):
    async def warm(self, token_ids: list[int]) -> None:
        """Cache a prompt here (the test puts PREFIX on every replica with a broadcast)."""
        async for _ in self.engine.generate(token_ids, SamplingParams(max_tokens=1)):
            pass


class Relay:
    """The ingress stand-in: sends a request through its own handle (its own router), and
    says where it ran, what that replica had cached, and what the decision credited."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    async def route(self, request: GenerateRequest) -> dict[str, Any]:
        outputs = [out async for out in self.worker.options(stream=True).generate.remote(request)]
        policy = request_router_of(self.worker).policy
        return {
            "replica": outputs[0].extra["replica_id"],
            "cached_blocks": outputs[-1].num_cached_tokens // BLOCK_SIZE,
            "credited": {key.unique_id: n for key, n in policy.last_credited.items()},
            "decided_at": policy.last_decided_at,
        }

    def index(self) -> dict[str, Any]:
        """This relay's router's KV index per replica (its size per tier, epoch and seq);
        {} before its first request made the router."""
        router = request_router_of(self.worker)
        if router is None:
            return {}
        return {rid: entry.get("kv_index") for rid, entry in router.routing_view().items()}


@dataclass
class Cluster:
    relay: Any
    worker: Any

    def route(self, i: int) -> dict[str, Any]:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        request = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt(i), params=params)
        return self.relay.route.remote(request).result(timeout_s=WAIT_S)

    def indexes(self) -> list[dict[str, Any]]:
        return self.relay.broadcast("index").results(timeout_s=WAIT_S)


@pytest.fixture(scope="module")
def cluster(serve_cluster: Any, redis_server: RedisServer) -> Iterator[Cluster]:
    app = f"kvevents-{uuid.uuid4().hex[:6]}"
    shared = SharedViewSpec(url=redis_server.url, key_prefix=f"kvserve-test:{app}", socket_timeout_s=1.0)
    worker = serve.deployment(WarmableWorker).options(
        name="engine_worker", num_replicas=2, max_ongoing_requests=100, ray_actor_options={"num_cpus": 0.1},
        request_router_config=RequestRouterConfig(
            request_router_class="router.routing.serve_router:PolicyRouter",
            request_router_kwargs={"stats_period_s": STATS_PERIOD_S, "shared_view": shared.to_dict()},
            request_routing_stats_period_s=STATS_PERIOD_S,
        ),
    ).bind(max_num_seqs=4, step_s=0.005, num_blocks=256, block_size=BLOCK_SIZE)
    relay = serve.deployment(Relay).options(name="relay", num_replicas=2, ray_actor_options={"num_cpus": 0.1})
    handle = serve.run(relay.bind(worker), name=app, route_prefix=f"/{app}")
    try:
        yield Cluster(handle, serve.get_deployment_handle("engine_worker", app))
    finally:
        serve.delete(app)


def test_no_decision_credits_cleared_blocks_from_one_second_after_a_reset(cluster: Cluster) -> None:
    assert len(cluster.worker.broadcast("warm", prompt(0)).results(timeout_s=WAIT_S)) == 2

    def both_indexed() -> list[dict[str, Any]] | None:
        """Every relay's router indexes PREFIX's blocks on both replicas from their events; a
        relay that has not routed yet has no router: route (through either) meanwhile."""
        result = cluster.route(1)
        indexes = cluster.indexes()
        if all(len(ix) == 2 and all((e or {}).get("device", 0) >= 3 for e in ix.values()) for ix in indexes):
            return [result, *(cluster.route(2 + i) for i in range(2))]
        return None

    before = wait_until(both_indexed, WAIT_S, 0.05, message="both relays' routers to index PREFIX on both replicas")
    # Decisions before the reset do credit PREFIX (3 blocks) to both replicas.
    assert all(sorted(r["credited"].values()) == [3, 3] for r in before[1:]), before

    assert len(cluster.worker.broadcast("reset_prefix_cache").results(timeout_s=WAIT_S)) == 2
    reset_at = time.time()
    time.sleep(WITHIN_S)  # the bound under test (decisions from then on), not synchronisation

    holders: set[str] = set()  # replicas that ran a request since the reset: they hold PREFIX again
    checked = []
    i = 10
    while time.time() < reset_at + WATCH_S or len(checked) < 3:
        result = cluster.route(i)
        i += 1
        assert result["decided_at"] >= reset_at + WITHIN_S, result
        for replica, credited in result["credited"].items():
            held = 3 if replica in holders else 0
            assert credited <= held, (f"{result['decided_at'] - reset_at:.2f} s after the reset, "
                                      f"{replica} was credited {credited} blocks, holds {held}", result)
        assert len(result["credited"]) == 2, result  # both replicas were scored
        assert result["cached_blocks"] == (3 if result["replica"] in holders else 0), result
        holders.add(result["replica"])
        checked.append(result)
    # Both routers hold the same index once they have seen the same reports.
    wait_until(lambda: (lambda a, b: a == b)(*cluster.indexes()), WAIT_S, 0.05,
               message="both relays' routers to hold the same index")
