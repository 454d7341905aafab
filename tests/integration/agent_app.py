"""The whole kvserve app on the embedded kvserve-tiny model (a chat template that renders
tools) with two API keys: the app the agent API tests (/v1/responses, /v1/messages) share."""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MODEL = "kvserve-tiny"
KEY_ALPHA = "kvs-test-key-agents-a41c07"
KEY_BETA = "kvs-test-key-agents-b9e2d5"
# Hashes only: the variable travels in a Ray runtime_env, which Ray's agent logs.
ENV = {"KVSERVE_AGENT_TEST_KEYS": ",".join(f"sha256:{hashlib.sha256(k.encode()).hexdigest()}" for k in (KEY_ALPHA, KEY_BETA))}


@contextmanager
def agent_app(serve_cluster: Any, app_name: str) -> Iterator[str]:
    """Deploys the app; yields its OpenAI base URL (…/v1); deletes it after."""
    from ray import serve

    from cluster.config import KVServeConfig
    from tests.integration.tiny_app import deploy
    from worker.default_model import default_model_path

    config = KVServeConfig.from_dict({
        "app_name": app_name,
        "route_prefix": f"/{app_name}",
        "model": {"path": str(default_model_path()), "served_model_name": MODEL},
        "engine": {"block_size": 16, "num_blocks": 256, "max_model_len": 2048, "max_num_seqs": 16,
                   "device": "cpu", "dtype": "float32", "num_threads": 1},
        "workers": {"num_replicas": 1, "num_cpus": 1, "stream_interval_ms": 0},
        "ingress": {"num_cpus": 0.5, "request_timeout_s": 300, "api_keys_env": "KVSERVE_AGENT_TEST_KEYS"},
    })
    deploy(config, ingress_env=ENV)
    try:
        yield f"{serve_cluster.http_url}/{app_name}/v1"
    finally:
        serve.delete(app_name)
