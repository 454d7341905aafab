"""`kvserve serve` end to end over gRPC (issue 30): TLS through Serve's own gRPC proxy
(router/frontend/grpc_api/proxy.py adds the TLS port to the proxy's server), the proxy's
message-size cap at the HTTP body cap, and a keyless local server answering a loopback
client. Runs `kvserve serve` as a process of its own with the embedded tiny model, as
tests/integration/test_local_cluster.py does.

Finding: nothing tested TLS through Serve's proxy; removing the servicer function's
`add_tls_port(server)` failed no test."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from router.frontend.grpc_api.client import KVServeClient, KVServeError
from tests.integration.conftest import free_port
from tests.integration.test_grpc_standard import _certificates
from tests.support.serve_process import kvserve_serve, short_ray_tmp

pytestmark = pytest.mark.integration

MAX_BODY_BYTES = 64 * 1024


def test_kvserve_serve_grpc_over_tls_through_serves_proxy(tmp_path: Path) -> None:
    certs = _certificates(tmp_path)
    ray_tmp = short_ray_tmp("kvtls-")
    port, grpc_port, tls_port = free_port(), free_port(), free_port()
    config = (
        "engine: {device: cpu, dtype: float32, num_threads: 1, num_blocks: 32}\n"
        "workers: {num_replicas: 1, num_cpus: 1, drain_timeout_s: 5}\n"
        f"ingress: {{num_cpus: 0.5, max_body_bytes: {MAX_BODY_BYTES}}}\n"
        f"grpc: {{tls_port: {tls_port}, tls_cert_file: {certs['server.crt']}, tls_key_file: {certs['server.key']}}}\n"
    )
    with kvserve_serve(tmp_path, config, port, grpc_port, ray_tmp, drop_env=("KVSERVE_API_KEYS",)) as served:
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
    assert "answers loopback clients only" in served.log()  # what serve told its user
    # TLS lives in Serve's gRPC proxy, so serve chose the proxies over direct ingress, and said why.
    assert "Serve's HTTP and gRPC proxies in front (direct ingress off: gRPC TLS" in served.log()
