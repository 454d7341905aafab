"""Helpers for the Helm chart tests (deploy/helm/kvserve): the tool venv, the scenarios,
and the rendered output. tests/helm/conftest.py turns them into session fixtures.

The chart is rendered and linted by a real Helm v4 engine and its output validated
against Kubernetes schemas offline. Those tools live in their own venv, made by
`bash scripts/helm_tools.sh` (default: .cache/helm-venv; override with $KVSERVE_HELM_VENV),
and run through tests/helm/helm_runner.py as a subprocess. Without that venv the tests
skip with the reason and the command to run; with KVSERVE_REQUIRE_HELM=1 (CI) they fail.

Everything is rendered in a few batched subprocess calls per session (each call loads
Helm's ~80 MB shared library once).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kvserve"
RUNNER = Path(__file__).resolve().parent / "helm_runner.py"
RELEASE = "kvs"
NAMESPACE = "llm"
KUBE_VERSION = "1.33.0"


def tool_python() -> Path:
    venv = Path(os.environ.get("KVSERVE_HELM_VENV", REPO / ".cache" / "helm-venv"))
    return venv / "bin" / "python"


def run_jobs(jobs: list[dict[str, Any]], timeout: float = 300) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [str(tool_python()), str(RUNNER)], input=json.dumps(jobs), capture_output=True, text=True,
        timeout=timeout, cwd=REPO,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"helm_runner failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


_PROBE: dict[str, str | None] = {}


def helm_unavailable_reason() -> str | None:
    """None when the tool venv works; otherwise why not (cached)."""
    if "reason" not in _PROBE:
        python = tool_python()
        reason = None
        if not python.exists():
            reason = f"Helm tool venv not found ({python}); run `bash scripts/helm_tools.sh` to install the Helm engine and kubernetes-validate"
        else:
            proc = subprocess.run([str(python), "-c", "import helm_python, kubernetes_validate, jsonschema, referencing"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                reason = f"Helm tool venv {python} is incomplete ({proc.stderr.strip().splitlines()[-1:]}); rerun `bash scripts/helm_tools.sh`"
        _PROBE["reason"] = reason
    return _PROBE["reason"]


def require_helm() -> None:
    reason = helm_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("KVSERVE_REQUIRE_HELM") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of a values override onto defaults (None deletes a key)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def default_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


# --------------------------------------------------------------------------- scenarios
# Non-default values that the chart must render, lint and validate cleanly.
SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "disaggregated": {
        "kvserve": {"disaggregation": {
            "prefill": {"num_gpus": 1, "autoscaling": {"role": "prefill", "min_replicas": 1, "max_replicas": 2}},
            "decode": {"num_gpus": 2, "tensor_parallel_size": 2,
                       "autoscaling": {"role": "decode", "min_replicas": 1, "max_replicas": 6}},
        }},
        "pools": [
            {"name": "prefill", "role": "prefill", "replicas": 1, "minReplicas": 1, "maxReplicas": 2, "gpusPerPod": 1,
             "resources": {"requests": {"cpu": "8", "memory": "48Gi"}}},
            {"name": "decode", "role": "decode", "replicas": 2, "minReplicas": 1, "maxReplicas": 6, "gpusPerPod": 2,
             "resources": {"requests": {"cpu": "8", "memory": "48Gi"}},
             "nodeSelector": {"gpu.example.com/class": "h100"}},
        ],
    },
    "tp2": {
        "kvserve": {"workers": {"tensor_parallel_size": 2, "num_gpus": 2}},
        "pools": [{"name": "gpu", "role": "mixed", "replicas": 1, "minReplicas": 0, "maxReplicas": 2, "gpusPerPod": 4,
                   "gpuResource": "nvidia.com/gpu",
                   "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                       {"matchExpressions": [{"key": "nvidia.com/gpu.count", "operator": "In", "values": ["4", "8"]}]}]}}}}],
    },
    # Three models on one cluster (cluster/models_config.py): two on pools of their own (one
    # of them disaggregated, its decode pool tensor-parallel), one on the shared pool.
    "multi_model": {
        "kvserve": {"model": None, "models": [
            {"name": "chat", "path": "/models/model/chat",
             "workers": {"num_gpus": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 4}},
             "lora": {"modules": {"sql": "/models/model/adapters/sql"}}},
            {"name": "org/coder", "path": "/models/model/coder", "engine": {"max_num_seqs": 32},
             "disaggregation": {"prefill": {"num_gpus": 1},
                                "decode": {"num_gpus": 2, "tensor_parallel_size": 2}}},
            {"name": "small", "path": "/models/model/small"},
        ], "ingress": {"key_models": {"0123456789ab": ["chat"]}}},
        "pools": [
            {"name": "chat", "model": "chat", "role": "mixed", "replicas": 1, "minReplicas": 1, "maxReplicas": 4,
             "gpusPerPod": 1},
            {"name": "coder-prefill", "model": "org/coder", "role": "prefill", "replicas": 1, "minReplicas": 1,
             "maxReplicas": 2, "gpusPerPod": 1},
            {"name": "coder-decode", "model": "org/coder", "role": "decode", "replicas": 1, "minReplicas": 1,
             "maxReplicas": 2, "gpusPerPod": 2},
            {"name": "shared", "role": "mixed", "replicas": 1, "minReplicas": 0, "maxReplicas": 2, "gpusPerPod": 1},
        ],
    },
    "redis": {
        "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis-master.redis.svc.cluster.local:6379",
                              "redisPasswordSecret": {"name": "kvserve-redis", "key": "password"}},
    },
    "state_store": {
        "kvserve": {"state": {"redis_url": "redis://redis-master.redis.svc.cluster.local:6379/1"},
                    "ingress": {"max_concurrent_requests_per_key": 8, "tokens_per_minute_per_key": 100000}},
        "stateStore": {"redisPasswordSecret": {"name": "kvserve-state-redis", "key": "redis-password"}},
    },
    "autoscaling_off": {
        "autoscaling": {"enabled": False},
        "kvserve": {"workers": {"autoscaling": None, "num_replicas": 2}},
        "pools": [{"name": "gpu", "role": "mixed", "replicas": 2, "minReplicas": 2, "maxReplicas": 2, "gpusPerPod": 1}],
    },
    "everything_on": {
        "imagePullSecrets": [{"name": "regcred"}],
        "image": {"repository": "registry.example.com/kvserve", "tag": "1.2.3"},
        "apiKeys": {"existingSecret": "kvserve-api-keys"},
        "grpcTLS": {"existingSecret": "kvserve-grpc-tls", "clientCAKey": "ca.crt"},
        "rayAuth": {"mode": "secret", "existingSecret": "kvserve-ray-token"},
        "modelSource": {"type": "hostPath", "mountPath": "/models/llama", "hostPath": {"path": "/data/models/llama"},
                        "initContainer": {"enabled": True, "command": ["sh", "-c"],
                                          "args": ["test -f \"$MODEL_DIR/config.json\""]}},
        "kvserve": {"model": {"path": "/models/llama", "served_model_name": "llama"}, "route_prefix": "/api",
                    "app_name": "llm"},
        "ingress": {"enabled": True, "className": "nginx",
                    "hosts": [{"host": "llm.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]}],
                    "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"},
                           "bearerTokenSecret": {"name": "kvserve-metrics-key", "key": "api-key"}},
        "networkPolicy": {"enabled": True, "clientNamespaces": ["monitoring"], "clientCIDRs": ["203.0.113.0/24"],
                          "metricsNamespaces": ["monitoring"]},
        "service": {"grpc": {"type": "LoadBalancer"}},
        "head": {"nodeSelector": {"node-role": "cpu"}, "tolerations": [{"key": "dedicated", "operator": "Equal",
                                                                          "value": "ray", "effect": "NoSchedule"}]},
        "serviceAccount": {"name": "kvserve"},
    },
    "ingress_group_off": {
        "ingressGroup": {"enabled": False},
        "head": {"numCpus": 4},
        "kvserve": {"ingress": {"autoscaling": None, "num_replicas": 1}},
        "serve": {"throughputOptimized": False},
    },
    # Every secure default explicitly switched off (each opt-out renders and lints clean).
    "insecure_opt_outs": {
        "apiKeys": {"required": False, "existingSecret": ""},
        "networkPolicy": {"enabled": False},
        "serviceMonitor": {"enabled": True},
    },
    "grpc_off_hub_model": {
        "modelSource": {"type": "none"},
        "kvserve": {"model": {"path": "meta-llama/Llama-3.2-1B-Instruct"}, "grpc": {"enabled": False},
                    "http": {"direct_ingress": True, "haproxy_stats_port": 18404}},
        "grafanaDashboard": {"enabled": False},
        "securityContext": {"readOnlyRootFilesystem": False},
    },
}


@dataclass
class Rendered:
    values: dict[str, Any]  # the user's override
    manifests: dict[str, str]  # template path -> text (NOTES.txt included)
    lint_report: dict[str, Any] = field(default_factory=dict)
    validation: list[dict[str, Any]] = field(default_factory=list)

    @cached_property
    def docs(self) -> list[dict[str, Any]]:
        out = []
        for path, text in sorted(self.manifests.items()):
            if path.endswith("NOTES.txt"):
                continue
            out.extend(d for d in yaml.safe_load_all(text) if d)
        return out

    @property
    def notes(self) -> str:
        return next((t for p, t in self.manifests.items() if p.endswith("NOTES.txt")), "")

    @property
    def effective_values(self) -> dict[str, Any]:
        return merge(default_values(), self.values)

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    @property
    def rayservice(self) -> dict[str, Any]:
        (rs,) = self.kind("RayService")
        return rs

    @property
    def serve_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    def pod_templates(self) -> Iterator[tuple[str, dict[str, Any]]]:
        cluster = self.rayservice["spec"]["rayClusterConfig"]
        yield "head", cluster["headGroupSpec"]["template"]
        for group in cluster["workerGroupSpecs"]:
            yield group["groupName"], group["template"]


# The chart requires API keys (apiKeys.required, on by default): every install names the
# keys' Secret, and so does every rendering here unless a test asks for the bare values
# (tests of that requirement and its opt-out, tests/helm/test_chart_secure_defaults.py).
API_KEYS = {"apiKeys": {"existingSecret": "kvserve-api-keys"}}


def with_api_keys(values: dict[str, Any]) -> dict[str, Any]:
    return merge(API_KEYS, values)


def render_job(values: dict[str, Any], skip_schema: bool = False, bare: bool = False) -> dict[str, Any]:
    return {"op": "render", "chart": str(CHART), "values": values if bare else with_api_keys(values),
            "release": RELEASE, "namespace": NAMESPACE, "skip_schema": skip_schema}
