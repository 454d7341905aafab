"""Disaggregated pools scale independently, each on its own queue signal, and export their
decisions as metrics; a pool's scale-down lets its running streams finish.

The pools are the real WorkerReplica over the real engine core with a model-free runner
(tests/integration/fake_engine_worker.py), deployed with the Serve options cluster/app.py's
`pool_options` gives a disaggregated KVServeConfig: kvserve's policy with role prefill
(sized on waiting prompt tokens) and role decode (on waiting requests), Serve's delays, the
drain on removal. Requests go to each pool through its deployment handle (the KV transfer
between them is not under test: tests/integration/test_disaggregation.py).

  1. prompt-heavy load on the prefill pool only: prefill scales 1 -> 2, decode stays at 1;
  2. the prefill load stops and queued decode work arrives: decode scales 1 -> 2 while
     prefill goes back to 1 (each on its own signal);
  3. long streams go to the new decode replica; the queue drains, Serve removes that
     replica while they stream: every stream ends with all its tokens;
  4. the decisions are in Ray's metrics (the head's metrics agent, as the chart scrapes it):
     each pool's target, signals, and its changes up and down.

Every wait polls serve.status() (or the metrics endpoint) with a bound; nothing sleeps to
synchronise.
"""
from __future__ import annotations

import random
import re
import time
import urllib.request
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from ray import serve

from cluster.app import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, pool_options
from cluster.config import KVServeConfig
from tests.integration.fake_engine_worker import TOKEN, FakeEngineWorker
from tests.integration.test_autoscaling import Result, consume
from tests.support.waiting import wait_until
from worker.api import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(420),
    pytest.mark.filterwarnings("ignore:.*metrics_interval_s.*:DeprecationWarning"),
]

STEP_S = 0.05
MAX_NUM_SEQS = 2
DRAIN_TIMEOUT_S = 45.0
# A prefill-pool request: a long prompt. It runs 20 fake steps (~1 s) rather than one, so
# that its queue of waiting prompt tokens lasts between the test's top-ups however slowly a
# loaded machine polls (the policy sees only the queue).
PROMPT_TOKENS, PREFILL_TOKENS = 600, 20
DECODE_BURST, DECODE_TOKENS = 8, 40  # ~2 s each, two at a time: six wait
LONG, LONG_TOKENS = 2, 300  # ~15 s: still streaming when their replica is removed
POLL_S = 0.1
SCALE_WAIT_S = 150.0  # a new replica is a new Ray worker process: slow on a loaded 2-core box


def pool(role: str, **targets: float) -> dict[str, Any]:
    return {
        "num_cpus": 0.1, "num_gpus": 0, "drain_timeout_s": DRAIN_TIMEOUT_S,
        "autoscaling": {"min_replicas": 1, "max_replicas": 2, "role": role, "upscale_delay_s": 1.0,
                        "downscale_delay_s": 3.0, "look_back_period_s": 2.0, "metrics_interval_s": 0.5, **targets},
    }


def kvserve_config() -> KVServeConfig:
    return KVServeConfig.from_dict({
        "engine": {"device": "cpu"},
        "routing": {"router": "pow2"},  # routing is not under test here
        "disaggregation": {
            "prefill": pool("prefill", target_waiting_prompt_tokens_per_replica=1000),
            "decode": pool("decode", target_waiting_per_replica=2),
        },
    })


def live(app: str, deployment: str) -> int:
    """Replicas Serve runs or starts for the deployment (its current target)."""
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    states = status.deployments[deployment].replica_states
    return sum(int(n) for state, n in states.items() if str(getattr(state, "value", state)) not in ("STOPPING", "STOPPED"))


def running(app: str, deployment: str) -> int:
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return sum(int(n) for state, n in status.deployments[deployment].replica_states.items()
               if str(getattr(state, "value", state)) == "RUNNING")


def request(prompt_len: int, max_tokens: int) -> GenerateRequest:
    """A prompt of its own (seeded by the request id): waiting prompt tokens count only what
    the prefix cache does not hold, so identical prompts would queue no prefill work."""
    request_id = uuid.uuid4().hex
    rng = random.Random(request_id)
    return GenerateRequest(request_id, [3 + rng.randrange(50) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0))


def ray_metrics() -> str:
    import ray

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first exported series `ray_<name>` whose labels include `labels`."""
    for line in text.splitlines():
        m = re.match(rf"ray_{name}{{(.*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


def test_prefill_and_decode_scale_independently(serve_cluster: Any) -> None:
    config = kvserve_config()
    suffix = uuid.uuid4().hex[:6]
    apps, handles = {}, {}
    for name, (pool_config, options) in pool_options(config).items():
        assert options["autoscaling_config"].policy.policy_kwargs["role"] == name
        apps[name] = f"{name}-{suffix}"
        deployment = serve.deployment(FakeEngineWorker, name=name).options(**options)
        handles[name] = serve.run(
            deployment.bind(max_num_seqs=MAX_NUM_SEQS, step_s=STEP_S, num_blocks=512,
                            drain_timeout_s=pool_config.workers.drain_timeout_s),
            name=apps[name], route_prefix=None,
        )
    prefill, decode = PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT
    pool_threads = ThreadPoolExecutor(max_workers=48)

    def send(name: str, num: int, prompt_len: int, max_tokens: int) -> list[Future[Result]]:
        stream = handles[name].options(stream=True).generate
        return [pool_threads.submit(consume, stream.remote(request(prompt_len, max_tokens))) for _ in range(num)]

    def sizes() -> tuple[int, int]:
        return live(apps[prefill], prefill), live(apps[decode], decode)

    sent: list[Future[Result]] = []
    try:
        wait_until(lambda: sizes() == (1, 1), SCALE_WAIT_S, POLL_S, message=lambda: f"both pools at one replica: {sizes()}")

        # 1. Prompt-heavy load on the prefill pool: its waiting prompt tokens (eight requests
        # kept in flight, two run: ~3600 waiting) ask for two replicas; the decode pool has no work.
        def prefill_up() -> bool:
            assert live(apps[decode], decode) == 1, "the decode pool moved on the prefill pool's load"
            if running(apps[prefill], prefill) == 2:
                return True
            sent.extend(send(prefill, 8 - sum(not f.done() for f in sent), PROMPT_TOKENS, PREFILL_TOKENS))
            return False

        wait_until(prefill_up, SCALE_WAIT_S, POLL_S, message=lambda: f"prefill to run 2 replicas: {sizes()}")

        # 2. Queued decode work; no more prompts: decode grows while prefill shrinks.
        burst = send(decode, DECODE_BURST, 8, DECODE_TOKENS)
        seen_crossed = False

        def decode_up_prefill_down() -> bool:
            nonlocal seen_crossed
            seen_crossed = seen_crossed or sizes() == (1, 2)
            if running(apps[decode], decode) == 2 and live(apps[prefill], prefill) == 1:
                return True
            burst.extend(send(decode, DECODE_BURST - sum(not f.done() for f in burst), 8, DECODE_TOKENS))
            return False

        wait_until(decode_up_prefill_down, SCALE_WAIT_S, POLL_S,
                   message=lambda: f"decode at 2 running and prefill back at 1: {sizes()}")
        assert seen_crossed or sizes() == (1, 2)

        # 3. Long streams land on the idle new decode replica (the first one holds the
        # queue); when the queue drains Serve removes that replica while they stream.
        long = send(decode, LONG, 8, LONG_TOKENS)
        wait_until(lambda: live(apps[decode], decode) == 1, SCALE_WAIT_S, 0.05,
                   message=lambda: f"the decode pool to scale down: {sizes()}")
        t_removing = time.monotonic()
        results = [f.result(timeout=SCALE_WAIT_S) for f in sent + burst + long]
        for r in results:
            assert r.error is None, r.error
        assert all(r.tokens == [TOKEN] * PREFILL_TOKENS for r in results[:len(sent)])
        assert all(r.tokens == [TOKEN] * DECODE_TOKENS for r in results[len(sent):len(sent) + len(burst)])
        long_results = results[len(sent) + len(burst):]
        assert all(r.tokens == [TOKEN] * LONG_TOKENS and r.finish_reason == "length" for r in long_results)
        survivor = handles[decode].stats.remote().result(timeout_s=60)["replica_id"]
        streamed_through = [r for r in long_results if r.replica_id != survivor and r.last_output_time > t_removing]
        assert streamed_through, "no long stream was still running on the decode replica Serve removed"

        # 4. The decisions, as Prometheus would scrape them from the head's metrics agent.
        def exported() -> bool:
            text = ray_metrics()
            return all(metric(text, "kvserve_autoscaling_decisions_total", deployment=d, direction=direction)
                       for d in (prefill, decode) for direction in ("up", "down"))

        wait_until(exported, 90.0, 1.0, message=lambda: "decision metrics in Ray's metrics agent:\n" + "\n".join(
            line for line in ray_metrics().splitlines() if "kvserve_autoscaling" in line))
        text = ray_metrics()
        for name, signal in ((prefill, "num_waiting_prompt_tokens"), (decode, "num_waiting")):
            app = {"application": apps[name], "deployment": name, "role": name}
            assert metric(text, "kvserve_autoscaling_target_replicas", **app) is not None
            assert metric(text, "kvserve_autoscaling_signal", signal=signal, **app) is not None
            assert metric(text, "kvserve_autoscaling_wanted_replicas", signal=signal, **app) is not None
    finally:
        pool_threads.shutdown(wait=False, cancel_futures=True)
        for app in apps.values():
            serve.delete(app)
