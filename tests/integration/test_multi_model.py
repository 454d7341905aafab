"""Two models on one cluster behind one ingress (cluster/models_config.py, router/frontend/models/):
two tiny checkpoints with different weights and engine settings, each in its own worker
pool, each answering through the official `openai` client with transformers' own greedy
text; a key limited to one model is told the other does not exist (404 model_not_found,
in Anthropic's shape on /v1/messages, NOT_FOUND over gRPC, which routes by its `model` too);
/v1/models lists both; `kvserve status` and /metrics show each model's own pool."""
from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration import tiny_app

pytestmark = pytest.mark.integration

APP = "multi-model"
KEY_ALL, KEY_CHAT = "kvs-mm-key-all-2b61", "kvs-mm-key-chat-91c0"
ENV = {"KVSERVE_TEST_API_KEYS": ",".join(f"sha256:{hashlib.sha256(k.encode()).hexdigest()}" for k in (KEY_ALL, KEY_CHAT))}
CHAT_KEY_ID = hashlib.sha256(KEY_CHAT.encode()).hexdigest()[:12]
PROMPT, MAX_TOKENS = "Paged attention stores keys", 6
Served = tuple[str, dict[str, str], str]  # HTTP root, each model's greedy text, gRPC target


def config(chat_dir: Path, coder_dir: Path) -> Any:
    from cluster.config import KVServeConfig

    return KVServeConfig.from_dict({
        "app_name": APP, "route_prefix": f"/{APP}",
        "engine": {"block_size": tiny_app.BLOCK_SIZE, "num_blocks": tiny_app.NUM_BLOCKS, "max_model_len": 1024,
                   "max_num_seqs": 16, "device": "cpu", "dtype": "float32", "num_threads": 1},
        "workers": {"num_replicas": 1, "num_cpus": 1},
        "models": [
            {"name": "chat", "path": str(chat_dir)},
            # Its own engine settings: a smaller pool and batch than the top-level engine's.
            {"name": "org/coder", "path": str(coder_dir), "engine": {"num_blocks": 24, "max_num_seqs": 4}},
        ],
        "ingress": {"num_cpus": 0.5, "request_timeout_s": 120, "api_keys_env": "KVSERVE_TEST_API_KEYS",
                    "key_models": {CHAT_KEY_ID: ["chat"]}},
        "routing": {"stats_period_s": 0.5},
    })


def expected_text(model_dir: Path) -> str:
    from transformers import AutoTokenizer

    from tests.support.tiny_models import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(PROMPT).input_ids
    [ids] = hf_greedy(model_dir, [prompt], [MAX_TOKENS])
    return tokenizer.decode(ids[len(prompt):] if ids[:len(prompt)] == prompt else ids)


@pytest.fixture(scope="module")
def served(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """(the app's HTTP root, each model's greedy text for PROMPT by transformers)."""
    from ray import serve

    from tests.support.tiny_models import make_tiny_model
    from tests.support.tiny_served_model import make_served_model

    root = tmp_path_factory.mktemp("multi-model")
    chat_dir = make_served_model(root / "chat")
    coder_dir = make_served_model(root / "coder", weights=lambda out, vocab: make_tiny_model("llama", out, vocab, seed=1))
    expected = {"chat": expected_text(chat_dir), "org/coder": expected_text(coder_dir)}
    tiny_app.deploy(config(chat_dir, coder_dir), ingress_env=ENV)
    try:
        yield f"{serve_cluster.http_url}/{APP}", expected, f"127.0.0.1:{serve_cluster.grpc_port}"
    finally:
        serve.delete(APP)


def test_each_model_answers_with_its_own_greedy_text(served: Served) -> None:
    import openai

    root, expected, _ = served
    assert expected["chat"] != expected["org/coder"]  # two models, told apart by their output
    with openai.OpenAI(base_url=f"{root}/v1", api_key=KEY_ALL, max_retries=0) as client:
        for model, text in expected.items():
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
            assert (out.model, out.choices[0].text) == (model, text)
        assert [m.id for m in client.models.list().data] == ["chat", "org/coder"]
        with pytest.raises(openai.NotFoundError) as unknown:
            client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
        assert unknown.value.code == "model_not_found"


def test_a_key_limited_to_one_model_is_refused_the_other(served: Served) -> None:
    import openai

    root, expected, _ = served
    with openai.OpenAI(base_url=f"{root}/v1", api_key=KEY_CHAT, max_retries=0) as client:
        out = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert out.model == "chat"
        with pytest.raises(openai.NotFoundError) as refused:
            client.completions.create(model="org/coder", prompt=PROMPT, max_tokens=1)
        assert refused.value.code == "model_not_found" and "org/coder" not in refused.value.message.split("Known:")[1]
        assert [m.id for m in client.models.list().data] == ["chat"]
    headers = {"x-api-key": KEY_CHAT, "anthropic-version": "2023-06-01"}
    r = httpx.post(f"{root}/v1/messages", headers=headers, timeout=60,
                   json={"model": "org/coder", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{root}/v1/responses", headers={"authorization": f"Bearer {KEY_CHAT}"}, timeout=60,
                   json={"model": "org/coder", "input": "hi", "max_output_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_status_and_metrics_are_per_model(served: Served) -> None:
    import ray

    from cluster.status import gather

    root, _, _ = served
    auth = {"authorization": f"Bearer {KEY_ALL}"}
    for model in ("chat", "org/coder"):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(f"{root}/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
    pools = {p.name: p for p in gather(ray.get_runtime_context().gcs_address, APP).pools}
    assert {name: (p.role, p.model) for name, p in pools.items() if name != "ingress"} == {
        "worker-chat": ("worker", "chat"), "worker-org-coder": ("worker", "org-coder")}
    assert (pools["worker-chat"].kv_total_blocks, pools["worker-org-coder"].kv_total_blocks) == (tiny_app.NUM_BLOCKS, 24)
    text = httpx.get(f"{root}/metrics", headers=auth, timeout=30).text
    assert text.count("# TYPE kvserve:e2e_request_latency_seconds histogram") == 1  # one family, both models
    for model in ("chat", "org/coder"):  # the tokens each model generated above, under its own label
        assert re.search(rf'^kvserve:generation_tokens_total{{[^}}]*model_name="{model}"[^}}]*}} [1-9]', text, re.M), model


def test_grpc_routes_by_the_request_model_with_the_same_key_limits(served: Served) -> None:
    import grpc

    from router.frontend.grpc_api.client import KVServeClient, KVServeError
    from tests.support.waiting import wait_until

    _, expected, target = served
    with KVServeClient(target, api_key=KEY_ALL, application=APP, timeout=60) as client:
        # The proxy learns of a new application asynchronously (as in test_grpc_api.py).
        wait_until(lambda: _listed(client) == ["chat", "org/coder"], 60, message="the gRPC proxy to route here")
        out = client.generate(PROMPT, model="org/coder", max_tokens=MAX_TOKENS, temperature=0.0)
        assert (out.model, out.text) == ("org/coder", expected["org/coder"])
    with KVServeClient(target, api_key=KEY_CHAT, application=APP, timeout=60) as client:
        assert _listed(client) == ["chat"]
        with pytest.raises(KVServeError) as refused:
            client.generate(PROMPT, model="org/coder", max_tokens=1)
        assert refused.value.code == grpc.StatusCode.NOT_FOUND


def _listed(client: Any) -> list[str] | None:
    import grpc

    from router.frontend.grpc_api.client import KVServeError

    try:
        return [m.id for m in client.list_models()]
    except (grpc.RpcError, KVServeError):
        return None
