"""`kvserve serve` end to end over gRPC (issue 30): TLS through Serve's own gRPC proxy
(router/frontend/grpc_proxy.py adds the TLS port to the proxy's server), the proxy's
message-size cap at the HTTP body cap, and a keyless local server answering a loopback
client. Runs `kvserve serve` as a process of its own with the embedded tiny model, as
tests/integration/test_local_cluster.py does.

Finding: nothing tested TLS through Serve's proxy; removing the servicer function's
`add_tls_port(server)` failed no test."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import httpx
import pytest

from router.frontend.client import KVServeClient, KVServeError
from tests.integration.conftest import free_port
from tests.integration.test_grpc_standard import _certificates
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_BODY_BYTES = 64 * 1024


def test_kvserve_serve_grpc_over_tls_through_serves_proxy(tmp_path: Path) -> None:
    certs = _certificates(tmp_path)
    ray_tmp = Path(tempfile.mkdtemp(prefix="kvtls-", dir="/tmp"))  # short: Ray's unix socket paths
    port, grpc_port, tls_port = free_port(), free_port(), free_port()
    config = tmp_path / "kvserve.yaml"
    config.write_text(
        "engine: {device: cpu, dtype: float32, num_threads: 1, num_blocks: 32}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 5}\n"
        f"ingress: {{num_cpus: 0.5, max_body_bytes: {MAX_BODY_BYTES}}}\n"
        f"grpc: {{tls_port: {tls_port}, tls_cert_file: {certs['server.crt']}, tls_key_file: {certs['server.key']}}}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp)}
    for name in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "KVSERVE_API_KEYS"):
        env.pop(name, None)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config), "--port", str(port),
             "--grpc-port", str(grpc_port), "--num-cpus", "2"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            def healthy() -> bool:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200

            wait_until(healthy, 240, interval_s=1.0, message="kvserve serve to come up", retry_on=(httpx.TransportError,))
            creds = grpc.ssl_channel_credentials(certs["ca.crt"].read_bytes())
            with grpc.secure_channel(f"localhost:{tls_port}", creds) as channel:
                client = KVServeClient(f"localhost:{tls_port}", channel=channel, timeout=60)
                reply = client.generate("Hi", max_tokens=3, temperature=0.0)
                assert len(reply.token_ids) == 3 and reply.usage.completion_tokens == 3
                # Over the cap: refused by grpc in the proxy itself, before any replica.
                with pytest.raises(KVServeError) as info:
                    client.generate("x" * (MAX_BODY_BYTES + 1024), max_tokens=1)
                assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            # The plaintext port answers this loopback client (no keys: loopback only).
            with KVServeClient(f"127.0.0.1:{grpc_port}", timeout=60) as plain:
                assert len(plain.generate("Hi", max_tokens=1).token_ids) == 1
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
    assert "answers loopback clients only" in log_path.read_text()  # what serve told its user
