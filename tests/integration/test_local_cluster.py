"""`kvserve serve` without --address starts a local Ray cluster of its own, on loopback.

Ray's `ray_current_cluster` file names the last cluster started on the machine (by
`ray start`, a test cluster, ...). Here it names a dead one, in a Ray temp directory of
this test's own ($RAY_TMPDIR, so that no other Ray user of the machine is disturbed), and
$RAY_ADDRESS is unset: serve must ignore the file and come up. Then every TCP socket that
serve's process tree listens on is on loopback, HAProxy's stats and Prometheus listeners
included (direct ingress, the default), except Serve's gRPC proxy (the fallback proxy's
gRPC port behind HAProxy) and each Serve replica's inter-deployment gRPC server, which bind
every interface (Serve 2.60 has no host option for either; docs/security.md "Listening
addresses and ports").

Does not use the session cluster: serve runs as its own process.
"""
from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import free_port
from tests.support.serve_process import kvserve_serve, short_ray_tmp
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration



def _listening(root: psutil.Process) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP listening socket of `root` and its descendants."""
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((conn.laddr.ip, conn.laddr.port, proc.name()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_serve_ignores_a_stale_cluster_file_and_listens_on_loopback(tmp_path: Path) -> None:
    ray_tmp = short_ray_tmp("kvlc-")
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")  # nothing listens there
    port, grpc_port = free_port(), free_port()
    config = (
        "engine: {device: cpu, dtype: float32, num_threads: 1, num_blocks: 32}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 5}\n"
        "ingress: {num_cpus: 0.5}\n"
    )
    with kvserve_serve(tmp_path, config, port, grpc_port, ray_tmp) as served:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "kvserve-tiny", "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        sockets = _listening(psutil.Process(served.proc.pid))
        assert any(p == port and name == "haproxy" for _, p, name in sockets), sockets  # direct ingress
        banner = re.compile(r"stats on 127\.0\.0\.1:(\d+), Prometheus on 127\.0\.0\.1:(\d+), "
                            r"fallback proxy on (\d+) and (\d+)")
        # HAProxy may answer before `serve.run` returns in serve's process and it prints the banner.
        wait_until(lambda: banner.search(served.log()) is not None, 60, interval_s=0.2,
                   message="serve's banner naming HAProxy's ports")
        stats, metrics, _, fallback_grpc = (int(p) for p in banner.search(served.log()).groups())
        assert {stats, metrics} <= {p for _, p, name in sockets if name == "haproxy"}, sockets
        # Serve's own exceptions, which no Ray setting moves: its gRPC proxy, and each
        # replica's inter-deployment gRPC server (replica.py binds "[::]:0").
        exposed = [s for s in sockets if not _is_loopback(s[0]) and s[1] != fallback_grpc
                   and not s[2].startswith("ray::ServeReplica")]
        assert not exposed, f"listening beyond loopback: {exposed}"
        assert "127.0.0.1:1" not in served.log()
