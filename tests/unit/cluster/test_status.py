"""`kvserve status` without a cluster (cluster/status.py): how Serve's details and the
replicas' stats become pools and replicas per node, the table, the JSON, and where the
command looks for the cluster. The real thing against real Serve:
tests/integration/test_operating.py."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cluster import local_ray, status
from cluster.status import ClusterStatus, StatusError, gather, render, resolve_target

# The shape of Serve 2.60's ServeInstanceDetails (router/serve_internals.serve_instance_details),
# trimmed to what status reads: a disaggregated app, the decode pool autoscaling on kvserve's policy.
DETAILS: dict[str, Any] = {"applications": {"kvserve": {"status": "RUNNING", "deployments": {
    "decode": {
        "status": "HEALTHY", "message": "", "target_num_replicas": 2,
        "deployment_config": {"autoscaling_config": {
            "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 64.0,
            "policy": {"policy_function": "cluster.autoscaling:QueueDepthPolicy", "policy_kwargs": {
                "role": "decode", "target_waiting_per_replica": 4.0, "kv_usage_ceiling": 0.9, "scale_to_zero": False}}}},
        "autoscaling_detail": {"scaling_status": "STABLE"},
        "replicas": [
            {"replica_id": "d1", "state": "RUNNING", "node_id": "n2aaaaaaaaaa", "node_ip": "10.0.0.2", "pid": 11},
            {"replica_id": "d2", "state": "STARTING", "node_id": "n3bbbbbbbbbb", "node_ip": "10.0.0.3", "pid": 12},
        ],
    },
    "ingress": {"status": "HEALTHY", "target_num_replicas": 1, "deployment_config": {},
                "replicas": [{"replica_id": "i1", "state": "RUNNING", "node_id": "n1", "node_ip": "10.0.0.1", "pid": 10}]},
    "prefill": {"status": "UNHEALTHY", "message": "replica failed its health check", "target_num_replicas": 1,
                "deployment_config": {}, "replicas": [
                    {"replica_id": "p1", "state": "RUNNING", "node_id": "n2aaaaaaaaaa", "node_ip": "10.0.0.2", "pid": 13}]},
}}}}
STATS = {  # WorkerReplica.stats() of each replica that answers (d2 is still starting)
    "decode": [{"replica_id": "d1", "total_blocks": 100, "free_blocks": 75, "num_running": 3, "num_waiting": 2,
                "num_waiting_prompt_tokens": 40, "tokens_per_s": 12.5, "num_preemptions": 1}],
    "prefill": [{"replica_id": "p1", "total_blocks": 50, "free_blocks": 50, "num_running": 0, "num_waiting": 0,
                 "num_waiting_prompt_tokens": 0, "tokens_per_s": 0.0, "num_preemptions": 0}],
    "ingress": [2, 1],  # num_in_flight of each ingress replica
}


@pytest.fixture
def gathered(monkeypatch: pytest.MonkeyPatch) -> ClusterStatus:
    import router.serve_internals

    monkeypatch.setattr(router.serve_internals, "serve_instance_details", lambda: DETAILS)
    monkeypatch.setattr(status, "_broadcast", lambda deployment, app, method, timeout_s: STATS[deployment])
    return gather("10.0.0.1:6379", "kvserve")


def test_pools_come_ingress_first_with_sums_and_targets(gathered: ClusterStatus) -> None:
    assert [(p.name, p.role, p.status) for p in gathered.pools] == [
        ("ingress", "ingress", "HEALTHY"), ("decode", "decode", "HEALTHY"), ("prefill", "prefill", "UNHEALTHY")]
    ingress, decode, prefill = gathered.pools
    assert ingress.num_in_flight == 3 and ingress.autoscaling is None and ingress.kv_total_blocks is None
    assert (decode.num_running_replicas, decode.target_num_replicas) == (1, 2)
    assert (decode.kv_used_blocks, decode.kv_total_blocks, decode.num_running, decode.num_waiting) == (25, 100, 3, 2)
    assert decode.autoscaling == {"min_replicas": 1, "max_replicas": 4, "role": "decode", "target_waiting_per_replica": 4.0,
                                  "kv_usage_ceiling": 0.9, "scale_to_zero": False, "scaling_status": "STABLE"}
    assert prefill.message == "replica failed its health check"


def test_replicas_are_grouped_by_node_with_their_stats(gathered: ClusterStatus) -> None:
    nodes = gathered.to_dict()["nodes"]
    assert {node_id: [r["replica_id"] for r in n["replicas"]] for node_id, n in nodes.items()} == {
        "n1": ["i1"], "n2aaaaaaaaaa": ["d1", "p1"], "n3bbbbbbbbbb": ["d2"]}
    d1 = nodes["n2aaaaaaaaaa"]["replicas"][0]
    assert (d1["kv_used_blocks"], d1["kv_total_blocks"], d1["kv_usage"]) == (25, 100, 0.25)
    assert (d1["num_running"], d1["num_waiting"], d1["num_waiting_prompt_tokens"]) == (3, 2, 40)
    d2 = nodes["n3bbbbbbbbbb"]["replicas"][0]
    assert d2["state"] == "STARTING" and d2["kv_total_blocks"] is None  # no stats yet: shown as unknown
    json.dumps(gathered.to_dict())  # JSON-ready as it is


def test_the_table(gathered: ClusterStatus) -> None:
    lines = render(gathered).splitlines()
    assert lines[0] == "app 'kvserve': RUNNING (Ray cluster at 10.0.0.1:6379)"
    header = lines[2].split()
    assert header[:4] == ["POOL", "ROLE", "STATUS", "REPLICAS"]
    decode = next(line for line in lines if line.startswith("decode "))
    assert "1/2" in decode and "25/100 (25.0%)" in decode
    assert "1..4 replicas, role=decode, target_waiting_per_replica=4.0" in decode and decode.endswith("STABLE")
    assert any(line.startswith("ingress ") and line.rstrip().endswith("fixed") for line in lines)
    d1 = next(line for line in lines if " d1 " in line)
    assert d1.startswith("10.0.0.2 (n2aaaaaa)") and "12.5" in d1
    assert lines[-1] == "prefill: replica failed its health check"


def test_no_app_by_that_name_says_which_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    import router.serve_internals

    monkeypatch.setattr(router.serve_internals, "serve_instance_details", lambda: DETAILS)
    with pytest.raises(StatusError, match=r"no application 'other'.*applications: kvserve"):
        gather("a:1", "other")


def test_the_cluster_is_the_flag_else_the_running_local_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "local_cluster.json"
    monkeypatch.setattr(local_ray, "local_cluster_record_path", lambda: record)
    assert resolve_target("10.1.2.3:6379", None) == ("10.1.2.3:6379", "kvserve")
    with pytest.raises(StatusError, match="would start a new cluster"):
        resolve_target("local", None)
    with pytest.raises(StatusError, match="pass --address"):
        resolve_target(None, None)  # nothing recorded

    path = local_ray.remember_local_cluster({"gcs_address": "127.0.0.1:61234"}, "my-app")
    assert path == record
    assert resolve_target(None, None) == ("127.0.0.1:61234", "my-app")
    assert resolve_target(None, "other") == ("127.0.0.1:61234", "other")
    local_ray.forget_local_cluster(path)
    assert not record.exists()

    # A record left by a `kvserve serve` that has exited is stale: its cluster went with it.
    record.write_text(json.dumps({"address": "127.0.0.1:1", "app_name": "x", "pid": _dead_pid()}))
    with pytest.raises(StatusError, match="pass --address"):
        resolve_target(None, None)


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_joining_by_address_uses_the_token_ray_wrote(tmp_path: Path) -> None:
    """`kvserve serve` runs Ray with token auth (Ray 2.60's default writes ~/.ray/auth_token);
    a driver joining by an explicit address must turn token mode on itself, or the GCS
    refuses it (InvalidAuthToken). An explicit RAY_AUTH_MODE always wins."""
    from cluster.local_ray import use_token_auth_if_available

    env: dict[str, str] = {}
    assert use_token_auth_if_available(env, home=tmp_path) is False and env == {}
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 64)
    assert use_token_auth_if_available(env, home=tmp_path) is True and env == {"RAY_AUTH_MODE": "token"}
    disabled = {"RAY_AUTH_MODE": "disabled"}
    assert use_token_auth_if_available(disabled, home=tmp_path) is False and disabled == {"RAY_AUTH_MODE": "disabled"}
    by_env = {"RAY_AUTH_TOKEN": "secret"}
    assert use_token_auth_if_available(by_env, home=tmp_path / "nowhere") is True and by_env["RAY_AUTH_MODE"] == "token"


def test_each_models_pools_are_shown_as_that_models(monkeypatch: pytest.MonkeyPatch) -> None:
    import router.serve_internals

    app = {"status": "RUNNING", "deployments": {
        "ingress": DETAILS["applications"]["kvserve"]["deployments"]["ingress"],
        "worker-chat": {"status": "HEALTHY", "target_num_replicas": 1, "deployment_config": {}, "replicas": [
            {"replica_id": "c1", "state": "RUNNING", "node_id": "n2", "node_ip": "10.0.0.2", "pid": 20}]},
        "decode-org-coder": DETAILS["applications"]["kvserve"]["deployments"]["decode"],
    }}
    stats = {"ingress": [1], "worker-chat": [{"replica_id": "c1", "total_blocks": 10, "free_blocks": 4}],
             "decode-org-coder": STATS["decode"]}
    monkeypatch.setattr(router.serve_internals, "serve_instance_details", lambda: {"applications": {"kvserve": app}})
    monkeypatch.setattr(status, "_broadcast", lambda deployment, app, method, timeout_s: stats[deployment])
    gathered = gather("10.0.0.1:6379", "kvserve")
    assert [(p.name, p.role, p.model) for p in gathered.pools] == [
        ("ingress", "ingress", ""), ("decode-org-coder", "decode", "org-coder"), ("worker-chat", "worker", "chat")]
    assert gathered.pools[2].kv_used_blocks == 6
    lines = render(gathered).splitlines()
    assert lines[2].split()[:4] == ["POOL", "ROLE", "MODEL", "STATUS"]
    assert next(line for line in lines if line.startswith("worker-chat ")).split()[1:3] == ["worker", "chat"]
