"""The soak in CI: benchmarks.soak.run_soak for about half a minute on the session cluster
(one worker replica of a tiny real model): mixed streaming / non-streaming / chat load
with client disconnects and aborts; then no leaked KV block, flat worker RSS, no
unexplained error."""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.soak import run_soak

pytestmark = pytest.mark.integration

APP_NAME = "soak-test"
ROUTE_PREFIX = "/soak-test"
MODEL = "kv-tiny-soak"
MINUTES = float(os.environ.get("KVSERVE_SOAK_MINUTES", "0.5"))


@pytest.fixture(scope="module")
def root(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from cluster.app import build_app
    from cluster.config import KVServeConfig
    from tests.support.tiny_served_model import make_served_model

    model_dir = make_served_model(tmp_path_factory.mktemp("soak") / "tiny")
    config = KVServeConfig.from_dict(
        {
            "app_name": APP_NAME,
            "route_prefix": ROUTE_PREFIX,
            "model": {"path": str(model_dir), "served_model_name": MODEL},
            "engine": {"block_size": 16, "num_blocks": 64, "max_model_len": 1024, "max_num_seqs": 16,
                       "device": "cpu", "dtype": "float32", "num_threads": 1},
            "workers": {"num_replicas": 1, "num_cpus": 1},
            "ingress": {"max_queued_requests": 8, "num_cpus": 0.5},
        }
    )
    serve.run(build_app(config), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    try:
        yield f"{serve_cluster.http_url}{ROUTE_PREFIX}"
    finally:
        serve.delete(APP_NAME)


def test_short_soak(root: str) -> None:
    result = run_soak(root, MODEL, APP_NAME, MINUTES, concurrency=6)
    print(result.line())
    assert result.requests > 0 and result.load.ok > 0
    assert result.errors == 0, result.load.error_samples
    assert result.leaked_blocks == 0
    assert result.rss_growth_mb < 64.0
