"""The whole kvserve app on the embedded kvserve-tiny model (its own tokenizer and a
chat template that renders tools), with room for a few dozen concurrent requests: the
app the structured-output and tool-calling tests share."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MODEL = "kvserve-tiny"


@contextmanager
def structured_app(serve_cluster: Any, app_name: str) -> Iterator[str]:
    """Deploys the app; yields its OpenAI base URL; deletes it after."""
    from ray import serve

    from cluster.app import build_app
    from cluster.config import KVServeConfig
    from worker.default_model import default_model_path

    config = KVServeConfig.from_dict(
        {
            "app_name": app_name,
            "route_prefix": f"/{app_name}",
            "model": {"path": str(default_model_path()), "served_model_name": MODEL},
            "engine": {
                "block_size": 16, "num_blocks": 512, "max_model_len": 2048, "max_num_seqs": 48,
                "device": "cpu", "dtype": "float32", "num_threads": 1,
            },
            # Outputs per step (no pacing): the streaming tests see tokens as they come.
            "workers": {"num_replicas": 1, "num_cpus": 1, "stream_interval_ms": 0},
            "ingress": {"num_cpus": 0.5, "request_timeout_s": 300, "api_keys_env": None, "max_queued_requests": 256},
            "routing": {"stats_period_s": 0.5},
        }
    )
    serve.run(build_app(config), name=app_name, route_prefix=f"/{app_name}")
    try:
        yield f"{serve_cluster.http_url}/{app_name}/v1"
    finally:
        serve.delete(app_name)
