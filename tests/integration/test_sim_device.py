"""A Serve cluster of simulated-device replicas (engine.device: sim:h200, the llama-3-8b
shape) behind the real ingress and router: the app builder's own path, no weights, the
embedded model's tokenizer for text. Completions and streams work, every replica sizes
its KV pool from the H200's memory, and the same request streams the same tokens twice
(whichever replica serves it)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.integration.tiny_app import stream_text

pytestmark = pytest.mark.integration

APP_NAME = "sim-device-test"
MODEL = "sim-llama-3-8b"
H200_LLAMA3_8B_BLOCKS = 52_852  # (0.9 * 141 GB - 16.06 GB of weights) / (16 tokens * 128 KiB)


@contextmanager
def sim_app(serve_cluster: Any, name: str, engine: dict[str, Any], workers: dict[str, Any],
            **sections: Any) -> Iterator[str]:
    """An app of simulated H200 replicas (the llama-3-8b shape) as the app builder deploys
    it; its OpenAI base URL while the block runs."""
    from ray import serve

    from cluster.app import build_app
    from cluster.config import KVServeConfig

    config = KVServeConfig.from_dict({
        "app_name": name,
        "route_prefix": f"/{name}",
        "model": {"served_model_name": MODEL},  # the embedded model's directory: its tokenizer only
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "max_model_len": 4096, **engine},
        "workers": {"num_cpus": 0.5, **workers},
        "ingress": {"num_cpus": 0.5, "api_keys_env": None},
        **sections,
    })
    serve.run(build_app(config), name=name, route_prefix=config.route_prefix)
    try:
        yield f"{serve_cluster.http_url}/{name}/v1"
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def url(serve_cluster: Any) -> Iterator[str]:
    with sim_app(serve_cluster, APP_NAME, {}, {"num_replicas": 2}, routing={"stats_period_s": 0.5}) as base:
        yield base


def test_completion_runs_to_max_tokens_on_simulated_h200s(url: str) -> None:
    r = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 24}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"  # a simulated model never samples EOS
    assert body["usage"]["completion_tokens"] == 24 and body["choices"][0]["text"]
    models = httpx.get(f"{url}/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == 4096


def test_every_replica_sizes_its_kv_pool_from_the_device(url: str) -> None:
    from ray import serve

    handle = serve.get_deployment_handle("worker", APP_NAME)
    stats = handle.broadcast("stats").results(timeout_s=30)
    assert len(stats) == 2
    assert [s["total_blocks"] for s in stats] == [H200_LLAMA3_8B_BLOCKS] * 2


def test_the_same_request_streams_the_same_tokens_twice(url: str) -> None:
    body = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 16, "temperature": 1.0}
    first, chunks = stream_text(f"{url}/completions", body)
    second, _ = stream_text(f"{url}/completions", body)
    assert first == second and first
    assert chunks >= 1
    whole = httpx.post(f"{url}/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["text"] == first


def test_sessions_named_by_header_or_user_reach_the_router(url: str) -> None:
    """The official client names a session with the `x-session-id` header or the `user`
    field: each new session is spread by the ingress's router (mode "spread"), and its
    next turn follows it to its replica (mode "affinity", the session's soft preference)."""
    import openai

    from tests.integration.test_admission import metric
    from tests.support.waiting import wait_until

    metrics_url = url.removesuffix("/v1") + "/metrics"

    def decisions() -> dict[str, float]:
        text = httpx.get(metrics_url, timeout=30).text
        return {m: metric(text, "kvserve:router_decisions_total", mode=m) or 0.0 for m in ("spread", "affinity")}

    def fresh() -> bool:  # a report younger than the staleness bound (3 periods of 0.5 s)
        age = metric(httpx.get(metrics_url, timeout=30).text, "kvserve:router_stats_age_seconds")
        return age is not None and age < 1.0

    def turn(client: Any, session: int, history: list[dict[str, str]]) -> None:
        named = {"extra_headers": {"x-session-id": f"s-{session}"}} if session % 2 else {"user": f"user-{session}"}
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2, **named)
        history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})

    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
        client.completions.create(model=MODEL, prompt="warm", max_tokens=1)  # the router exists now
        wait_until(fresh, 30.0, 0.1, message="a fresh routing report")
        histories = {s: [{"role": "user", "content": f"Session {s} asks about the sea, at some length. " * 8}]
                     for s in range(4)}
        before = decisions()
        for s, history in histories.items():
            turn(client, s, history)
        first = decisions()
        for s, history in histories.items():
            history.append({"role": "user", "content": "And then?"})
            turn(client, s, history)
        second = decisions()
    assert first["spread"] - before["spread"] == 4  # a stale report would have made one pow2
    assert second["affinity"] - first["affinity"] == 4 and second["spread"] == first["spread"]


FULL_APP = "sim-device-full"
FULL_SLOTS = 8
FULL_TOKENS = 32


@pytest.fixture(scope="module")
def full_url(serve_cluster: Any) -> Iterator[str]:
    """One replica whose Serve request slots equal its engine's running slots."""
    with sim_app(serve_cluster, FULL_APP, {"max_num_seqs": FULL_SLOTS},
                 {"num_replicas": 1, "max_ongoing_requests": FULL_SLOTS}) as base:
        yield base


def test_a_full_replica_runs_its_whole_burst_in_one_batch(full_url: str) -> None:
    """max_ongoing_requests engine requests at once all run together: the ingress's output
    stream to the replica does not take one of their slots (cluster/app.py
    worker_options), which would leave one request waiting at the router until the others
    finished, and the burst taking twice the steps."""
    import asyncio

    from ray import serve

    handle = serve.get_deployment_handle("worker", FULL_APP)

    def num_steps() -> int:
        return sum(int(s["num_steps"]) for s in handle.broadcast("stats").results(timeout_s=30))

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            answers = await asyncio.gather(*(
                client.post(f"{full_url}/completions", json={"model": MODEL, "prompt": f"burst {i}",
                                                               "max_tokens": FULL_TOKENS})
                for i in range(FULL_SLOTS)))
        return [a.status_code for a in answers]

    warm = httpx.post(f"{full_url}/completions", json={"model": MODEL, "prompt": "warm", "max_tokens": 2}, timeout=60)
    assert warm.status_code == 200  # the ingress's output stream to the replica is open
    before = num_steps()
    assert asyncio.run(burst()) == [200] * FULL_SLOTS
    steps = num_steps() - before
    # Together: one prefill step plus FULL_TOKENS - 1 decode steps, a few more while the
    # burst arrives; a straggler alone afterwards would add FULL_TOKENS - 1 more.
    assert steps < FULL_TOKENS * 3 // 2, steps
