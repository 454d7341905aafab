"""Scale to zero and back under the SLO planner, on real Ray Serve replicas.

The worker is the real WorkerReplica over the real engine core with a model-free runner
(tests/integration/fake_engine_worker.py); its deployment options come from cluster/app.py's
`worker_options` for a KVServeConfig with `autoscaling.slo` and `scale_to_zero`, so the
planner (cluster.planner.serve_policy:SLOPlannerPolicy, priced by a simulated H200's cost
model) runs in Serve's controller as in production. Scenario (bounded waits, no sleeps to
synchronise):
  1. the pool starts with one replica; a few requests are served;
  2. idle, the planner forecasts under half a request before a replica could start and
     wants zero: Serve removes the replica;
  3. requests sent to the empty pool are held in the handle's queue (not failed) while
     Serve starts a replica, and every one of them finishes with all its tokens.
"""
from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from ray import serve

from cluster.app import worker_options
from cluster.config import KVServeConfig
from cluster.slo_config import PLANNER_POLICY
from tests.integration.fake_engine_worker import TOKEN, FakeEngineWorker
from tests.integration.test_autoscaling import consume, live, replica_states, request, with_status
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:.*metrics_interval_s.*:DeprecationWarning"),
]

STEP_S = 0.02
TOKENS = 10
POLL_S = 0.1


def kvserve_config() -> KVServeConfig:
    return KVServeConfig.from_dict({
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b"},  # what the planner prices steps with
        "routing": {"router": "pow2"},
        "workers": {
            "num_cpus": 0.1,
            "num_gpus": 0,
            "drain_timeout_s": 10.0,
            "autoscaling": {
                "min_replicas": 0, "initial_replicas": 1, "max_replicas": 2, "scale_to_zero": True,
                "upscale_delay_s": 0.0, "downscale_delay_s": 1.0, "look_back_period_s": 1.0,
                "metrics_interval_s": 0.5,
                "slo": {"ttft_ms": 2000, "itl_ms": 50, "startup_s": 1.0, "interval_s": 0.5},
            },
        },
    })


def test_the_planner_scales_a_pool_to_zero_and_back_without_losing_a_request(serve_cluster: Any) -> None:
    config = kvserve_config()
    options = worker_options(config)
    assert options["autoscaling_config"].policy.policy_function == PLANNER_POLICY
    app_name = f"zero-{uuid.uuid4().hex[:6]}"
    deployment = serve.deployment(FakeEngineWorker, name="worker").options(**options)
    handle = serve.run(deployment.bind(max_num_seqs=4, step_s=STEP_S, drain_timeout_s=10.0),
                       name=app_name, route_prefix=None)
    pool = ThreadPoolExecutor(max_workers=8)

    def send(num: int) -> list[Any]:
        futures = [pool.submit(consume, handle.options(stream=True).generate.remote(request(TOKENS)))
                   for _ in range(num)]
        return [f.result(timeout=120) for f in futures]

    try:
        first = send(3)
        assert all(r.error is None and r.tokens == [TOKEN] * TOKENS for r in first)
        # 2. idle: the planner wants zero, Serve removes the replica
        wait_until(lambda: live(replica_states(app_name)) == 0, 90.0, POLL_S,
                   message=with_status("the idle pool to go to zero replicas"))
        # 3. requests to the empty pool wait for a replica, and all finish
        t0 = time.monotonic()
        second = send(4)
        assert all(r.error is None and r.tokens == [TOKEN] * TOKENS and r.finish_reason == "length"
                   for r in second), [r.error for r in second]
        assert time.monotonic() - t0 < 120
        # served by a replica started for them (the first one was removed)
        assert {r.replica_id for r in second}.isdisjoint({r.replica_id for r in first})
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        serve.delete(app_name)
