"""The chart is secure by default, and each default is opted out of only explicitly:
API keys required (apiKeys.required), a NetworkPolicy that opens the Serve ports to the
namespace and the ingress controller and Ray's ports to the release's own pods only
(networkPolicy.enabled), and a ServiceMonitor that scrapes with a key unless /metrics is
made public (kvserve.ingress.metrics_public)."""
from __future__ import annotations

from typing import Any

from tests.helm.chart import RELEASE, Rendered, render_job, run_jobs

SELECTOR = {"app.kubernetes.io/name": "kvserve", "app.kubernetes.io/instance": RELEASE}
RAY_PORTS = {6379, 8265, 10001, 52365}


def _render(values: dict[str, Any], bare: bool = False) -> dict[str, Any]:
    (result,) = run_jobs([render_job(values, bare=bare)])
    return result


def _policy(r: Rendered) -> dict[str, Any]:
    (policy,) = r.kind("NetworkPolicy")
    return policy["spec"]


def test_default_values_refuse_to_render_without_api_keys(render_errors: Any) -> None:
    with_schema, without_schema = render_errors([({}, False), ({}, True)], bare=True)
    for error in (with_schema, without_schema):
        assert error is not None and "apiKeys.existingSecret is empty" in error
        assert "apiKeys.required=false" in error  # the message names the opt-out


def test_api_keys_opt_out_is_explicit(rendered: dict[str, Rendered]) -> None:
    r = rendered["insecure_opt_outs"]
    for _, template in r.pod_templates():
        (container,) = template["spec"]["containers"]
        assert "KVSERVE_API_KEYS" not in {e["name"] for e in container.get("env", [])}
    for _, template in rendered["default"].pod_templates():
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["KVSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "kvserve-api-keys"


def test_network_policy_is_on_by_default(rendered: dict[str, Rendered]) -> None:
    spec = _policy(rendered["default"])
    assert spec["podSelector"] == {"matchLabels": SELECTOR}
    assert spec["policyTypes"] == ["Ingress"]
    clients, own_pods, operator = spec["ingress"]
    # Every rule names its sources: nothing is open to the world.
    assert all(rule.get("from") for rule in spec["ingress"])
    assert clients["from"] == [
        {"podSelector": {}},  # the release's namespace
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}},
    ]
    assert {p["port"] for p in clients["ports"]} == {8000, 9000}
    # Ray's ports: from the release's Ray pods (any port) and, for the few it needs, the operator.
    assert own_pods["from"] == [{"podSelector": {"matchLabels": SELECTOR}}] and "ports" not in own_pods
    assert operator["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}}]
    assert {p["port"] for p in operator["ports"]} == {8265, 52365, 6379, 8000}
    assert not RAY_PORTS & {p["port"] for p in clients["ports"]}


def test_network_policy_client_sources_from_values(rendered: dict[str, Rendered]) -> None:
    clients = _policy(rendered["everything_on"])["ingress"][0]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in clients["from"]
    assert {"ipBlock": {"cidr": "203.0.113.0/24"}} in clients["from"]
    result = _render({"networkPolicy": {"ingressControllerNamespace": ""}, "kvserve": {"grpc": {"enabled": False}}})
    assert result["ok"], result.get("error")
    policy = next(d for d in Rendered({}, result["manifests"]).docs if d["kind"] == "NetworkPolicy")
    clients = policy["spec"]["ingress"][0]
    assert clients["from"] == [{"podSelector": {}}]
    assert [p["port"] for p in clients["ports"]] == [8000]


def test_network_policy_opt_out(rendered: dict[str, Rendered]) -> None:
    assert not rendered["insecure_opt_outs"].kind("NetworkPolicy")


def test_service_monitor_needs_a_key_or_public_metrics(render_errors: Any) -> None:
    monitor = {"serviceMonitor": {"enabled": True}}
    error, template_error = render_errors([(monitor, False), (monitor, True)])
    for e in (error, template_error):
        assert e is not None and "/metrics needs a key" in e
        assert "serviceMonitor.bearerTokenSecret.name" in e and "kvserve.ingress.metrics_public=true" in e
    public = _render({**monitor, "kvserve": {"ingress": {"metrics_public": True}}})
    assert public["ok"], public.get("error")
    (endpoint,) = next(d for d in Rendered({}, public["manifests"]).docs if d["kind"] == "ServiceMonitor")["spec"]["endpoints"]
    assert "authorization" not in endpoint


def test_service_monitor_with_keys_off_scrapes_without_one(rendered: dict[str, Rendered]) -> None:
    # Keys explicitly off: /metrics is as open as the rest, so no key is asked for.
    (monitor,) = [m for m in rendered["insecure_opt_outs"].kind("ServiceMonitor") if not m["metadata"]["name"].endswith("-ray")]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert "authorization" not in endpoint
