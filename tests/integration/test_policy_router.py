"""Baseline routing policies through real Ray Serve: router/routing/serve_router.py's PolicyRouter,
configured by cluster/app.py from `routing.router`, over the real worker replica and engine
with a model-free runner (tests/integration/fake_engine_worker.py).

Calls go through a DeploymentHandle made in this driver, so the router instance runs here
(as in test_routing.py); every request is awaited before the next is sent, so each choice
sees the previous one completed and the expected placement is exact.
"""
from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import POLICY_ROUTER, worker_options  # noqa: E402
from cluster.config import KVServeConfig  # noqa: E402
from tests.integration.fake_engine_worker import FakeEngineWorker  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402
from worker.api import GenerateRequest  # noqa: E402
from worker.api import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NUM_REPLICAS = 3
STATS_PERIOD_S = 0.5
WAIT_S = 60.0
POLL_S = 0.05


def deploy(policy: str) -> tuple[str, Any]:
    config = KVServeConfig.from_dict({
        "engine": {"device": "cpu"},
        "routing": {"router": policy, "stats_period_s": STATS_PERIOD_S},
        "workers": {"num_replicas": NUM_REPLICAS, "num_cpus": 0.1, "num_gpus": 0},
    })
    options = worker_options(config)
    router_config = options["request_router_config"]
    assert router_config.request_router_class == POLICY_ROUTER
    assert router_config.request_router_kwargs["policy"] == policy
    app_name = f"policy-{policy}-{uuid.uuid4().hex[:6]}"
    deployment = serve.deployment(FakeEngineWorker, name="worker").options(**options)
    handle = serve.run(deployment.bind(max_num_seqs=4, step_s=0.005), name=app_name, route_prefix=None)
    handle.stats.remote().result(timeout_s=WAIT_S)  # initialises the handle's router here
    router = handle._router._asyncio_router.request_router  # Serve internals, as test_routing.py
    wait_until(lambda: len(router.routing_view()) == NUM_REPLICAS, WAIT_S, POLL_S,
               message=f"the router to see {NUM_REPLICAS} replicas")
    return app_name, handle


@pytest.fixture
def round_robin(serve_cluster: Any) -> Iterator[Any]:
    app_name, handle = deploy("round_robin")
    try:
        yield handle
    finally:
        serve.delete(app_name)


@pytest.fixture
def prefix_affinity(serve_cluster: Any) -> Iterator[Any]:
    app_name, handle = deploy("prefix_affinity")
    try:
        yield handle
    finally:
        serve.delete(app_name)


def served_by(handle: Any, prompt: list[int]) -> str:
    """Run one request to the end; the replica that streamed it."""
    request = GenerateRequest(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=2, temperature=0.0))
    replica_ids = {out.extra["replica_id"] for out in handle.options(stream=True).generate.remote(request)}
    assert len(replica_ids) == 1
    return replica_ids.pop()


def test_round_robin_spreads_requests_evenly(round_robin: Any) -> None:
    router = round_robin._router._asyncio_router.request_router
    assert type(router).__name__ == "PolicyRouter" and router.policy.name == "round_robin"
    placed = [served_by(round_robin, [1, 2, 3, 4]) for _ in range(3 * NUM_REPLICAS)]
    assert sorted(Counter(placed).values()) == [3] * NUM_REPLICAS
    # Consecutive requests never repeat a replica: the rotation moves one place each time.
    assert all(a != b for a, b in zip(placed, placed[1:]))
    assert router.num_decisions_by_mode["round_robin"] == 3 * NUM_REPLICAS
    assert router.num_hook_calls["routed"] >= 3 * NUM_REPLICAS


def test_prefix_affinity_keeps_a_prefix_together_and_spreads_new_ones(prefix_affinity: Any) -> None:
    router = prefix_affinity._router._asyncio_router.request_router
    assert router.policy.name == "prefix_affinity"
    shared = list(range(64))  # 4 blocks of 16 in the router's own record (the fake vocab is 64)
    group = [served_by(prefix_affinity, shared + [i]) for i in range(6)]
    assert len(set(group)) == 1, group
    # New prompts (no match) go to the replica with the smallest record: the two others first.
    cold = [served_by(prefix_affinity, [40 + i] * 32) for i in range(2)]
    assert set(cold) | set(group) == set(router.routing_view()) and len(set(cold)) == 2
    assert router.num_decisions_by_mode["cache"] == 5 and router.num_decisions_by_mode["spread"] == 3
