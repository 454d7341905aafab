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
    [warning] = listen_warnings(config, environ={})
    assert "every interface" in warning and "--no-grpc" in warning
    assert listen_warnings(config.with_overrides({"grpc.enabled": False}), environ={}) == []
