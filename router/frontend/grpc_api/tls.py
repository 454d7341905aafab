"""TLS and mutual TLS for the gRPC API, on a port of its own in Serve's gRPC proxy.

Ray Serve 2.60's gRPC proxy has no TLS option: start_grpc_server binds [::]:port with
`add_insecure_port` (ray/serve/_private/grpc_util.py, `add_grpc_address`), and
gRPCOptions has no credentials field. kvserve's servicer function runs on that server
before it starts, so it adds a second, TLS port to the same server (the same handlers,
the same routing), configured from the environment of the node the proxy runs on:

    KVSERVE_GRPC_TLS_PORT        the TLS port (unset: no TLS port)
    KVSERVE_GRPC_TLS_CERT_FILE        PEM certificate chain file
    KVSERVE_GRPC_TLS_KEY_FILE         PEM private key file
    KVSERVE_GRPC_TLS_CLIENT_CA_FILE   PEM CA bundle file: set -> mutual TLS (clients must
                                 present a certificate it signed)

`kvserve serve` exports them from the config's grpc section before it starts a local
cluster; the Helm chart sets them on the Ray pods from a Secret. Serve's plaintext port
stays open (Serve always binds it): keep it off the network (a NetworkPolicy, a firewall),
or terminate TLS in front of it (an ingress controller or a sidecar) instead.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PORT_ENV = "KVSERVE_GRPC_TLS_PORT"
CERT_ENV = "KVSERVE_GRPC_TLS_CERT_FILE"
KEY_ENV = "KVSERVE_GRPC_TLS_KEY_FILE"
CLIENT_CA_ENV = "KVSERVE_GRPC_TLS_CLIENT_CA_FILE"


@dataclass(frozen=True)
class TLSConfig:
    port: int
    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set: mutual TLS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TLSConfig | None:
        env = os.environ if environ is None else environ
        port = env.get(PORT_ENV, "").strip()
        if not port:
            return None
        cert, key = env.get(CERT_ENV, "").strip(), env.get(KEY_ENV, "").strip()
        if not cert or not key:
            raise ValueError(f"{PORT_ENV} is set but {CERT_ENV} and {KEY_ENV} are not both set")
        return cls(int(port), cert, key, env.get(CLIENT_CA_ENV, "").strip() or None)

    def to_env(self) -> dict[str, str]:
        env = {PORT_ENV: str(self.port), CERT_ENV: self.cert_file, KEY_ENV: self.key_file}
        if self.client_ca_file:
            env[CLIENT_CA_ENV] = self.client_ca_file
        return env

    def credentials(self) -> Any:
        import grpc

        client_ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


def add_tls_port(server: Any, config: TLSConfig | None = None) -> int | None:
    """Adds the TLS port to a not yet started grpc server when TLS is configured (the
    environment, unless `config` is given); returns the bound port. A configuration that
    cannot be loaded fails the proxy's start loudly rather than serving without TLS."""
    config = config if config is not None else TLSConfig.from_env()
    if config is None:
        return None
    port = server.add_secure_port(f"[::]:{config.port}", config.credentials())
    logger.info("gRPC TLS on [::]:%d (%s)", port, "mutual TLS" if config.client_ca_file else "server TLS")
    return port
