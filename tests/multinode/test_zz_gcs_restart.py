"""Ray head / GCS fault tolerance with an external redis-server (the mechanism the chart's
gcsFaultTolerance uses: the GCS keeps its tables in Redis; conftest starts the head with
RAY_REDIS_ADDRESS). Runs last in the session (zz): it restarts the GCS of the shared cluster.

While the GCS process is dead, Serve's data plane (proxy -> ingress -> worker, all direct
actor calls) does not need it: running streams finish token-identical and new requests
through the existing proxies succeed. After the GCS is back, the deployments and their
replicas are the same and routing works as before.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.multinode.conftest import INGRESS_RESOURCE, MIXED_POOL, MultiNodeCluster
from tests.multinode.placement import app_config, completed, greedy_body, placements, run_streams
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

APP = "mn-gcs"
MAX_TOKENS = 240


@pytest.fixture(scope="module")
def app(multinode: MultiNodeCluster, model_dir: Path) -> Iterator[MultiNodeCluster]:
    if not multinode.gcs_fault_tolerant:
        pytest.skip("redis-server is not installed: the cluster runs without GCS fault tolerance")
    from ray import serve

    from cluster.app import build_app

    config = app_config(APP, model_dir, {"num_replicas": 2, "num_gpus": 1, "resources": {MIXED_POOL: 1}},
                        {"resources": {INGRESS_RESOURCE: 0.01}})
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    try:
        yield multinode
    finally:
        serve.delete(APP)


def test_serving_continues_while_the_gcs_restarts(app: MultiNodeCluster) -> None:
    mn = app
    head = mn.cluster.head_node
    urls = [f"{root}/{APP}/v1/completions" for root in (mn.head_url, mn.hosts["ingress"].proxy_url)]
    reference = asyncio.run(run_streams(urls, MAX_TOKENS))
    assert all(completed(o, MAX_TOKENS) for o in reference)
    replicas = {d: {p.replica_id for p in placements(APP, d)} for d in ("ingress", "worker")}

    # The GCS is killed and restarted from this (main) thread: Ray starts it fate-sharing
    # with the thread that spawns it (PR_SET_PDEATHSIG), so a helper thread's exit would
    # kill it again. The streams run on an event loop in a thread of their own.
    progress = [0] * len(urls)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streams = pool.submit(asyncio.run, run_streams(urls, MAX_TOKENS, progress=progress))
        wait_until(lambda: min(progress) >= 3 or streams.done(), 120, interval_s=0.05, message="the streams to start")
        head.kill_gcs_server()
        down_at, chunks_at_kill = time.monotonic(), sum(progress)
        try:
            # New requests through both existing proxies while the GCS is dead.
            with httpx.Client(timeout=60.0) as client:
                statuses = [client.post(urls[i % 2], json=greedy_body(i, 8)).status_code for i in range(6)]
            streamed_while_down = sum(progress) - chunks_at_kill
            downtime = time.monotonic() - down_at
        finally:
            head.start_gcs_server()
        results = streams.result(timeout=300)

    assert statuses == [200] * 6, statuses
    assert streamed_while_down > 0  # the running streams went on meanwhile
    for ref, got in zip(reference, results):
        assert completed(got, MAX_TOKENS), got
        assert got.result.tokens == ref.result.tokens  # type: ignore[union-attr]

    # The GCS is back with the cluster's state from Redis: same deployments, same replicas.
    def intact() -> bool:
        return all({p.replica_id for p in placements(APP, d)} == ids for d, ids in replicas.items())

    wait_until(intact, 120, interval_s=1.0, message="Serve's deployments after the GCS restart",
               retry_on=(Exception,))
    after = asyncio.run(run_streams(urls, 32))
    assert [o.result.tokens for o in after] == [o.result.tokens[:32] for o in reference]  # type: ignore[union-attr]
    print(f"\nGCS-RESTART down_s={downtime:.1f} requests_during_outage={len(statuses)} "
          f"chunks_streamed_during_outage={streamed_while_down} streams={len(results)} lost=0")
