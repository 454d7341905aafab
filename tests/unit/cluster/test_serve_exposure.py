"""`kvserve serve` listens on loopback only by default (HTTP); what it says otherwise."""
from __future__ import annotations

from cluster.cli import build_parser, config_from_args, listen_warnings
from cluster.config import KVServeConfig


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
    from router.frontend.grpc_tls import TLSConfig

    config = KVServeConfig().with_overrides({
        "grpc.tls_port": 9443, "grpc.tls_cert_file": "/c.pem", "grpc.tls_key_file": "/k.pem", "grpc.tls_client_ca_file": "/ca.pem",
    })
    assert TLSConfig.from_env(config.grpc.tls_env) == TLSConfig(9443, "/c.pem", "/k.pem", "/ca.pem")
    assert KVServeConfig().grpc.tls_env == {}
    for bad in ({"grpc.tls_port": 9443}, {"grpc.tls_cert_file": "/c.pem"},
                {"grpc.tls_port": 9000, "grpc.tls_cert_file": "/c", "grpc.tls_key_file": "/k"}):
        with pytest.raises((ConfigError, ValueError)):
            KVServeConfig().with_overrides(bad)
