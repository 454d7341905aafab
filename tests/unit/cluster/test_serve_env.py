"""The environment kvserve gives Ray Serve's processes (cluster/serve_env.py)."""
from __future__ import annotations

from cluster.serve_env import DIRECT_INGRESS_ENV, THROUGHPUT_OPTIMIZED_ENV, controller_options, job_runtime_env, serve_process_env


def test_throughput_optimized_by_default() -> None:
    assert serve_process_env({}) == {THROUGHPUT_OPTIMIZED_ENV: "1", DIRECT_INGRESS_ENV: "0"}


def test_an_operators_explicit_choice_wins() -> None:
    environ = {THROUGHPUT_OPTIMIZED_ENV: "0", DIRECT_INGRESS_ENV: "1", "RAY_SERVE_LOG_TO_STDERR": "1", "UNRELATED": "x"}
    assert serve_process_env(environ) == {THROUGHPUT_OPTIMIZED_ENV: "0", DIRECT_INGRESS_ENV: "1",
                                          "RAY_SERVE_LOG_TO_STDERR": "1"}


def test_job_and_controller_carry_the_same_mode() -> None:
    job = job_runtime_env({"PYTHONPATH": "/src"}, environ={})
    mode = {THROUGHPUT_OPTIMIZED_ENV: "1", DIRECT_INGRESS_ENV: "0"}
    assert job == {"env_vars": {**mode, "PYTHONPATH": "/src"}}
    assert controller_options({}) == {"runtime_env": {"env_vars": mode}}
    # The caller's own variables win over the mode's.
    assert job_runtime_env({THROUGHPUT_OPTIMIZED_ENV: "0"}, environ={})["env_vars"][THROUGHPUT_OPTIMIZED_ENV] == "0"


def test_direct_ingress_gives_haproxy_its_ports() -> None:
    from cluster.serve_env import DirectIngress

    env = serve_process_env({DIRECT_INGRESS_ENV: "0"}, DirectIngress(18404, 19101))
    assert env == {
        THROUGHPUT_OPTIMIZED_ENV: "1", DIRECT_INGRESS_ENV: "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_STATS_PORT": "18404", "RAY_SERVE_HAPROXY_METRICS_PORT": "19101",
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": "8500", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": "9500",
    }
    assert controller_options({}, DirectIngress())["runtime_env"]["env_vars"][DIRECT_INGRESS_ENV] == "1"
    assert job_runtime_env({"PYTHONPATH": "/src"}, {}, DirectIngress())["env_vars"]["PYTHONPATH"] == "/src"


def test_direct_ingress_puts_haproxys_files_in_the_directory_given() -> None:
    from cluster.serve_env import DirectIngress

    env = DirectIngress(files_dir="/run/kv").env()
    assert {k: v for k, v in env.items() if "HAPROXY" in k and "PORT" not in k and k != "RAY_SERVE_ENABLE_HA_PROXY"} == {
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "/run/kv/haproxy.cfg",
        "RAY_SERVE_HAPROXY_SOCKET_PATH": "/run/kv/admin.sock",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "/run/kv/metrics.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "/run/kv",
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "/run/kv/server-state",
    }
    assert not any("SOCKET" in k for k in DirectIngress().env())  # Serve's defaults: a cluster kvserve did not start


def test_serve_direct_ingress_flag_and_config() -> None:
    import argparse

    import pytest

    from cluster.cli import config_from_args, register_serve
    from cluster.serve_exposure import direct_ingress
    from cluster.config import ConfigError, KVServeConfig

    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    config = config_from_args(parser.parse_args(["serve", "--direct-ingress"]))
    assert config.http.direct_ingress
    direct = direct_ingress(config)
    assert direct is not None and (direct.stats_port, direct.metrics_port) == (8404, 9101)
    assert direct_ingress(KVServeConfig()) is None
    with pytest.raises(ConfigError, match="gRPC TLS"):
        KVServeConfig.from_dict({"http": {"direct_ingress": True},
                                 "grpc": {"tls_port": 9443, "tls_cert_file": "c.pem", "tls_key_file": "k.pem"}})



def test_the_private_haproxy_directory_is_ours_alone_and_short_enough(tmp_path, monkeypatch) -> None:
    import os
    import tempfile

    from cluster.serve_env import private_haproxy_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / ("t" * 40)))  # too long: /tmp instead
    d = private_haproxy_dir()
    try:
        assert os.path.dirname(d) == "/tmp" and os.stat(d).st_mode & 0o777 == 0o700
        assert len(os.path.join(d, "0" * 56, "metrics.sock")) <= 97  # HAProxy's socket path limit
    finally:
        os.rmdir(d)
    short = tempfile.mkdtemp(prefix="k", dir="/tmp")  # 14 characters: short enough, used as given
    monkeypatch.setattr("tempfile.tempdir", short)
    try:
        d = private_haproxy_dir()
        assert os.path.dirname(d) == short and os.stat(d).st_mode & 0o777 == 0o700
        os.rmdir(d)
    finally:
        os.rmdir(short)
