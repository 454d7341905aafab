"""One multi-node Ray cluster on this machine (ray.cluster_utils.Cluster) for the tests in
tests/multinode, shaped as on Kubernetes:

    head      num_cpus 0 (as KubeRay advises): GCS, Serve controller, a proxy on http_port
    ingress   CPU node, advertises kvserve_ingress: the ingress replicas, a proxy
    gpu-a/-b  "GPU hosts": num_gpus 2 (without CUDA: the engine runs on CPU), the pool's
              resource kvserve_pool_mixed 1 (one mixed worker replica each),
              kvserve_pool_tp 1 (one tensor-parallel rank's worth, never a group) and
              kvserve_host_<name> (tests pin a replica to one host with it)

Every node is 127.0.0.1 (Ray's loopback switch, cluster/local_ray.py), so the Serve proxy
each node runs gets a port of its own (RAY_SERVE_WORKER_PROXY_HTTP_PORT, read by the
proxy from its node's environment): a client can connect to the proxy on a given node.
Tests add and remove hosts (`remove_host` kills every process of a node at once, its Ray
workers included: the way a host is lost here) and leave the cluster as they found it.

This session must not share a process with tests/integration (a driver connects to one
cluster): scripts/test.sh runs `pytest tests/multinode` as its own invocation, and the
root conftest leaves this directory out of a plain `pytest tests/` run.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from cluster.serve_env import controller_options, job_runtime_env
from tests.support.redis_server import REDIS_SERVER, RedisServer

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # tests only
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node on 127.0.0.1 (read at import)
# A lost node is declared dead after ~3 missed 1 s health checks, not Ray's default ~30 s
# (the GCS reads these when it starts).
os.environ.setdefault("RAY_health_check_period_ms", "1000")
os.environ.setdefault("RAY_health_check_timeout_ms", "1000")
os.environ.setdefault("RAY_health_check_failure_threshold", "3")
# A node's agents may take long to come up on a loaded 2-core machine; the raylet otherwise
# aborts its start-up when they have not registered within its default wait.
os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
# What KubeRay sets on every pod when GCS fault tolerance is on: raylets and workers wait
# this long for a restarting GCS (Ray's default, 60 s, ends them during a slow restart).
os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "600")

REPO_ROOT = Path(__file__).resolve().parents[2]
INGRESS_RESOURCE = "kvserve_ingress"
MIXED_POOL = "kvserve_pool_mixed"
_PROXY_PORT_ENV = "RAY_SERVE_WORKER_PROXY_HTTP_PORT"


# Proxy ports come from below Linux's ephemeral range (32768+) and above Ray's worker ports
# (10002-19999). A port is picked when a host is added but bound only when Serve starts a
# proxy there, minutes later: one picked from the ephemeral range (bind to port 0) can be
# handed to any other socket meanwhile, and Ray's own servers bind port 0. A reference
# stream once read "RemoteProtocolError: illegal request line" from a node's proxy port
# (not reproduced; the likely cause).
_PORTS = itertools.count(20_000 + os.getpid() % 1_000 * 10)


def free_port() -> int:
    for port in _PORTS:
        if port >= 32_768:
            break
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass
class Host:
    name: str
    node: Any  # ray._private.node.Node
    proxy_port: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return str(self.node.node_id)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"


class MultiNodeCluster:
    def __init__(self, cluster: Any, http_port: int, gcs_fault_tolerant: bool = False) -> None:
        self.cluster = cluster
        self.http_port = http_port
        self.gcs_fault_tolerant = gcs_fault_tolerant
        self.hosts: dict[str, Host] = {}

    @property
    def head_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def add_host(self, name: str, num_cpus: float = 2, num_gpus: float = 0,
                 resources: dict[str, float] | None = None, proxy_port: int | None = None) -> Host:
        """A node advertising `resources` plus kvserve_host_<name>: 1; its Serve proxy (if
        Serve starts one there) on `proxy_port`."""
        assert name not in self.hosts, name
        port = proxy_port or free_port()
        args = {"num_cpus": num_cpus, "num_gpus": num_gpus,
                "resources": {**(resources or {}), f"kvserve_host_{name}": 1}}
        with _env(**{_PROXY_PORT_ENV: str(port)}):  # the raylet and its workers inherit it
            node = self.cluster.add_node(**args, object_store_memory=80 * 1024**2)
        host = Host(name, node, port, args)
        self.hosts[name] = host
        return host

    def remove_host(self, name: str) -> Host:
        """Lose the host: every process of the node is killed at once (no graceful shutdown).

        The node's Ray workers (replicas, its proxy) are SIGKILLed with the node's own
        processes: remove_node kills only the latter, and a worker outlived its raylet by
        up to ~2 s, long enough to finish the streams a "lost" host was serving."""
        host = self.hosts.pop(name)
        workers = _worker_processes(host.node)
        for process in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.cluster.remove_node(host.node, allow_graceful=False)
        psutil.wait_procs(workers, timeout=10)
        return host

    def readd_host(self, lost: Host) -> Host:
        """A new node with the lost one's resources (what the autoscaler would bring)."""
        return self.add_host(lost.name, lost.args["num_cpus"], lost.args["num_gpus"],
                             {k: v for k, v in lost.args["resources"].items() if not k.startswith("kvserve_host_")},
                             proxy_port=lost.proxy_port)

    def host_of(self, node_id: str) -> Host | None:
        return next((h for h in self.hosts.values() if h.node_id == node_id), None)


def _worker_processes(node: Any) -> list[psutil.Process]:
    """The node's Ray workers: every process its raylet started (and theirs)."""
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    return psutil.Process(raylet.pid).children(recursive=True)


@contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def multinode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeCluster]:
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.config import HTTPOptions

    from cluster.local_ray import ray_is_on_loopback

    if ray.is_initialized():
        pytest.fail("tests/multinode needs a pytest invocation of its own (this one is already "
                    "connected to another Ray cluster): `pytest tests/multinode`")
    assert ray_is_on_loopback(), "Ray was imported before tests/multinode/conftest.py set its loopback switch"
    # A Ray temp dir of our own: Cluster writes ray_current_cluster there, not in /tmp/ray
    # where other Ray users of this machine would find it. Short: it holds unix sockets.
    ray_tmp = tempfile.mkdtemp(prefix="kvmn-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = ray_tmp
    # GCS fault tolerance as the chart's gcsFaultTolerance sets it up: the GCS keeps its
    # tables in an external Redis (RAY_REDIS_ADDRESS, read by the head node when it
    # starts), so a restarted GCS finds the cluster as it was (test_zz_gcs_restart.py).
    with contextlib.ExitStack() as cleanup:
        redis = None
        if REDIS_SERVER is not None:
            redis = RedisServer(tmp_path_factory.mktemp("gcs-redis"))
            redis.start()
            cleanup.callback(redis.stop)
            os.environ["RAY_REDIS_ADDRESS"] = f"127.0.0.1:{redis.port}"
            os.environ["RAY_external_storage_namespace"] = "kvserve-multinode"
        try:
            cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
                "num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 * 1024**2,
            })
        finally:
            os.environ.pop("RAY_REDIS_ADDRESS", None)  # only the head reads it
        cleanup.callback(cluster.shutdown)
        mn = MultiNodeCluster(cluster, free_port(), gcs_fault_tolerant=redis is not None)
        mn.add_host("ingress", num_cpus=2, resources={INGRESS_RESOURCE: 2})
        for name in ("a", "b"):
            # One rank's worth of the TP pool too: test_tensor_parallel checks that a TP
            # group is never split over a and b.
            mn.add_host(name, num_cpus=2, num_gpus=2, resources={MIXED_POOL: 1, "kvserve_pool_tp": 1})
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env=job_runtime_env({"PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled"}))
        cleanup.callback(ray.shutdown)
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=mn.http_port), controller_options=controller_options())
        cleanup.callback(serve.shutdown)
        yield mn


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_served_model import make_served_model

    return make_served_model(tmp_path_factory.mktemp("multinode") / "tiny")

