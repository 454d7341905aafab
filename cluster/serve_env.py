"""How Ray Serve's own processes run under kvserve: the environment of the Serve controller,
the proxies it starts and every replica.

kvserve turns on Serve's throughput-optimized mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`,
Ray Serve 2.60): each replica runs its handlers and its handles' routers on the actor's
own event loop instead of a separate thread and loop per concern, deployment handles
talk gRPC instead of Ray actor calls, replica access logs are buffered and Serve's logs
stay out of stderr. Every request crosses the proxy, the ingress replica and a worker
replica; without the mode each of those hops pays a cross-thread hand-off and an actor
call, which at device speed costs more CPU than the engine's own step
(docs/architecture.md, "Rules that keep it fast"; `python -m benchmarks.hostpath
--serve-defaults` measures both).

The mode's variables are read when each Serve process imports Serve, so they have to be
in that process's environment from the start: the job's runtime env carries them to the
replicas, `controller_options` to the controller and, through it, to the proxies. The
driver process (`kvserve serve`, a test session, a benchmark) keeps Serve's defaults:
its handles are used from synchronous code, which the mode's single-loop routers refuse.

An operator who wants Serve's defaults sets RAY_SERVE_THROUGHPUT_OPTIMIZED=0 where
kvserve starts; each variable the mode sets can also be overridden on its own (for
example RAY_SERVE_LOG_TO_STDERR=1), since Serve reads an explicit value first.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

THROUGHPUT_OPTIMIZED_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
# The mode also turns on direct ingress, where every ingress replica opens HTTP and gRPC
# ports of its own for an HAProxy in front; kvserve serves through Serve's proxies (its
# gRPC TLS listener lives there), so it keeps direct ingress off unless asked
# (`DirectIngress` below).
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
# The variables of the mode an operator may set explicitly; passed on when set.
_MODE_OVERRIDES = (
    HAPROXY_ENV,
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT",
    "RAY_SERVE_LOG_TO_STDERR",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE",
)


@dataclass(frozen=True)
class DirectIngress:
    """Serve's direct ingress: HAProxy on the HTTP (and gRPC) port in place of Serve's
    proxies, forwarding each connection straight to an ingress replica, which serves HTTP
    and gRPC itself. A token's bytes then cross one Ray hop (worker replica -> ingress)
    instead of two, and no Python process copies the response a second time.

    HAProxy also listens on a stats and a Prometheus port, on every interface, and the head
    keeps a fallback Serve proxy (HAProxy's backup route while no ingress replica is up)
    on two more: each Serve instance on a machine needs ports of its own, or the second
    one cannot start.

    HAProxy's files (its config, an admin socket Serve creates with mode 666, its server
    state) default to /tmp/haproxy-serve/<node id>/, a directory every local user can
    enter: any of them could then drive HAProxy's admin socket (take backends down, point
    one at another address). `files_dir`, when set, puts them in that directory instead,
    which must be private to the user running Ray (`kvserve serve` creates one,
    `private_haproxy_dir`, for the cluster it starts; Serve adds the node's subdirectory).
    """

    stats_port: int = 8404
    metrics_port: int = 9101
    fallback_http_port: int = 8500
    fallback_grpc_port: int = 9500
    files_dir: str | None = None

    def env(self) -> dict[str, str]:
        env = {
            THROUGHPUT_OPTIMIZED_ENV: "1",  # direct ingress is part of Serve's throughput mode
            DIRECT_INGRESS_ENV: "1",
            HAPROXY_ENV: "1",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(self.stats_port),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(self.metrics_port),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(self.fallback_http_port),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(self.fallback_grpc_port),
        }
        if self.files_dir is not None:
            d = self.files_dir
            env.update({
                "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(d, "haproxy.cfg"),
                "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(d, "admin.sock"),
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(d, "metrics.sock"),
                "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
                "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(d, "server-state"),
            })
        return env


# HAProxy refuses a unix socket path over 97 characters, and Serve puts each node's
# sockets in a subdirectory named by the node's 56-character id: "/<id>/metrics.sock"
# leaves a directory of HAProxy's files 27 characters.
_HAPROXY_DIR_MAX_LEN = 97 - len("/" + "0" * 56 + "/metrics.sock")


def private_haproxy_dir() -> str:
    """A new directory for HAProxy's files that only this user can enter (mode 700), under
    the temporary directory, or /tmp where that path would be too long for its sockets."""
    for base in (tempfile.gettempdir(), "/tmp"):
        if len(os.path.join(base, "kvh-12345678")) <= _HAPROXY_DIR_MAX_LEN:
            return tempfile.mkdtemp(prefix="kvh-", dir=base)
    raise RuntimeError("no temporary directory short enough for HAProxy's socket paths")


def serve_process_env(environ: Mapping[str, str] = os.environ,
                      direct_ingress: DirectIngress | None = None) -> dict[str, str]:
    """The environment every Serve process (controller, proxies, replicas) starts with."""
    if direct_ingress is not None:
        return direct_ingress.env()
    env = {THROUGHPUT_OPTIMIZED_ENV: environ.get(THROUGHPUT_OPTIMIZED_ENV, "1"),
           DIRECT_INGRESS_ENV: environ.get(DIRECT_INGRESS_ENV, "0")}
    env.update({name: environ[name] for name in _MODE_OVERRIDES if name in environ})
    return env


def job_runtime_env(env_vars: Mapping[str, str] | None = None,
                    environ: Mapping[str, str] = os.environ,
                    direct_ingress: DirectIngress | None = None) -> dict[str, Any]:
    """`ray.init(runtime_env=...)` for a driver that starts Serve: the replicas' environment
    (Serve's mode plus `env_vars`, which win)."""
    return {"env_vars": {**serve_process_env(environ, direct_ingress), **(env_vars or {})}}


def controller_options(environ: Mapping[str, str] = os.environ,
                       direct_ingress: DirectIngress | None = None) -> dict[str, Any]:
    """`serve.start(controller_options=...)`: the controller's environment, which the proxies
    (or HAProxy's manager) it starts inherit."""
    return {"runtime_env": {"env_vars": serve_process_env(environ, direct_ingress)}}
