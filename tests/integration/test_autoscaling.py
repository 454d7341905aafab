"""Queue-depth autoscaling and graceful drain of the worker pool, on real Ray Serve replicas.

The worker is the real WorkerReplica over the real engine core with a model-free runner
(tests/integration/fake_engine_worker.py: each step sleeps STEP_S, max_num_seqs 2, so extra
requests wait in the engine's queue exactly as on a real one). The deployment options come
from cluster/app.py's `worker_options` for a KVServeConfig, so the real policy
(cluster.autoscaling:QueueDepthPolicy with the typed targets as policy_kwargs), the delays,
the metrics interval and the drain timeout all travel the production path.

One scenario, timed from serve.status() polls (bounded loops, never a sleep to synchronise):
  1. a burst of BURST requests lands on the one replica: two run, the rest wait, the
     policy wants ceil(waiting / 4) > 3, Serve scales to MAX_REPLICAS after upscale_delay_s;
     until the new replicas run (slow on a loaded machine), the burst is topped up so the
     queue, and the demand, stay;
  2. once the new replicas run, LONG requests go to them (the first replica is busy);
  3. the first replica's queue empties, demand falls to one replica and Serve removes the
     two newest replicas (Serve 2.60 stops the newest first) while the long requests still
     stream from them: every request must still finish with all its tokens.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

import ray
from ray import serve  # noqa: E402

from cluster.app import worker_options  # noqa: E402
from cluster.config import KVServeConfig  # noqa: E402
from tests.integration.fake_engine_worker import TOKEN, FakeEngineWorker  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402
from worker.api import GenerateRequest, SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(360),
    # Serve re-validates the AutoscalingConfig wherever it travels; metrics_interval_s is
    # deprecated but is still the only push-interval setting Ray 2.60 reads.
    pytest.mark.filterwarnings("ignore:.*metrics_interval_s.*:DeprecationWarning"),
]

STEP_S = 0.05  # one engine step of the fake runner
MAX_NUM_SEQS = 2
MAX_REPLICAS = 3
UPSCALE_DELAY_S = 1.0
DOWNSCALE_DELAY_S = 3.0
LOOK_BACK_S = 2.0
METRICS_INTERVAL_S = 0.5
DRAIN_TIMEOUT_S = 45.0
# The scale-up decision: the upscale delay, plus up to a look-back window for the mean queue
# to cross the target and a few metric pushes and control-loop ticks (a loaded 2-core box).
UPSCALE_SLACK_S = LOOK_BACK_S + 6.0

BURST, BURST_TOKENS = 16, 20  # ~1 s each: 14 waiting on one replica, demand for 4
# ~15 s each: still streaming when their replicas are removed (the queue left at step 2
# drains in ~7 s, then look-back and the downscale delay). Two fit the two free slots of
# whichever new replicas they land on, so neither waits in a queue.
LONG, LONG_TOKENS = 2, 300
WAIT_S = 90.0  # the default wait (tests/integration/waiting.py)
POLL_S = 0.1

def with_status(what: str) -> Callable[[], str]:
    """A wait's message with serve.status() as it is when the wait times out."""
    return lambda: f"{what}; {serve.status()}"


@dataclass
class Result:
    """One request as its caller saw it."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    replica_id: str | None = None
    last_output_time: float = 0.0
    error: str | None = None


def consume(stream: Any) -> Result:
    result = Result()
    try:
        for out in stream:
            result.tokens.extend(out.new_token_ids)
            result.replica_id = result.replica_id or out.extra.get("replica_id")
            result.last_output_time = time.monotonic()
            if out.finished:
                result.finish_reason = out.finish_reason
    except Exception as e:  # a dropped stream: reported by the assertions, not raised here
        result.error = f"{type(e).__name__}: {e}"
    return result


def request(max_tokens: int) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return GenerateRequest(uuid.uuid4().hex, [3, 4, 5, 6, 7, 8, 9, 10], params)


def kvserve_config() -> KVServeConfig:
    return KVServeConfig.from_dict({
        "engine": {"device": "cpu"},
        "routing": {"router": "pow2"},  # routing is not under test here
        "workers": {
            "num_cpus": 0.1,
            "num_gpus": 0,
            "drain_timeout_s": DRAIN_TIMEOUT_S,
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": MAX_REPLICAS,
                "role": "mixed",
                "target_waiting_per_replica": 4,
                "upscale_delay_s": UPSCALE_DELAY_S,
                "downscale_delay_s": DOWNSCALE_DELAY_S,
                "look_back_period_s": LOOK_BACK_S,
                "metrics_interval_s": METRICS_INTERVAL_S,
            },
        },
    })


def replica_states(app_name: str) -> dict[str, int]:
    app = serve.status().applications.get(app_name)
    if app is None or "worker" not in app.deployments:
        return {}
    return {str(getattr(k, "value", k)): int(v) for k, v in app.deployments["worker"].replica_states.items()}


def live(states: dict[str, int]) -> int:
    """Replicas Serve is running or starting (its current target)."""
    return sum(n for state, n in states.items() if state not in ("STOPPING", "STOPPED"))


def test_queue_depth_scales_up_then_down_without_dropping_requests(serve_cluster: Any) -> None:
    config = kvserve_config()
    options = worker_options(config)
    policy = options["autoscaling_config"].policy
    assert policy.policy_function == "cluster.autoscaling:QueueDepthPolicy"
    app_name = f"autoscale-{uuid.uuid4().hex[:6]}"
    deployment = serve.deployment(FakeEngineWorker, name="worker").options(**options)
    handle = serve.run(
        deployment.bind(max_num_seqs=MAX_NUM_SEQS, step_s=STEP_S, drain_timeout_s=config.workers.drain_timeout_s),
        name=app_name, route_prefix=None,
    )
    pool = ThreadPoolExecutor(max_workers=64)

    def send(num: int, max_tokens: int) -> list[Future[Result]]:
        return [pool.submit(consume, handle.options(stream=True).generate.remote(request(max_tokens)))
                for _ in range(num)]

    try:
        first_replica = handle.stats.remote().result(timeout_s=WAIT_S)["replica_id"]
        assert live(replica_states(app_name)) == 1

        # 1. Burst: everything lands on the one replica; its queue grows past the target.
        t_burst = time.monotonic()
        burst = send(BURST, BURST_TOKENS)
        wait_until(lambda: live(replica_states(app_name)) == MAX_REPLICAS, UPSCALE_DELAY_S + UPSCALE_SLACK_S + 5,
                   POLL_S, message=with_status(f"Serve to decide on {MAX_REPLICAS} replicas"))
        upscale_s = time.monotonic() - t_burst
        assert upscale_s <= UPSCALE_DELAY_S + UPSCALE_SLACK_S, f"scale-up took {upscale_s:.1f}s"
        assert upscale_s >= UPSCALE_DELAY_S * 0.9, f"scale-up after {upscale_s:.1f}s: the delay was not applied"

        def all_running() -> bool:
            # Keep the queue (and so the demand) until the new replicas run; otherwise the
            # pool could shrink before step 2 puts work on them.
            if replica_states(app_name).get("RUNNING", 0) == MAX_REPLICAS:
                return True
            burst.extend(send(BURST - sum(not f.done() for f in burst), BURST_TOKENS))
            return False

        # Generous: a new replica is a new Ray worker process, slow to start on a loaded box.
        wait_until(all_running, 150.0, POLL_S, message=with_status(f"{MAX_REPLICAS} replicas to run"))

        def handle_knows_all() -> bool:
            # Serve reports a replica RUNNING before this handle's router hears of it; until
            # it has, the long requests below could only go to the first replica.
            answers = handle.broadcast("stats").results(timeout_s=WAIT_S, return_exceptions=True)
            return len([a for a in answers if isinstance(a, dict)]) == MAX_REPLICAS

        wait_until(handle_knows_all, WAIT_S, POLL_S, message=with_status("the handle to route to every replica"))
        t_running = time.monotonic()

        # 2. Long requests: the router sends them to the idle new replicas.
        long = send(LONG, LONG_TOKENS)

        # 3. The queue empties; Serve removes replicas while the long requests stream.
        def removing() -> bool:
            states = replica_states(app_name)
            return states.get("STOPPING", 0) > 0 or live(states) < MAX_REPLICAS

        wait_until(removing, WAIT_S, 0.05, message=with_status("Serve to start removing replicas"))
        t_stopping = time.monotonic()  # at or after the first removal began
        wait_until(lambda: replica_states(app_name) == {"RUNNING": 1}, LONG_TOKENS * STEP_S * 3 + DRAIN_TIMEOUT_S,
                   POLL_S, message=with_status("the pool to settle at one replica (removed ones drained and gone)"))
        t_settled = time.monotonic()

        results = [f.result(timeout=WAIT_S) for f in burst + long]
        for r in results:  # nothing dropped: every stream ended normally with every token
            assert r.error is None, r.error
            assert r.finish_reason == "length"
        assert all(r.tokens == [TOKEN] * BURST_TOKENS for r in results[:len(burst)])
        assert all(r.tokens == [TOKEN] * LONG_TOKENS for r in results[len(burst):])

        survivor = handle.stats.remote().result(timeout_s=WAIT_S)["replica_id"]
        assert survivor == first_replica  # Serve removes the newest replicas first
        removed = {r.replica_id for r in results} - {survivor}
        assert removed, "no request ran on a replica that was later removed"
        drained = [r for r in results if r.replica_id in removed and r.last_output_time > t_stopping]
        assert drained, "no request was still streaming from a replica when Serve began removing it"
        print(f"\nscale-up decided {upscale_s:.1f}s after the burst (delay {UPSCALE_DELAY_S}s); "
              f"{MAX_REPLICAS} running at +{t_running - t_burst:.1f}s; removal began at "
              f"+{t_stopping - t_burst:.1f}s; settled at one replica at +{t_settled - t_burst:.1f}s; "
              f"{len(burst)} burst requests; {len(drained)} requests finished on replicas being removed, last at "
              f"+{max(r.last_output_time for r in drained) - t_burst:.1f}s")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        serve.delete(app_name)
