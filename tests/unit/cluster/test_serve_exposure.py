"""`kvserve serve` listens on loopback only by default (HTTP); what it says otherwise
(cluster/serve_exposure.py)."""
from __future__ import annotations

import pytest

from cluster.cli import build_parser, config_from_args
from cluster.config import ConfigError, KVServeConfig
from cluster.serve_exposure import direct_ingress, endpoint_lines, listen_warnings


def test_http_binds_loopback_by_default() -> None:
    args = build_parser().parse_args(["serve"])
    config = config_from_args(args)
    assert config.http.host == "127.0.0.1"
    assert KVServeConfig().http.host == "127.0.0.1"
    assert not args.no_grpc


def test_host_flag_is_the_way_out() -> None:
    config = config_from_args(build_parser().parse_args(["serve", "--host", "0.0.0.0", "--no-grpc"]))
    assert config.http.host == "0.0.0.0"
    warnings = listen_warnings(config.with_overrides({"grpc.enabled": False}), environ={})
    assert len(warnings) == 1 and "0.0.0.0:8000" in warnings[0] and "no API keys" in warnings[0]
    assert "no API keys" not in listen_warnings(config.with_overrides({"grpc.enabled": False}),
                                                environ={"KVSERVE_API_KEYS": "k"})[0]


def test_grpc_all_interfaces_is_announced() -> None:
    config = KVServeConfig()
    [warning] = listen_warnings(config, environ={"KVSERVE_API_KEYS": "k"})  # keys: open beyond loopback
    assert "every interface" in warning and "--no-grpc" in warning
    assert listen_warnings(config.with_overrides({"grpc.enabled": False}), environ={}) == []


def test_grpc_without_tls_is_announced_and_tls_names_its_port() -> None:
    [warning] = listen_warnings(KVServeConfig().with_overrides({"grpc.public": True}), environ={})
    assert "without TLS" in warning and "grpc.tls_port" in warning
    tls = KVServeConfig().with_overrides({"grpc.tls_port": 9443, "grpc.tls_cert_file": "/c.pem", "grpc.tls_key_file": "/k.pem"})
    [warning] = listen_warnings(tls, environ={"KVSERVE_API_KEYS": "k"})
    assert "without TLS" in warning and "TLS clients should use port 9443" in warning


def test_grpc_tls_settings_become_the_proxy_environment() -> None:
    import pytest

    from cluster.config_errors import ConfigError
    from router.frontend.grpc_api.tls import TLSConfig

    config = KVServeConfig().with_overrides({
        "grpc.tls_port": 9443, "grpc.tls_cert_file": "/c.pem", "grpc.tls_key_file": "/k.pem", "grpc.tls_client_ca_file": "/ca.pem",
    })
    assert TLSConfig.from_env(config.grpc.tls_env) == TLSConfig(9443, "/c.pem", "/k.pem", "/ca.pem")
    assert KVServeConfig().grpc.tls_env == {}
    for bad in ({"grpc.tls_port": 9443}, {"grpc.tls_cert_file": "/c.pem"},
                {"grpc.tls_port": 9000, "grpc.tls_cert_file": "/c", "grpc.tls_key_file": "/k"}):
        with pytest.raises((ConfigError, ValueError)):
            KVServeConfig().with_overrides(bad)


_NO_HAPROXY = {"RAY_SERVE_HAPROXY_BINARY_PATH": "/nonexistent/haproxy"}


def test_direct_ingress_is_the_default_where_it_can_run() -> None:
    from cluster.serve_exposure import direct_ingress_off_reason

    config = KVServeConfig()
    assert direct_ingress_off_reason(config, environ={}) is None
    assert direct_ingress(config, environ={}) is not None
    assert direct_ingress(config.with_overrides({"http.direct_ingress": False}), environ={}) is None
    # Each reason falls back to Serve's proxies when left to kvserve, and is an error when insisted on.
    tls = {"grpc.tls_port": 9443, "grpc.tls_cert_file": "/c.pem", "grpc.tls_key_file": "/k.pem"}
    cases = [(config.with_overrides(tls), {}, True, "gRPC TLS"),
             (config.with_overrides({"http.host": "0.0.0.0"}), {}, True, "no API keys"),
             (config, _NO_HAPROXY, True, "no HAProxy binary"),
             (config, {}, False, "existing Ray cluster")]
    for case, environ, starts_cluster, reason in cases:
        assert reason in direct_ingress_off_reason(case, environ, starts_cluster)
        assert direct_ingress(case, environ, starts_cluster) is None
        insisted = {**case.model_dump(), "http": {**case.http.model_dump(), "direct_ingress": True}}
        if reason == "gRPC TLS":  # refused by the config itself
            with pytest.raises(ConfigError, match=reason):
                KVServeConfig.from_dict(insisted)
            continue
        if reason == "existing Ray cluster":  # the operator's explicit choice on such a cluster
            assert direct_ingress(KVServeConfig.from_dict(insisted), environ, starts_cluster) is not None
            continue
        with pytest.raises(ConfigError, match=reason):
            direct_ingress(KVServeConfig.from_dict(insisted), environ, starts_cluster)


def test_direct_ingress_refuses_an_open_grpc_port_without_keys() -> None:
    public_host = KVServeConfig.from_dict({"http": {"direct_ingress": True, "host": "0.0.0.0"}})
    with pytest.raises(ConfigError, match="no API keys"):
        direct_ingress(public_host, environ={})
    keys = {public_host.ingress.api_keys_env: "sk-one"}
    direct = direct_ingress(public_host, environ=keys)
    assert direct is not None
    warnings = listen_warnings(public_host, direct, keys)
    assert any("gRPC listens on 0.0.0.0" in line for line in warnings)
    assert any("stats (:8404) and Prometheus (:9101) listeners bind every interface" in line for line in warnings)
    local = KVServeConfig()
    assert not [line for line in listen_warnings(local, direct_ingress(local, environ={}), {}) if "gRPC" in line]


def test_endpoint_lines_name_every_listener() -> None:
    from dataclasses import replace

    config = KVServeConfig().with_overrides({"route_prefix": "/app"})
    http, front, grpc = endpoint_lines(config, None, "no HAProxy binary")
    assert http == f"HTTP (OpenAI API) on http://127.0.0.1:{config.http.port}/app/v1"
    assert front == "Serve's HTTP and gRPC proxies in front (direct ingress off: no HAProxy binary)"
    assert grpc.startswith(f"gRPC on [::]:{config.grpc.port} ")  # Serve's proxy: every interface
    assert endpoint_lines(config, None)[1].endswith("(direct ingress off: http.direct_ingress is false)")
    assert endpoint_lines(config.with_overrides({"grpc.enabled": False}), None)[2:] == ["gRPC off"]
    tls = config.with_overrides({"grpc.tls_port": 9443, "grpc.tls_cert_file": "/c.pem", "grpc.tls_key_file": "/k.pem"})
    assert endpoint_lines(tls, None)[-1] == "gRPC TLS on [::]:9443"
    direct = direct_ingress(config, environ={})
    _, haproxy, grpc = endpoint_lines(config, direct)
    assert "stats on *:8404" in haproxy and grpc.startswith(f"gRPC on 127.0.0.1:{config.grpc.port} ")  # HAProxy: the HTTP host
    _, haproxy, _ = endpoint_lines(config, replace(direct, launcher="/run/kv/haproxy"))
    assert "stats on 127.0.0.1:8404, Prometheus on 127.0.0.1:9101" in haproxy
