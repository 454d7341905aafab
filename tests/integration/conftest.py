"""One local Ray cluster + Serve instance for the whole integration session.

Every integration test shares it (a cold start costs ~10 s and ~1.3 GB); tests deploy
their own applications under distinct names and delete them when done.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

# Tests only: Ray 2.60 turns token auth on by default. Must be set before Ray starts.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray's own traffic on loopback (cluster/local_ray.py); read when Ray is first imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Faster stats for routing/autoscaling tests (read when Serve starts).
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServeCluster:
    http_port: int
    grpc_port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[ServeCluster]:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions

    http_port, grpc_port = free_port(), free_port()
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cluster.local_ray import start_local_ray
    from cluster.serve_env import controller_options, job_runtime_env

    # A new cluster of its own (never one that ray_current_cluster names), on loopback only.
    start_local_ray(
        num_cpus=8,  # logical CPUs: replicas ask for fractions; 2 real cores do the work
        # What a Helm chart pool's pods (one unit per GPU there) and ingress-group pods (one
        # each) advertise: the chart pins worker and ingress replicas to them, and
        # tests/integration/test_helm_serveconfig.py deploys the chart's rendered config as it is.
        resources={"kvserve_pool_mixed": 4, "kvserve_ingress": 4},
        include_dashboard=False,
        # Serve's processes run as `kvserve serve` runs them (cluster/serve_env.py), but for
        # one thing: each replica writes every log line at once, not in batches of Serve's
        # throughput mode, so that a test that reads the logs sees what was logged.
        runtime_env=job_runtime_env({"PYTHONPATH": repo_root, "RAY_AUTH_MODE": "disabled",
                                     "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1"}),
        log_to_driver=False,
    )
    # The gRPC servicer function `kvserve serve` registers.
    from cluster.app import grpc_servicer

    serve.start(
        http_options=HTTPOptions(host="127.0.0.1", port=http_port),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[grpc_servicer()]),
        controller_options=controller_options(),
    )
    try:
        yield ServeCluster(http_port, grpc_port)
    finally:
        serve.shutdown()
        ray.shutdown()
