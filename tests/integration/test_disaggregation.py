"""Prefill/decode disaggregation end to end: an app with a prefill pool and a decode pool
(one replica each, tiny model) answers OpenAI completions exactly as the mixed app does
(greedy), streams included; a request of a LoRA adapter prefills and decodes under it,
token for token as transformers + peft; afterwards the prefill replica holds no pinned
block."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.tiny_app import stream_text, tiny_config, wait_for

import httpx

MIXED, DISAGG, MODEL = "pd-mixed", "pd-disagg", "tiny-pd"
PROMPTS = [
    "Hello world! The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks. A serving cluster routes",
    "Once upon a time there was a tiny model that told short stories about cats and dogs. What is the capital",
    "Hi",
]


# Adapters the disaggregated app serves: name -> (rank, targets).
ADAPTERS = {"sql": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
            "math": (4, ("q_proj", "v_proj"))}


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    from tests.support.tiny_lora import make_tiny_adapter
    from tests.support.tiny_served_model import make_served_model

    root = tmp_path_factory.mktemp("served-pd")
    model_dir = make_served_model(root / "tiny")
    return model_dir, {name: make_tiny_adapter(model_dir, root / name, rank, targets, seed=k)
                       for k, (name, (rank, targets)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def apps(serve_cluster: Any, model_and_adapters: tuple[Path, dict[str, Path]]) -> Iterator[str]:
    from ray import serve

    from cluster.app import build_app

    model_dir, adapters = model_and_adapters
    mixed = tiny_config(MIXED, model_dir, MODEL)
    pool = {"num_replicas": 1, "num_cpus": 1}
    disagg = tiny_config(DISAGG, model_dir, MODEL).with_overrides(
        {"disaggregation": {"prefill": pool, "decode": pool, "max_waiting_for_decode": 64},
         "lora": {"modules": {name: str(path) for name, path in adapters.items()}, "max_loras": 2}}
    )
    serve.run(build_app(mixed), name=MIXED, route_prefix=f"/{MIXED}")
    serve.run(build_app(disagg), name=DISAGG, route_prefix=f"/{DISAGG}")
    try:
        yield serve_cluster.http_url
    finally:
        serve.delete(DISAGG)
        serve.delete(MIXED)


def _complete(base: str, app: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{base}/{app}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(base: str, app: str, body: dict[str, Any]) -> tuple[str, int]:
    return stream_text(f"{base}/{app}/v1/completions", {"model": MODEL, "temperature": 0, **body})


def test_disaggregated_completions_equal_the_mixed_pool(apps: str) -> None:
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True}
        mixed, disagg = _complete(apps, MIXED, body), _complete(apps, DISAGG, body)
        assert disagg["choices"][0]["text"] == mixed["choices"][0]["text"], prompt
        assert disagg["usage"] == mixed["usage"]
    # n > 1 and a one-token request (which never reaches the decode pool)
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "n": 2}
    assert [c["text"] for c in _complete(apps, DISAGG, body)["choices"]] == [
        c["text"] for c in _complete(apps, MIXED, body)["choices"]
    ]
    one = {"prompt": PROMPTS[0], "max_tokens": 1}
    assert _complete(apps, DISAGG, one)["choices"][0]["text"] == _complete(apps, MIXED, one)["choices"][0]["text"]


def test_streamed_first_token_then_decode(apps: str) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 10, "ignore_eos": True}
    text, chunks = _stream_text(apps, DISAGG, body)
    assert text == _complete(apps, MIXED, body)["choices"][0]["text"]
    assert chunks >= 2  # the prefill's token, then the decode replica's


def test_adapter_requests_prefill_and_decode_under_their_adapter(
    apps: str, model_and_adapters: tuple[Path, dict[str, Path]]
) -> None:
    """Both pools load the adapter; the KV moves under the adapter's hash root (a decode
    engine refuses KV of another root); greedy tokens equal transformers + peft's."""
    from ray import serve

    from protos.kvserve.v1 import kvserve_pb2 as pb
    from tests.support.tiny_lora import peft_greedy

    model_dir, adapters = model_and_adapters
    ingress = serve.get_deployment_handle("ingress", DISAGG)
    prompts = [[(7 * i + k) % 400 + 3 for i in range(n)] for k, n in ((1, 40), (2, 9))]
    base = peft_greedy(model_dir, None, prompts, [10, 10])
    for name in [*ADAPTERS, None]:
        expected = peft_greedy(model_dir, adapters[name], prompts, [10, 10]) if name else base
        assert name is None or expected != base, f"adapter {name} does not change outputs: a vacuous test"
        for prompt, want in zip(prompts, expected):
            request = pb.GenerateRequest(model=name or MODEL, prompt_token_ids=prompt, max_tokens=10,
                                         temperature=0, ignore_eos=True)
            got = ingress.Generate.remote(request).result(timeout_s=120)
            assert list(got.token_ids) == want, name
    for pool in ("prefill", "decode"):
        stats = serve.get_deployment_handle(pool, DISAGG).record_routing_stats.remote().result(timeout_s=30)
        assert set(stats["lora_loaded"]) == set(ADAPTERS), pool


def test_no_blocks_left_on_either_pool(apps: str) -> None:
    from ray import serve

    def free(pool: str) -> bool:
        stats = serve.get_deployment_handle(pool, DISAGG).stats.remote().result(timeout_s=30)
        return stats["free_blocks"] == stats["total_blocks"] and not stats["num_running"]

    wait_for(lambda: free("prefill"), "the prefill replica to unpin every exported block", 40)
    wait_for(lambda: free("decode"), "the decode replica to free every block", 40)


def test_prefill_pool_is_visible(apps: str) -> None:
    """/metrics, /health and gRPC Stats show the prefill pool next to the decode pool."""
    from ray import serve

    from protos.kvserve.v1 import kvserve_pb2 as pb

    text = httpx.get(f"{apps}/{DISAGG}/metrics", timeout=60).text
    pools = {line.split('pool="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("kvserve:kv_cache_total_blocks{")}
    assert pools == {"prefill", "decode"}, text
    assert httpx.get(f"{apps}/{DISAGG}/health", timeout=60).status_code == 200
    stats = serve.get_deployment_handle("ingress", DISAGG).Stats.remote(pb.StatsRequest()).result(timeout_s=60)
    assert sorted(r.pool for r in stats.replicas) == ["decode", "prefill"]
    assert stats.total_blocks == sum(r.total_blocks for r in stats.replicas) > 0
