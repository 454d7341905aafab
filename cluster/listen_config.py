"""Where the server listens: the `http` and `grpc` sections of kvserve.yaml (cluster/config.py
holds the whole schema)."""
from __future__ import annotations

from pydantic import Field, model_validator

from cluster.config_fields import Section


class HTTPSection(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Serve's direct ingress (cluster/serve_env.py DirectIngress): HAProxy on `port` (and
    # grpc.port) forwards to the ingress replicas, which serve HTTP and gRPC themselves,
    # in place of Serve's proxies. None (auto): on wherever it is safe and possible
    # (cluster/serve_exposure.py direct_ingress_off_reason), Serve's proxies otherwise;
    # true insists (an error where it cannot run), false keeps Serve's proxies.
    # HAProxy's own stats and Prometheus listeners take the first two ports below, on the
    # HTTP host; the head's fallback Serve proxy (HAProxy's backup route while no ingress
    # replica is up) the last two. None: a free port where `kvserve serve` starts the
    # cluster, Serve's default (8404, 9101, 8500, 9500) elsewhere.
    direct_ingress: bool | None = None
    haproxy_stats_port: int | None = Field(None, ge=1, le=65535)
    haproxy_metrics_port: int | None = Field(None, ge=1, le=65535)
    fallback_proxy_port: int | None = Field(None, ge=1, le=65535)
    fallback_proxy_grpc_port: int | None = Field(None, ge=1, le=65535)


class GRPCSection(Section):
    port: int = Field(9000, ge=0, le=65535)
    enabled: bool = True
    # Local `kvserve serve` without API keys answers gRPC on loopback only (Serve's proxy
    # binds every interface: router/frontend/grpc_api/exposure.py); true serves other machines too.
    public: bool = False
    # TLS on a second port of Serve's gRPC proxy (router/frontend/grpc_api/tls.py: Serve 2.60 itself
    # serves only plaintext, on `port`). All three paths are PEM files on every node;
    # tls_client_ca_file set -> mutual TLS.
    tls_port: int | None = Field(None, ge=0, le=65535)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None

    @model_validator(mode="after")
    def _tls_complete(self) -> GRPCSection:
        if self.tls_port is not None and not (self.tls_cert_file and self.tls_key_file):
            raise ValueError("grpc.tls_port needs grpc.tls_cert_file and grpc.tls_key_file")
        if self.tls_port is None and (self.tls_cert_file or self.tls_key_file or self.tls_client_ca_file):
            raise ValueError("grpc.tls_cert_file / tls_key_file / tls_client_ca_file need grpc.tls_port")
        if self.tls_port is not None and self.tls_port == self.port:
            raise ValueError("grpc.tls_port must differ from grpc.port (Serve binds that one in plaintext)")
        return self

    @property
    def tls_env(self) -> dict[str, str]:
        """The environment that turns TLS on in Serve's gRPC proxy (router/frontend/grpc_api/tls.py)."""
        if self.tls_port is None:
            return {}
        from router.frontend.grpc_api.tls import TLSConfig

        return TLSConfig(self.tls_port, self.tls_cert_file or "", self.tls_key_file or "", self.tls_client_ca_file).to_env()
