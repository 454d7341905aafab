"""Scale to zero through the real ingress (router/frontend/ingress.py) and the official
clients, on real Ray Serve replicas: the worker is the real WorkerReplica over the real
engine core with a model-free runner (tests/integration/fake_engine_worker.py), its
deployment options from cluster/app.py's `worker_options`, the ingress's settings from
`ingress_settings`, as `kvserve serve` builds them.

  held:    a pool that went to zero replicas gets a request from the `openai` client; it
           is held at the pool's handle (not failed) while Serve starts a replica for it,
           then answered with all its tokens.
  bounded: a pool that cannot start (its replicas ask for a resource no node has) answers
           past `ingress.cold_start_max_wait_s` with 503 + Retry-After (the pool's start-up
           time), in OpenAI's shape and Anthropic's on /v1/messages, and serves on.
No sleeps to synchronise: bounded waits on Serve's status.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ray import serve

from cluster.app import INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT, ingress_options, ingress_settings, worker_options
from cluster.config import KVServeConfig
from router.frontend.ingress import Ingress
from tests.integration.fake_engine_worker import FakeEngineWorker
from tests.integration.slow_start_worker import SlowStartWorker
from tests.integration.test_autoscaling import live, replica_states, with_status
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:.*metrics_interval_s.*:DeprecationWarning"),
]

MODEL = "kv-cold"
PROMPT = [3, 4, 5, 6, 7, 8]  # token ids: no tokenizer work in the way
TOKENS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_served_model import make_served_model

    return make_served_model(tmp_path_factory.mktemp("cold") / "tiny")  # the ingress's tokenizer


def config_of(name: str, model_dir: Path, initial: int, ingress: dict[str, Any]) -> KVServeConfig:
    return KVServeConfig.from_dict({
        "app_name": name,
        "route_prefix": f"/{name}",
        "model": {"path": str(model_dir), "served_model_name": MODEL},
        "engine": {"device": "cpu"},
        "routing": {"router": "pow2"},
        "workers": {
            "num_cpus": 0.1, "num_gpus": 0, "drain_timeout_s": 5.0,
            "autoscaling": {
                "min_replicas": 0, "initial_replicas": initial, "max_replicas": 1, "scale_to_zero": True,
                "upscale_delay_s": 0.0, "downscale_delay_s": 1.0, "look_back_period_s": 1.0,
                "metrics_interval_s": 0.5,
            },
        },
        "ingress": {"num_cpus": 0.1, **ingress},
    })


@pytest.fixture
def deploy(serve_cluster: Any) -> Iterator[Any]:
    names: list[str] = []

    def run(config: KVServeConfig, worker_resources: dict[str, float] | None = None, startup_file: str = "") -> str:
        options = worker_options(config)
        if worker_resources:
            options["ray_actor_options"] = {**options["ray_actor_options"], "resources": worker_resources}
        if startup_file:
            bound = serve.deployment(SlowStartWorker, name=WORKER_DEPLOYMENT).options(**options).bind(startup_file)
        else:
            bound = serve.deployment(FakeEngineWorker, name=WORKER_DEPLOYMENT).options(**options).bind(
                max_num_seqs=4, step_s=0.01, drain_timeout_s=5.0)
        ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(**ingress_options(config))
        serve.run(ingress.bind(bound, ingress_settings(config)),
                  name=config.app_name, route_prefix=config.route_prefix, blocking=False)
        names.append(config.app_name)
        wait_until(lambda: _ingress_running(config.app_name), 120.0, 0.1,
                   message=with_status(f"{config.app_name}'s ingress to start"))
        return f"{serve_cluster.http_url}{config.route_prefix}"

    yield run
    for name in names:
        serve.delete(name)


def _ingress_running(app_name: str) -> bool:
    app = serve.status().applications.get(app_name)
    if app is None or INGRESS_DEPLOYMENT not in app.deployments:
        return False
    return str(getattr(app.deployments[INGRESS_DEPLOYMENT].status, "value", "")) == "HEALTHY"


def complete(client: openai.OpenAI) -> Any:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0)


def test_a_request_to_a_pool_at_zero_is_held_then_answered(deploy: Any, model_dir: Path) -> None:
    root = deploy(config_of("cold-held", model_dir, initial=1, ingress={"cold_start_max_wait_s": 120}))
    client = openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0, timeout=150.0)
    assert complete(client).choices[0].finish_reason == "length"  # the model's facts are known now
    wait_until(lambda: live(replica_states("cold-held")) == 0, 90.0, 0.1,
               message=with_status("the idle pool to go to zero replicas"))
    t0 = time.monotonic()
    answer = complete(client)  # held at the pool's handle while Serve starts a replica
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == TOKENS
    assert time.monotonic() - t0 < 120
    assert live(replica_states("cold-held")) == 1


def test_past_the_bound_a_pool_that_cannot_start_answers_503_with_retry_after(deploy: Any, model_dir: Path) -> None:
    config = config_of("cold-bound", model_dir, initial=0,
                       ingress={"cold_start_max_wait_s": 1.0, "cold_start_retry_after_s": 30})
    root = deploy(config, worker_resources={"kvserve_absent_resource": 1})  # no node has it
    client = openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0, timeout=60.0)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        complete(client)
    waited = time.monotonic() - t0
    assert info.value.status_code == 503 and 1.0 <= waited < 30, waited
    assert info.value.response.headers["retry-after"] == "30"
    assert info.value.body["code"] == "no_worker_replica"  # type: ignore[index]
    anthropic_style = httpx.post(f"{root}/v1/messages", timeout=60.0, json={
        "model": MODEL, "max_tokens": TOKENS, "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic_style.status_code == 503 and anthropic_style.headers["retry-after"] == "30"
    assert anthropic_style.json()["type"] == "error"
    assert anthropic_style.json()["error"]["type"] == "overloaded_error"
    # The ingress serves on: it answers what needs no worker, and each request is bounded again.
    assert httpx.get(f"{root}/metrics", timeout=30.0).status_code == 200
    with pytest.raises(openai.APIStatusError) as again:
        complete(client)
    assert again.value.status_code == 503


def test_a_start_up_slower_than_the_bound_is_a_503_then_the_retry_is_answered(
        deploy: Any, model_dir: Path, tmp_path: Path) -> None:
    startup_file = tmp_path / "startup_s"
    config = config_of("cold-slow", model_dir, initial=1,
                       ingress={"cold_start_max_wait_s": 1.0, "cold_start_retry_after_s": 4})
    root = deploy(config, startup_file=str(startup_file))
    no_retries = openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0, timeout=60.0)
    assert complete(no_retries).choices[0].finish_reason == "length"
    startup_file.write_text("3.0")  # replicas started from now on take 3 s, past the 1 s bound
    wait_until(lambda: live(replica_states("cold-slow")) == 0, 90.0, 0.1,
               message=with_status("the idle pool to go to zero replicas"))
    with pytest.raises(openai.APIStatusError) as info:
        complete(no_retries)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "4"
    # The held request was demand: the pool is coming back. The client's own retries, after
    # Retry-After, find it.
    wait_until(lambda: live(replica_states("cold-slow")) == 1, 60.0, 0.1,
               message=with_status("the pool to start a replica for the refused request"))
    retrying = openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=3, timeout=60.0)
    assert complete(retrying).usage.completion_tokens == TOKENS
    rejected = httpx.get(f"{root}/metrics", timeout=30.0).text
    assert 'reason="cold_start_timeout"' in rejected
