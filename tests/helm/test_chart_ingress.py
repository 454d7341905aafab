"""The chart's ingress placement: the ingress replicas and the proxies clients reach run on a
CPU worker group (`ingressGroup`), never on the GPU hosts or the head (docs/operations.md "Reliability";
tests/multinode/test_ingress_placement.py shows what a lost ingress node or proxy does)."""
from __future__ import annotations

import json

from tests.helm.chart import Rendered


def test_ingress_group_holds_the_ingress_and_the_client_proxies(rendered: dict[str, Rendered]) -> None:
    """By default the ingress replicas (two, one per pod) and the proxies clients reach run
    on a CPU worker group, never on the GPU hosts or the head (docs/operations.md "Reliability")."""
    r = rendered["default"]
    cluster = r.rayservice["spec"]["rayClusterConfig"]
    group = cluster["workerGroupSpecs"][0]
    assert (group["groupName"], group["replicas"], group["minReplicas"]) == ("ingress", 2, 2)
    assert group["rayStartParams"]["num-gpus"] == "0"
    assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {"kvserve_ingress": 1}
    container = group["template"]["spec"]["containers"][0]
    assert not any("gpu" in k for k in container["resources"].get("limits", {}))
    assert "tolerations" not in group["template"]["spec"]  # not on tainted GPU nodes
    args = r.serve_config["applications"][0]["args"]
    # At least two at all times, scaling on open streams within the ingress group's pods.
    scaling = args["ingress"]["autoscaling"]
    assert "num_replicas" not in args["ingress"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (group["minReplicas"], group["maxReplicas"]) == (2, 4)
    assert args["ingress"]["resources"] == {"kvserve_ingress": 1}  # one unit per pod: one replica per pod
    # No GPU pool advertises the ingress resource.
    for pool_group in cluster["workerGroupSpecs"][1:]:
        assert "kvserve_ingress" not in json.loads(json.loads(pool_group["rayStartParams"]["resources"]))


def test_ingress_group_off_keeps_the_old_placement(rendered: dict[str, Rendered]) -> None:
    r = rendered["ingress_group_off"]
    groups = r.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["gpu"]
    assert r.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "4"
    assert "resources" not in r.serve_config["applications"][0]["args"]["ingress"]
    for service in r.kind("Service"):
        assert "kvserve.io/client-proxy" not in service["spec"]["selector"]
