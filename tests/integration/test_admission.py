"""Admission control through real Serve (router/routing/admission.py): with a simulated-device
worker busy (its one running slot taken) and its queue bound reached
(admission_max_waiting_per_replica 0), further
requests are held at the ingress, one more than the hold queue is answered 429 with
Retry-After, and the held ones are served once the busy request ends. /metrics shows the
hold queue, the admission decisions and the router's own counters."""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration

APP_NAME = "admission-test"
MODEL = "sim-admission"


@pytest.fixture(scope="module")
def base_url(serve_cluster: Any) -> Iterator[str]:
    from ray import serve

    from cluster.app import build_app
    from cluster.config import KVServeConfig

    config = KVServeConfig.from_dict({
        "app_name": APP_NAME,
        "route_prefix": f"/{APP_NAME}",
        "model": {"served_model_name": MODEL},
        # Dilated: a decode step takes a few hundred ms, so the busy request stays busy.
        # One sequence at a time: the busy request fills the replica's only running slot.
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "max_model_len": 4096, "time_dilation": 50.0,
                   "max_num_seqs": 1},
        "workers": {"num_replicas": 1, "num_cpus": 0.5},
        "ingress": {"num_cpus": 0.5, "api_keys_env": None, "admission_queue_size": 2,
                    "admission_max_waiting_per_replica": 0, "admission_max_wait_s": 120.0},
        "routing": {"stats_period_s": 0.5},
    })
    serve.run(build_app(config), name=APP_NAME, route_prefix=config.route_prefix)
    try:
        yield f"{serve_cluster.http_url}/{APP_NAME}"
    finally:
        serve.delete(APP_NAME)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of `name` whose labels include `labels`."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}") + 1]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def wait_for(client: httpx.AsyncClient, url: str, condition: Any, timeout_s: float = 60.0) -> str:
    """Poll /metrics until `condition(text)` holds (a bounded wait on an observable state)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await client.get(url)).text
        if condition(text):
            return text
        if time.monotonic() > deadline:
            shown = "\n".join(line for line in text.splitlines() if line.startswith(("kvserve:admission", "kvserve:ingress_queue_length", "kvserve:ingress_queue_time_seconds_count", "kvserve:router_", "kvserve:requests_rejected")))
            raise AssertionError(f"condition not met within {timeout_s} s; last /metrics (admission, router):\n{shown}")
        await asyncio.sleep(0.2)  # polling interval, not synchronisation


def completion(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": max_tokens, "stream": stream}


async def test_requests_are_held_then_shed_then_served(base_url: str) -> None:
    completions, metrics_url = f"{base_url}/v1/completions", f"{base_url}/metrics"
    async with httpx.AsyncClient(timeout=120.0) as client:
        assert (await client.post(completions, json=completion(1))).status_code == 200  # the router exists now
        # Until the router holds a fresh report, admission never holds (stale stats): wait for one.
        await wait_for(client, metrics_url, lambda t: (age := metric(t, "kvserve:router_stats_age_seconds")) is not None and age < 1.0)

        async with client.stream("POST", completions, json=completion(200, stream=True)) as busy:
            assert busy.status_code == 200
            lines = busy.aiter_lines()  # kept: a dropped line iterator would close the stream
            await lines.__anext__()  # its first chunk: it is in flight
            held = [asyncio.create_task(client.post(completions, json=completion(2))) for _ in range(2)]
            await wait_for(client, metrics_url, lambda t: metric(t, "kvserve:ingress_queue_length") == 2.0)
            shed = await client.post(completions, json=completion(2))
            assert shed.status_code == 429 and int(shed.headers["retry-after"]) >= 1
            assert shed.json()["error"]["code"] == "server_overloaded"
            assert not any(task.done() for task in held)
        # The busy stream is closed: the held requests go, one at a time, and finish.
        results = await asyncio.gather(*held)
        assert [r.status_code for r in results] == [200, 200]
        assert all(r.json()["usage"]["completion_tokens"] == 2 for r in results)

        text = (await client.get(metrics_url)).text
        assert metric(text, "kvserve:ingress_queue_length") == 0.0
        assert metric(text, "kvserve:requests_rejected_total", reason="admission_queue_full") == 1.0
        assert metric(text, "kvserve:ingress_queue_time_seconds_count") == 4.0  # the warm-up, busy and held ones
        assert metric(text, "kvserve:router_decisions_total", mode="headroom") is not None
        assert metric(text, "kvserve:router_requests_outstanding") is not None
