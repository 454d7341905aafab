"""Tensor parallelism through real Serve deployments on CPU (gloo): a worker replica with
tensor_parallel_size=2 is a Serve replica holding a STRICT_PACK placement group of two
bundles, rank 0 in the replica and rank 1 in a child actor in bundle 1.

- A TP=2 app answers greedy completions exactly as a TP=1 app does (streams included).
- Disaggregated pools that are themselves TP=2 (prefill exports all KV heads gathered
  from both ranks; decode scatters them back over its ranks) answer the same.
- Killing rank 1's actor: the replica reports itself unhealthy (the router stops
  choosing it), requests fail with a clear tensor-parallel error instead of hanging, Serve
  replaces the replica, and the new one answers token-identically again.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.tiny_app import stream_text, tiny_config, wait_for

import httpx

TP1, TP2, TP_PD, MODEL = "tp-one", "tp-two", "tp-pd", "tiny-tp"
PROMPTS = [
    "Hello world! The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks. A serving cluster routes",
    "Once upon a time there was a tiny model that told short stories about cats and dogs.",
]
# A rank is half a logical CPU; a broken replica is found by Serve's health check quickly.
TP_POOL = {"num_replicas": 1, "num_cpus": 0.5, "tensor_parallel_size": 2,
           "health_check_period_s": 1.0, "health_check_timeout_s": 10.0}


@pytest.fixture(scope="module")
def apps(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from cluster.app import build_app
    from tests.support.tiny_served_model import make_served_model

    model_dir = make_served_model(tmp_path_factory.mktemp("served-tp") / "tiny")
    one = tiny_config(TP1, model_dir, MODEL)
    two = tiny_config(TP2, model_dir, MODEL).with_overrides({"workers": TP_POOL})
    pd = tiny_config(TP_PD, model_dir, MODEL).with_overrides(
        {"disaggregation": {"prefill": TP_POOL, "decode": TP_POOL, "max_waiting_for_decode": 64}}
    )
    for config in (one, two, pd):
        serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix)
    try:
        yield serve_cluster.http_url
    finally:
        for name in (TP_PD, TP2, TP1):
            serve.delete(name)


def _complete(base: str, app: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/{app}/v1/completions", json=body, timeout=120)


def _text(base: str, app: str, prompt: str) -> str:
    r = _complete(base, app, prompt)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _stream_text(base: str, app: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return stream_text(f"{base}/{app}/v1/completions", body)[0]


def test_tp2_replica_answers_as_tp1(apps: str) -> None:
    for prompt in PROMPTS:
        expected = _text(apps, TP1, prompt)
        assert _text(apps, TP2, prompt) == expected, prompt
        assert _stream_text(apps, TP2, prompt) == expected, prompt


def test_tp2_disaggregated_pools_answer_as_tp1(apps: str) -> None:
    for prompt in PROMPTS:
        assert _text(apps, TP_PD, prompt) == _text(apps, TP1, prompt), prompt
    _no_pinned_blocks_left(TP_PD)


def _no_pinned_blocks_left(app_name: str) -> None:
    from ray import serve

    def drained() -> bool:
        stats = serve.get_deployment_handle("prefill", app_name).stats.remote().result(timeout_s=30)
        return stats["free_blocks"] == stats["total_blocks"]

    wait_for(drained, "the prefill pool to free every exported block", timeout_s=60)


def _rank_actor(app_name: str) -> tuple[Any, str]:
    """(handle of the TP rank-1 actor, replica id) of the app's one worker replica; the
    rank actor is named after its replica's actor (worker/tp/runner.py:rank_actor_name)."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    replicas = [a for a in named if a["name"].startswith(f"SERVE_REPLICA::{app_name}#worker#")]
    assert len(replicas) == 1, replicas
    replica = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
    rank_name = f"kvserve-tp-rank1-{replica._actor_id.hex()}"
    ranks = [a for a in named if a["name"] == rank_name]
    assert len(ranks) == 1, (rank_name, named)
    return ray.get_actor(rank_name, namespace=ranks[0]["namespace"]), replicas[0]["name"].rsplit("#", 1)[1]


def _worker_replica_id(app_name: str) -> str:
    from ray import serve

    return str(serve.get_deployment_handle("worker", app_name).stats.remote().result(timeout_s=30)["replica_id"])


def test_dead_rank_fails_clearly_and_serve_replaces_the_replica(apps: str) -> None:
    expected = _text(apps, TP1, PROMPTS[0])
    import ray

    rank, replica_id = _rank_actor(TP2)
    ray.kill(rank, no_restart=True)

    # The first request after the kill meets the broken group and fails with a message
    # that names the cause; or, if the replica's "unhealthy" report reached the router
    # first, it is held back until the replacement serves it. It never hangs.
    r = _complete(apps, TP2, PROMPTS[0])
    if r.status_code == 200:
        assert _worker_replica_id(TP2) != replica_id
    else:
        assert r.status_code in (500, 503), r.text
        assert "tensor-parallel" in r.json()["error"]["message"], r.text
    wait_for(lambda: _worker_replica_id(TP2) != replica_id, "Serve to replace the replica whose rank died",
             timeout_s=120)
    assert _text(apps, TP2, PROMPTS[0]) == expected
