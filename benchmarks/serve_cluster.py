"""The Ray cluster and Serve instance a benchmark starts for itself, started and stopped
the same way by every benchmark that drives real Serve replicas (router, tenants, soak).

The cluster is always a NEW one and keeps Ray's traffic on loopback
(cluster/local_ray.py), with Ray's token auth off: it is private to this process, on
this machine. Its replicas import kvserve from this checkout (PYTHONPATH), so a source
tree runs without an install. Serve's HTTP proxy listens on loopback at a free port.

    port = serve_cluster.start()
    try:
        serve.run(build_app(config), name=..., route_prefix=...)
        ...
    finally:
        serve_cluster.stop()
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
# Logical CPUs of the cluster: scheduling units for the replicas (which ask for fractions),
# not cores; enough for every benchmark's replicas on a small machine.
NUM_CPUS = 8


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start(env_vars: Mapping[str, str] | None = None, throughput_mode: bool = True) -> int:
    """Ray and Serve, ready for `serve.run`; returns the HTTP proxy's port. `env_vars` join
    every replica's environment. `throughput_mode`: Serve's processes run as `kvserve serve`
    runs them (cluster/serve_env.py); False leaves Serve's own defaults."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # read by ray.init, for this driver
    from ray import serve
    from ray.serve.config import HTTPOptions

    from cluster.local_ray import start_local_ray
    from cluster.serve_env import controller_options, job_runtime_env

    env = {"PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", **(env_vars or {})}
    start_local_ray(num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False,
                    runtime_env=job_runtime_env(env) if throughput_mode else {"env_vars": env})
    port = free_port()
    try:
        serve.start(http_options=HTTPOptions(host=HOST, port=port),
                    controller_options=controller_options() if throughput_mode else None)
    except BaseException:
        stop()
        raise
    return port


def stop() -> None:
    """Serve's applications and actors, then Ray itself."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
