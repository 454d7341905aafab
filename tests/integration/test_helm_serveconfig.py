"""The Helm chart's serveConfigV2, deployed for real: render the chart (real Helm engine)
with values for a CPU-only local cluster, take applications[0] from the rendered
serveConfigV2 exactly as KubeRay would hand it to Serve (import_path + args), build it with
cluster.app:app_builder and answer an OpenAI request through the Serve proxy, plus the
/metrics path the chart's ServiceMonitor scrapes.

Needs the Helm tool venv (`bash scripts/helm_tools.sh`); skips without it.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.helm.chart import render_job, require_helm, run_jobs

pytestmark = pytest.mark.integration

APP_NAME = "helm-serveconfig-test"
ROUTE_PREFIX = "/helm-serveconfig-test"
MODEL = "kv-tiny-helm"


def chart_values(model_dir: str) -> dict[str, Any]:
    """Chart values for a CPU-only cluster: the model on a hostPath, no GPUs per replica."""
    return {
        # The local Ray cluster has no key Secret; the serve config is what is tested here.
        "apiKeys": {"required": False, "existingSecret": ""},
        "modelSource": {"type": "hostPath", "mountPath": model_dir, "hostPath": {"path": model_dir}},
        "pools": [{"name": "cpu", "role": "mixed", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                   "gpusPerPod": 1}],
        "kvserve": {
            "app_name": APP_NAME,
            "route_prefix": ROUTE_PREFIX,
            "model": {"path": model_dir, "served_model_name": MODEL},
            "engine": {"device": "cpu", "dtype": "float32", "block_size": 16, "num_blocks": 32,
                       "max_model_len": 1024, "max_num_seqs": 8, "num_threads": 1},
            "workers": {"num_gpus": 0, "num_cpus": 1,
                        # Serve's controller imports and runs the chart's default policy.
                        "autoscaling": {"min_replicas": 1, "max_replicas": 1, "upscale_delay_s": 1,
                                        "downscale_delay_s": 1}},
            "ingress": {"num_cpus": 0.5, "max_queued_requests": 8},
            "routing": {"stats_period_s": 0.5},
        },
    }


@pytest.fixture(scope="module")
def deployed(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_helm()
    from ray import serve

    from tests.support.tiny_served_model import make_served_model

    model_dir = str(make_served_model(tmp_path_factory.mktemp("helm-served") / "tiny"))
    (result,) = run_jobs([render_job(chart_values(model_dir))])
    assert result["ok"], result.get("error")
    rayservice = next(d for d in yaml.safe_load_all(result["manifests"]["kvserve/templates/rayservice.yaml"]) if d)
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    # What Serve does with an application entry: import the builder, call it with args.
    module_name, attr = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module_name), attr)
    serve.run(builder(app["args"]), name=app["name"], route_prefix=app["route_prefix"])
    try:
        yield {"app": app, "url": f"{serve_cluster.http_url}{app['route_prefix']}"}
    finally:
        serve.delete(app["name"])


def test_rendered_serve_config_answers_a_request(deployed: dict[str, Any]) -> None:
    app = deployed["app"]
    assert (app["name"], app["route_prefix"]) == (APP_NAME, ROUTE_PREFIX)
    with httpx.Client(timeout=120) as client:
        models = client.get(f"{deployed['url']}/v1/models")
        assert models.status_code == 200, models.text
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
        response = client.post(f"{deployed['url']}/v1/completions",
                               json={"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert body["usage"]["completion_tokens"] >= 1


def test_metrics_path_of_the_service_monitor(deployed: dict[str, Any]) -> None:
    """The ServiceMonitor scrapes <route_prefix>/metrics on the HTTP Service."""
    with httpx.Client(timeout=60) as client:
        response = client.get(f"{deployed['url']}/metrics")
    assert response.status_code == 200
    for name in ("kvserve:num_requests_running", "kvserve:kv_cache_usage_perc", "kvserve:time_to_first_token_seconds"):
        assert name in response.text
