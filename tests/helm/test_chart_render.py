"""The kvserve chart, rendered by a real Helm engine for the default values and several
non-default ones (tests/helm/chart.py SCENARIOS): lint-clean, every manifest valid against
the Kubernetes schemas (RayService against the vendored KubeRay CRD schema), the Serve
config's args a valid KVServeConfig, and the security defaults in place."""
from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from tests.helm.chart import CHART, SCENARIOS, Rendered, run_jobs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SCENARIO_NAMES = list(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_lint_is_clean(rendered: dict[str, Rendered], scenario: str) -> None:
    report = rendered[scenario].lint_report
    assert report["errors"] == [], report
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert problems == [], problems
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_every_manifest_validates(rendered: dict[str, Rendered], scenario: str) -> None:
    r = rendered[scenario]
    assert len(r.validation) == len(r.docs) > 0
    failures = {f"{v['kind']}/{v['name']}": v["errors"] for v in r.validation if v["errors"]}
    assert failures == {}
    by_kind = {v["kind"]: v["schema"] for v in r.validation}
    assert by_kind["RayService"].startswith("vendored kuberay/")
    assert by_kind["Service"].startswith("kubernetes ")


def test_validation_has_teeth(rendered: dict[str, Rendered]) -> None:
    """The validators reject what the API server would reject or silently prune."""
    rs = json.loads(json.dumps(rendered["default"].rayservice))
    bad_typo = json.loads(json.dumps(rs))
    bad_typo["spec"]["rayClusterConfig"]["enableInTreeAutoScaling"] = True  # a pruned typo
    bad_pod = json.loads(json.dumps(rs))
    bad_pod["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"] = {
        "limit": {"cpu": "1"}}
    bad_params = json.loads(json.dumps(rs))
    bad_params["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 4  # must be a string
    svc = next(d for d in rendered["default"].docs if d["kind"] == "Service")
    bad_svc = json.loads(json.dumps(svc))
    bad_svc["spec"]["ports"][0]["port"] = "http"
    (result,) = run_jobs([{"op": "validate", "documents": [bad_typo, bad_pod, bad_params, bad_svc]}])
    errors = [v["errors"] for v in result["results"]]
    assert all(errors), errors
    assert "enableInTreeAutoScaling" in errors[0][0]
    assert "limit" in " ".join(errors[1])
    assert "num-cpus" in errors[2][0]


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_serve_config_args_are_a_valid_kvserve_config(rendered: dict[str, Rendered], scenario: str) -> None:
    """serveConfigV2 is a valid Serve deploy config, and its app args are the values'
    `kvserve:` block verbatim, accepted by the same loader as `kvserve serve --config`."""
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ConfigError, KVServeConfig

    r = rendered[scenario]
    serve_config = r.serve_config
    ServeDeploySchema.model_validate(serve_config)  # raises on a bad document
    (app,) = serve_config["applications"]
    assert app["import_path"] == "cluster.app:app_builder"
    # Verbatim (one source of truth), plus only each worker section's pool pinning.
    assert app["args"] == with_pool_pinning(r.effective_values)
    config = KVServeConfig.from_dict(app["args"])
    assert app["name"] == config.app_name
    assert app["route_prefix"] == config.route_prefix
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": config.http.port}
    if config.grpc.enabled:
        assert serve_config["grpc_options"]["port"] == config.grpc.port
        assert serve_config["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER]
    else:
        assert "grpc_options" not in serve_config


def with_pool_pinning(values: dict[str, Any]) -> dict[str, Any]:
    """What templates/_helpers.tpl (kvserve.appArgs) adds to the kvserve block: every
    worker section without `resources` asks for its pool's resource, one unit per rank;
    with the ingress group on, the ingress asks for one ingress pod's unit."""
    args = copy.deepcopy(values["kvserve"])
    if args.get("disaggregation"):
        sections = [(args["disaggregation"].setdefault(role, {}), role) for role in ("prefill", "decode")]
    else:
        sections = [(args.setdefault("workers", {}), "mixed")]
    for section, role in sections:
        section.setdefault("resources", {f"kvserve_pool_{role}": 1})
    if args.get("models"):
        args["models"] = [pinned_model(entry, args, values["pools"]) for entry in args["models"]]
    if values["ingressGroup"]["enabled"]:
        args.setdefault("ingress", {}).setdefault("resources", {"kvserve_ingress": 1})
    return args


def pinned_model(entry: dict[str, Any], args: dict[str, Any], pools: list[dict[str, Any]]) -> dict[str, Any]:
    """One of kvserve.models as kvserve.pinnedModel writes it: each worker section (its own,
    else the top level's, pinned as above) asks for its pools' resource: those that name
    the model (`kvserve_pool_<role>_<slug>`), else the shared ones."""
    from cluster.models_config import slug_of

    entry = copy.deepcopy(entry)
    suffix = f"_{slug_of(entry['name'])}" if any(p.get("model") == entry["name"] for p in pools) else ""
    own = entry.get("disaggregation")
    if own or args.get("disaggregation"):
        disagg = entry["disaggregation"] = copy.deepcopy(own or args["disaggregation"])
        for role in ("prefill", "decode"):
            section = disagg.setdefault(role, {})
            if "resources" not in section or role not in (own or {}):
                section["resources"] = {f"kvserve_pool_{role}{suffix}": 1}
    else:
        inherited = not entry.get("workers")
        workers = entry["workers"] = entry.get("workers") or copy.deepcopy(args.get("workers", {}))
        if inherited or "resources" not in workers:
            workers["resources"] = {f"kvserve_pool_mixed{suffix}": 1}
    return entry


# The servicer function the chart names in grpc_options (templates/_helpers.tpl).
GRPC_SERVICER = "router.frontend.grpc_api.proxy.add_KVServeServicer_to_server"


def test_grpc_servicer_function_is_the_apps() -> None:
    """The chart's gRPC servicer is the one `kvserve serve` gives Serve, and it imports."""
    import importlib

    from cluster.app import grpc_servicer

    assert grpc_servicer() == GRPC_SERVICER
    module, _, name = GRPC_SERVICER.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_chart_reads_only_real_config_fields() -> None:
    """The keys the chart reads from the kvserve block exist in KVServeConfig."""
    from cluster.config import KVServeConfig

    sections = KVServeConfig.model_fields
    assert {"app_name", "route_prefix", "model", "http", "grpc", "workers"} <= set(sections)
    assert "port" in sections["http"].annotation.model_fields
    assert {"port", "enabled"} <= set(sections["grpc"].annotation.model_fields)
    assert {"tensor_parallel_size", "num_gpus", "autoscaling"} <= set(sections["workers"].annotation.model_fields)
    assert "path" in sections["model"].annotation.model_fields
    defaults = KVServeConfig()
    assert (defaults.app_name, defaults.route_prefix, defaults.http.port, defaults.grpc.port) == ("kvserve", "/", 8000, 9000)


def test_autoscaling_policy_in_values_is_importable(rendered: dict[str, Rendered]) -> None:
    import importlib

    policy = rendered["default"].serve_config["applications"][0]["args"]["workers"]["autoscaling"]["policy"]
    module, name = policy.split(":")
    assert callable(getattr(importlib.import_module(module), name))


def test_default_rayservice_shape(rendered: dict[str, Rendered]) -> None:
    r = rendered["default"]
    cluster = r.rayservice["spec"]["rayClusterConfig"]
    assert r.rayservice["metadata"]["name"] == "kvs-kvserve"
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["upscalingMode"] == "Default"
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"  # the head never takes GPU work
    assert head["rayStartParams"]["num-cpus"] == "0"  # nor any replica (KubeRay's advice)
    head_container = head["template"]["spec"]["containers"][0]
    assert not any("gpu" in k for k in head_container["resources"].get("limits", {}))
    ingress_group, group = cluster["workerGroupSpecs"]
    assert ingress_group["groupName"] == "ingress"
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == ("gpu", 1, 1, 4)
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert group["rayStartParams"]["num-gpus"] == "1"
    assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {"kvserve_pool_mixed": 1}
    assert group["template"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # The model PVC, read-only, where kvserve.model.path points.
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "kvserve-models", "readOnly": True}
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models/model", "readOnly": True}
    assert r.serve_config["applications"][0]["args"]["model"]["path"] == "/models/model"


def test_services_http_and_grpc(rendered: dict[str, Rendered]) -> None:
    services = {s["metadata"]["name"]: s for s in rendered["default"].kind("Service")}
    assert set(services) == {"kvs-kvserve-http", "kvs-kvserve-grpc"}
    http, grpc = services["kvs-kvserve-http"]["spec"], services["kvs-kvserve-grpc"]["spec"]
    assert http["ports"] == [{"name": "http", "port": 8000, "targetPort": "serve", "protocol": "TCP", "appProtocol": "http"}]
    assert grpc["ports"] == [{"name": "grpc", "port": 9000, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}]
    for spec in (http, grpc):
        assert spec["type"] == "ClusterIP"
        assert spec["selector"] == {"app.kubernetes.io/name": "kvserve", "app.kubernetes.io/instance": "kvs",
                                    "ray.io/serve": "true", "kvserve.io/client-proxy": "true"}
    # The selected pods (the ingress group's only) carry those labels and the named ports.
    selected = [name for name, t in rendered["default"].pod_templates()
                if t["metadata"]["labels"].get("kvserve.io/client-proxy") == "true"]
    assert selected == ["ingress"]
    for _, template in rendered["default"].pod_templates():
        labels = template["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "kvs" and labels["app.kubernetes.io/name"] == "kvserve"
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports["serve"] == 8000 and ports["grpc"] == 9000
    assert rendered["grpc_off_hub_model"].kind("Service")[0]["metadata"]["name"] == "kvs-kvserve-http"
    assert len(rendered["grpc_off_hub_model"].kind("Service")) == 1


def test_disaggregated_pools(rendered: dict[str, Rendered]) -> None:
    groups = rendered["disaggregated"].rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][1:]
    assert [g["groupName"] for g in groups] == ["prefill", "decode"]
    assert [json.loads(json.loads(g["rayStartParams"]["resources"])) for g in groups] == [
        {"kvserve_pool_prefill": 1}, {"kvserve_pool_decode": 2}]  # one unit per GPU
    assert [g["template"]["metadata"]["labels"]["kvserve.io/pool-role"] for g in groups] == ["prefill", "decode"]
    assert [(g["minReplicas"], g["maxReplicas"]) for g in groups] == [(1, 2), (1, 6)]
    assert groups[1]["template"]["spec"]["nodeSelector"] == {"gpu.example.com/class": "h100"}
    assert "nodeSelector" not in groups[0]["template"]["spec"]
    # The app runs a prefill and a decode deployment, each pinned to its pool's pods by the
    # resource those pods advertise (one unit per rank); the decode pool is TP=2.
    args = rendered["disaggregated"].serve_config["applications"][0]["args"]
    d = args["disaggregation"]
    assert d["prefill"]["resources"] == {"kvserve_pool_prefill": 1}
    assert d["decode"]["resources"] == {"kvserve_pool_decode": 1}
    assert d["decode"]["tensor_parallel_size"] == 2


def test_worker_replicas_are_pinned_to_their_pool(rendered: dict[str, Rendered]) -> None:
    for scenario in ("default", "tp2"):
        args = rendered[scenario].serve_config["applications"][0]["args"]
        assert args["workers"]["resources"] == {"kvserve_pool_mixed": 1}, scenario
    assert "resources" not in rendered["default"].values.get("kvserve", {}).get("workers", {})


def test_each_model_gets_its_deployments_pinned_to_its_pools(rendered: dict[str, Rendered]) -> None:
    r = rendered["multi_model"]
    groups = {g["groupName"]: g for g in r.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][1:]}
    resources = {name: json.loads(json.loads(g["rayStartParams"]["resources"])) for name, g in groups.items()}
    assert resources == {"chat": {"kvserve_pool_mixed_chat": 1}, "coder-prefill": {"kvserve_pool_prefill_org-coder": 1},
                         "coder-decode": {"kvserve_pool_decode_org-coder": 2}, "shared": {"kvserve_pool_mixed": 1}}
    args = r.serve_config["applications"][0]["args"]
    chat, coder, small = args["models"]
    assert chat["workers"]["resources"] == {"kvserve_pool_mixed_chat": 1}
    assert chat["workers"]["autoscaling"]["max_replicas"] == 4 and chat["lora"]["modules"] == {"sql": "/models/model/adapters/sql"}
    assert coder["disaggregation"]["prefill"]["resources"] == {"kvserve_pool_prefill_org-coder": 1}
    assert coder["disaggregation"]["decode"]["resources"] == {"kvserve_pool_decode_org-coder": 1}
    assert coder["disaggregation"]["decode"]["tensor_parallel_size"] == 2 and coder["engine"] == {"max_num_seqs": 32}
    # A model without pools of its own runs on the shared pool, with the top-level workers.
    assert small["workers"]["resources"] == {"kvserve_pool_mixed": 1} and small["workers"]["num_gpus"] == 1
    assert "model" not in args and args["ingress"]["key_models"] == {"0123456789ab": ["chat"]}
    from cluster.config import KVServeConfig
    from cluster.models_config import model_views

    views = model_views(KVServeConfig.from_dict(args))
    assert [(v.name, v.deployment("worker")) for v in views] == [
        ("chat", "worker-chat"), ("org/coder", "worker-org-coder"), ("small", "worker-small")]


def test_tensor_parallel_pool(rendered: dict[str, Rendered]) -> None:
    _, group = rendered["tp2"].rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert group["rayStartParams"]["num-gpus"] == "4"
    assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {"kvserve_pool_mixed": 4}
    assert "nodeAffinity" in group["template"]["spec"]["affinity"]
    assert rendered["tp2"].serve_config["applications"][0]["args"]["workers"]["tensor_parallel_size"] == 2


def test_redis_gcs_fault_tolerance_uses_a_secret(rendered: dict[str, Rendered]) -> None:
    cluster = rendered["redis"].rayservice["spec"]["rayClusterConfig"]
    assert cluster["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.redis.svc.cluster.local:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "kvserve-redis", "key": "password"}}},
    }
    assert "gcsFaultToleranceOptions" not in rendered["default"].rayservice["spec"]["rayClusterConfig"]


def test_state_store_redis_url_in_the_config_password_from_a_secret(rendered: dict[str, Rendered]) -> None:
    r = rendered["state_store"]
    state = r.serve_config["applications"][0]["args"]["state"]
    assert state == {"redis_url": "redis://redis-master.redis.svc.cluster.local:6379/1"}
    for name, template in r.pod_templates():  # ingress replicas run on the head; any pod may host one
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["KVSERVE_REDIS_PASSWORD"] == {
            "name": "KVSERVE_REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "kvserve-state-redis", "key": "redis-password"}},
        }, name
    for _, template in rendered["default"].pod_templates():
        assert "KVSERVE_REDIS_PASSWORD" not in {e["name"] for e in template["spec"]["containers"][0]["env"]}
    assert "state" not in rendered["default"].serve_config["applications"][0]["args"]


def test_serve_runs_throughput_optimized_in_every_pod_unless_turned_off(rendered: dict[str, Rendered]) -> None:
    # Every Serve process (controller, proxies, replicas) reads the mode from its pod's
    # environment when it starts (cluster/serve_env.py).
    for scenario, expected in (("default", "1"), ("ingress_group_off", "0")):
        for name, template in rendered[scenario].pod_templates():
            env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
            assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == expected, (scenario, name)
            assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0", (scenario, name)



def test_direct_ingress_reaches_every_pod_with_haproxys_ports(rendered: dict[str, Rendered]) -> None:
    for name, template in rendered["grpc_off_hub_model"].pod_templates():
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert (env["RAY_SERVE_ENABLE_DIRECT_INGRESS"], env["RAY_SERVE_ENABLE_HA_PROXY"]) == ("1", "1"), name
        assert (env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"]) == ("18404", "9101"), name


def test_autoscaling_off(rendered: dict[str, Rendered]) -> None:
    r = rendered["autoscaling_off"]
    cluster = r.rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in cluster
    _, group = cluster["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    workers = r.serve_config["applications"][0]["args"]["workers"]
    assert "autoscaling" not in workers and workers["num_replicas"] == 2


def test_everything_on(rendered: dict[str, Rendered]) -> None:
    r = rendered["everything_on"]
    (ingress,) = r.kind("Ingress")
    rule = ingress["spec"]["rules"][0]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": "kvs-kvserve-http", "port": {"name": "http"}}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    (monitor,) = [m for m in r.kind("ServiceMonitor") if not m["metadata"]["name"].endswith("-ray")]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{
        "port": "http", "path": "/api/metrics", "interval": "15s", "scrapeTimeout": "10s",
        "authorization": {"type": "Bearer", "credentials": {"name": "kvserve-metrics-key", "key": "api-key"}},
    }]
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "serve-http"
    (policy,) = r.kind("NetworkPolicy")
    operator_rule = policy["spec"]["ingress"][2]
    assert {p["port"] for p in operator_rule["ports"]} == {8265, 52365, 6379, 8000}
    assert r.serve_config["applications"][0]["name"] == "llm"
    assert r.serve_config["applications"][0]["route_prefix"] == "/api"
    grpc = next(s for s in r.kind("Service") if s["metadata"]["name"].endswith("-grpc"))
    assert grpc["spec"]["type"] == "LoadBalancer"
    for name, template in r.pod_templates():
        spec = template["spec"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert spec["serviceAccountName"] == "kvserve"
        (container,) = spec["containers"]
        assert container["image"] == "registry.example.com/kvserve:1.2.3"
        env = {e["name"]: e for e in container["env"]}
        assert env["KVSERVE_API_KEYS"]["valueFrom"] == {"secretKeyRef": {"name": "kvserve-api-keys", "key": "api-keys"}}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"]["hostPath"] == {"path": "/data/models/llama", "type": "Directory"}
        (init,) = spec["initContainers"]
        assert init["image"] == "registry.example.com/kvserve:1.2.3"
        init_mount = next(m for m in init["volumeMounts"] if m["name"] == "model")
        assert init_mount["mountPath"] == "/models/llama" and "readOnly" not in init_mount
    head_spec = r.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert head_spec["nodeSelector"] == {"node-role": "cpu"}


def test_grpc_tls_from_a_secret(rendered: dict[str, Rendered]) -> None:
    """grpcTLS.existingSecret: every Ray pod mounts it and gets router/frontend/grpc_api/tls.py's
    environment (mutual TLS with clientCAKey); the gRPC Service and the NetworkPolicy open
    the TLS port beside the plaintext one; the app name the proxy's health probe names."""
    r = rendered["everything_on"]
    for _, template in r.pod_templates():
        spec = template["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KVSERVE_GRPC_TLS_PORT"] == "9443"
        assert env["KVSERVE_GRPC_TLS_CERT_FILE"] == "/etc/kvserve/grpc-tls/tls.crt"
        assert env["KVSERVE_GRPC_TLS_KEY_FILE"] == "/etc/kvserve/grpc-tls/tls.key"
        assert env["KVSERVE_GRPC_TLS_CLIENT_CA_FILE"] == "/etc/kvserve/grpc-tls/ca.crt"
        assert env["KVSERVE_APP_NAME"] == "llm"
        assert {"name": "grpc-tls", "mountPath": "/etc/kvserve/grpc-tls", "readOnly": True} in container["volumeMounts"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["grpc-tls"]["secret"]["secretName"] == "kvserve-grpc-tls"
        assert {"name": "grpc-tls", "containerPort": 9443, "protocol": "TCP"} in container["ports"]
    grpc = next(s for s in r.kind("Service") if s["metadata"]["name"].endswith("-grpc"))
    assert {p["name"]: p["port"] for p in grpc["spec"]["ports"]} == {"grpc": 9000, "grpc-tls": 9443}
    (policy,) = r.kind("NetworkPolicy")
    assert 9443 in {p["port"] for p in policy["spec"]["ingress"][0]["ports"]}
    for _, template in rendered["default"].pod_templates():
        (container,) = template["spec"]["containers"]
        assert not any(e["name"].startswith("KVSERVE_GRPC_TLS") for e in container["env"])


# ----------------------------------------------------------------------------- security

def _containers(r: Rendered) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for name, template in r.pod_templates():
        spec = template["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            out.append((f"{name}/{c['name']}", c, spec))
    return out


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_dashboard_and_job_api_are_not_exposed(rendered: dict[str, Rendered], scenario: str) -> None:
    r = rendered[scenario]
    internal_ports = {8265, 52365, 6379, 10001}
    for svc in r.kind("Service"):
        exposed = {p["port"] for p in svc["spec"]["ports"]} | {p.get("targetPort") for p in svc["spec"]["ports"]}
        assert not exposed & (internal_ports | {"dashboard", "gcs-server", "client"}), svc["metadata"]["name"]
    for ingress in r.kind("Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"]["name"].endswith("-http")
    head = r.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["enableIngress"] is False


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_ray_token_auth_is_on(rendered: dict[str, Rendered], scenario: str) -> None:
    r = rendered[scenario]
    cluster = r.rayservice["spec"]["rayClusterConfig"]
    mode = r.effective_values["rayAuth"]["mode"]
    if mode == "operator":
        assert cluster["authOptions"] == {"mode": "token"}
    else:
        assert "authOptions" not in cluster
        envs = [c.get("env", []) for _, c, _ in _containers(r) if c["name"].startswith("ray-")]
        envs.append(cluster.get("autoscalerOptions", {}).get("env", []))
        for env in envs:
            by_name = {e["name"]: e for e in env}
            assert by_name["RAY_AUTH_MODE"]["value"] == "token"
            assert by_name["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "kvserve-ray-token"


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_pods_run_non_root_with_read_only_root(rendered: dict[str, Rendered], scenario: str) -> None:
    r = rendered[scenario]
    read_only = r.effective_values["securityContext"]["readOnlyRootFilesystem"]
    for name, container, pod in _containers(r):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["automountServiceAccountToken"] is False, name
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        assert sc["readOnlyRootFilesystem"] is read_only, name
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp"] == "tmp", name  # the writable scratch space
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes["tmp"], name
        if container["name"].startswith("ray-"):
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", name
    options = r.rayservice["spec"]["rayClusterConfig"].get("autoscalerOptions")
    if options:
        assert options["securityContext"]["readOnlyRootFilesystem"] is read_only
        assert options["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_no_secrets_in_the_output(rendered: dict[str, Rendered], scenario: str) -> None:
    r = rendered[scenario]
    assert not r.kind("Secret")
    for _, container, _ in _containers(r):
        for env in container.get("env", []):
            if env["name"].endswith("_FILE"):  # a path to a mounted Secret's file, not its content
                assert env.get("value", "/").startswith("/"), env
            elif re.search(r"TOKEN|PASSWORD|KEY", env["name"]):
                assert "value" not in env or env["name"] == "RAY_AUTH_MODE", env


# ----------------------------------------------------------------------------- dashboard

REQUIRED_METRICS = (
    "kvserve:time_to_first_token_seconds", "kvserve:inter_token_latency_seconds", "kvserve:e2e_request_latency_seconds",
    "kvserve:num_requests_waiting", "kvserve:num_requests_running", "kvserve:kv_cache_usage_perc",
    "kvserve:num_preemptions", "kvserve:prompt_tokens", "kvserve:generation_tokens",
    # Router v2 (router/routing/admission.py, the request routers): issue 13's router metrics.
    "kvserve:router_decisions", "kvserve:ingress_queue_time_seconds", "kvserve:ingress_queue_length",
    "kvserve:router_prefix_hit_tokens_predicted", "kvserve:router_prefix_hit_tokens_realised",
    "kvserve:router_requests_outstanding", "kvserve:router_reservations_unreflected", "kvserve:router_stats_age_seconds",
)


class _FakeRouter:
    """What the metrics read of a request router (router/frontend/metrics.py's RouterStatsCollector)."""

    def __init__(self) -> None:
        self.num_decisions_by_mode = {"headroom": 1}

    def routing_view(self) -> dict:
        return {"r": {"stats": {"timestamp": 0.0}, "outstanding": 1, "unreflected_requests": 1}}


def _exposed_metric_names() -> set[str]:
    """What router/frontend/metrics.py really exposes, from one rendered scrape."""
    from router.frontend.metrics import IngressMetrics

    m = IngressMetrics("m")
    m.observe_first_token(0.1)
    m.observe_inter_token(0.02, 1)
    m.observe_finished(1.0, 3, 4, "stop")
    m.observe_admitted(0.5, "fits", 16)
    m.observe_shed("queue_full")
    m.router.source = _FakeRouter
    stats = {"num_running": 1, "num_waiting": 2, "kv_usage": 0.5, "free_blocks": 1, "total_blocks": 2,
             "tokens_per_s": 1.0, "prefix_cache_queries": 1, "prefix_cache_hits": 1, "num_preemptions": 1,
             "replica_id": "r"}
    text = m.render([stats]).decode()
    return set(re.findall(r"^(kvserve:[a-z0-9_:]+)", text, re.MULTILINE))


def test_grafana_dashboard(rendered: dict[str, Rendered]) -> None:
    (cm,) = rendered["default"].kind("ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kvserve.json"])
    assert dashboard == json.loads((CHART / "files" / "dashboards" / "kvserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    text = "\n".join(exprs)
    for metric in REQUIRED_METRICS:
        assert metric in text, f"no panel uses {metric}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for word in ("first token", "inter-token", "queue", "kv", "replicas", "preemptions", "routing decisions",
                 "ingress queue", "predicted vs realised", "reservations", "stats age"):
        assert word in titles
    used = set(re.findall(r"kvserve:[a-z0-9_:]+", text))
    missing = used - _exposed_metric_names()
    assert not missing, f"the dashboard queries series router/frontend/metrics.py does not expose: {sorted(missing)}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert not rendered["grpc_off_hub_model"].kind("ConfigMap")


def test_notes_render(rendered: dict[str, Rendered]) -> None:
    notes = rendered["default"].notes
    assert "kubectl -n llm port-forward svc/kvs-kvserve-http 8000" in notes
    assert "apiKeys.existingSecret is empty" not in notes and "networkPolicy.enabled is false" not in notes
    opted_out = rendered["insecure_opt_outs"].notes
    assert "apiKeys.required is false and apiKeys.existingSecret is empty" in opted_out
    assert "networkPolicy.enabled is false" in opted_out
    assert "/api/v1/models" in rendered["everything_on"].notes

