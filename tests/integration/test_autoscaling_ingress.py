"""The ingress deployment scales on its own signal, open streams per ingress replica
(KVServeConfig ingress.autoscaling -> Serve's policy), and its scale-down lets the streams
of the replica it removes finish.

The app is the production one (cluster/app.py build_app) on the simulated device
(engine.device sim:h200: the real engine, scheduler and KV pool, a modelled step time, the
embedded model's tokenizer): clients stream completions over HTTP through Serve's proxy.

  1. SHORT streams held open on the one ingress replica (more than target_ongoing_requests)
     ask for a second one; until it runs they are topped up;
  2. LONG streams go out once it runs (the proxy sends them to the idle new replica);
  3. the short ones end, demand falls to one replica and Serve removes the newest while
     the long ones stream (one that ends before Serve decides is replaced, since how long
     Serve takes depends on the machine's load): every stream ends with [DONE], finish_reason length and the
     text an undisturbed run of the same request gives.

Waits poll serve.status() with bounds; nothing sleeps to synchronise.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from ray import serve

from cluster.app import INGRESS_DEPLOYMENT, build_app
from cluster.config import KVServeConfig
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(360),
    pytest.mark.filterwarnings("ignore:.*metrics_interval_s.*:DeprecationWarning"),
]

APP = "ingress-autoscale"
MODEL = "sim-ingress"
TARGET_STREAMS = 2  # target_ongoing_requests per ingress replica
SHORT, SHORT_TOKENS = 6, 200
LONG, LONG_TOKENS = 2, 2000  # open while Serve removes their ingress replica (topped up until then)
PROMPT = "Scaling the ingress on open streams"
POLL_S = 0.1
SCALE_WAIT_S = 150.0


def kvserve_config() -> KVServeConfig:
    return KVServeConfig.from_dict({
        "app_name": APP,
        "route_prefix": f"/{APP}",
        "model": {"served_model_name": MODEL},
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "max_model_len": 4096},
        "workers": {"num_replicas": 1, "num_cpus": 0.2},
        "routing": {"router": "pow2"},
        "ingress": {
            "num_cpus": 0.1, "api_keys_env": None, "request_timeout_s": 180,
            "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": TARGET_STREAMS,
                            "upscale_delay_s": 1.0, "downscale_delay_s": 3.0, "look_back_period_s": 2.0,
                            "metrics_interval_s": 0.5},
        },
    })


@dataclass
class Stream:
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # the [DONE] line arrived
    last_chunk_time: float = 0.0
    error: str | None = None


def stream(url: str, max_tokens: int) -> Stream:
    out = Stream()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url, json=body, timeout=180) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}"
                return out
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = str(event["error"])
                        continue
                    choice = event["choices"][0]
                    out.text += choice["text"]
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    out.last_chunk_time = time.monotonic()
    except httpx.HTTPError as e:  # a cut stream: reported by the assertions
        out.error = f"{type(e).__name__}: {e}"
    return out


def ingress_states() -> dict[str, int]:
    app = serve.status().applications.get(APP)
    if app is None or INGRESS_DEPLOYMENT not in app.deployments:
        return {}
    return {str(getattr(k, "value", k)): int(v) for k, v in app.deployments[INGRESS_DEPLOYMENT].replica_states.items()}


def test_ingress_scales_on_streams_and_drains_on_scale_down(serve_cluster: Any) -> None:
    config = kvserve_config()
    serve.run(build_app(config), name=APP, route_prefix=config.route_prefix)
    url = f"{serve_cluster.http_url}/{APP}/v1/completions"
    threads = ThreadPoolExecutor(max_workers=24)
    try:
        wait_until(lambda: ingress_states() == {"RUNNING": 1}, SCALE_WAIT_S, POLL_S,
                   message=lambda: f"one ingress replica: {ingress_states()}")
        undisturbed = {n: stream(url, n) for n in (SHORT_TOKENS, LONG_TOKENS)}
        assert all(s.done and s.error is None for s in undisturbed.values()), undisturbed

        # 1. More open streams than the target: Serve adds an ingress replica.
        short: list[Future[Stream]] = []

        def two_running() -> bool:
            if ingress_states().get("RUNNING", 0) == 2:
                return True
            short.extend(threads.submit(stream, url, SHORT_TOKENS) for _ in range(SHORT - sum(not f.done() for f in short)))
            return False

        t0 = time.monotonic()
        wait_until(two_running, SCALE_WAIT_S, POLL_S, message=lambda: f"two ingress replicas: {ingress_states()}")
        t_two = time.monotonic()

        # 2. Long streams: the proxy sends them to the idle new replica.
        long = [threads.submit(stream, url, LONG_TOKENS) for _ in range(LONG)]

        # 3. The short streams end; Serve removes the newest replica while the long ones run.
        # How long Serve takes to decide varies with the machine's load, so a long stream
        # that ends first is replaced: LONG stay open (demand for one replica) until then.
        def removing() -> bool:
            states = ingress_states()
            if states.get("STOPPING", 0) > 0 or sum(states.values()) < 2:
                return True
            long.extend(threads.submit(stream, url, LONG_TOKENS) for _ in range(LONG - sum(not f.done() for f in long)))
            return False

        wait_until(removing, SCALE_WAIT_S, 0.05, message=lambda: f"an ingress replica to be removed: {ingress_states()}")
        t_removing = time.monotonic()
        wait_until(lambda: ingress_states() == {"RUNNING": 1}, SCALE_WAIT_S, POLL_S,
                   message=lambda: f"the ingress to settle at one replica: {ingress_states()}")

        results = [f.result(timeout=SCALE_WAIT_S) for f in short + long]
        for s in results:
            assert s.error is None and s.done and s.finish_reason == "length", s
        assert all(s.text == undisturbed[SHORT_TOKENS].text for s in results[:len(short)])
        assert all(s.text == undisturbed[LONG_TOKENS].text for s in results[len(short):])
        streaming = [s for s in results[len(short):] if s.last_chunk_time > t_removing]
        assert streaming, "no long stream was still running when Serve began removing an ingress replica"
        print(f"\ningress: 2 replicas running at +{t_two - t0:.1f}s; removal began at +{t_removing - t0:.1f}s; "
              f"{len(short)} short streams; {len(streaming)} long streams still running at the removal, "
              f"the last ending at +{max(s.last_chunk_time for s in streaming) - t0:.1f}s")
    finally:
        threads.shutdown(wait=False, cancel_futures=True)
        serve.delete(APP)
