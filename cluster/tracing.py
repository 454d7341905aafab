"""Tracing set-up: the `observability` section of the config, and the OpenTelemetry SDK
(tracer provider, OTLP exporter) in each replica's process.

router/tracing.py (ingress, request routers) and worker/serving/tracing.py (worker replicas) use only
the OpenTelemetry API and trace with what `install` hands them. Tracing is ON in a process
when an OTLP endpoint is configured: `observability.otlp_endpoint`, or else the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT of that process (a pod's
environment on Kubernetes). Otherwise it is OFF and free: no tracer provider, the SDK is
not even imported, and every trace point returns at one check.

cluster/app.py gives each replica a `TracingSetup` (plain data, pickled to the replica);
the replica calls it first thing in its constructor. The exporter is the optional extra
`kvserve[otel]`: an endpoint without it fails the start with the install hint.

The tracer provider is kvserve's own, not OpenTelemetry's global one: Ray Serve's own
tracing (serve.start(tracing_config=...)) sets the global provider in its processes, and
the two must not fight over it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from cluster.config_fields import Section
from cluster.deps import missing

logger = logging.getLogger(__name__)

OTLPProtocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[str, ...] = ("grpc", "http/protobuf")
ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
DEFAULT_PROTOCOL: OTLPProtocol = "grpc"
DEFAULT_SERVICE_NAME = "kvserve"
# OTLP/HTTP's path for traces, appended to a base endpoint (as the OTel spec does for
# OTEL_EXPORTER_OTLP_ENDPOINT).
HTTP_TRACES_PATH = "/v1/traces"


class ObservabilitySection(Section):
    """Tracing (OpenTelemetry, exported over OTLP). Unset: the standard OTEL_EXPORTER_OTLP_*
    variables of each replica's environment decide; none set: tracing is off."""

    # The collector, e.g. http://otel-collector:4317 (grpc) or http://otel-collector:4318
    # (http/protobuf, /v1/traces is appended).
    otlp_endpoint: str | None = Field(None, json_schema_extra={"pattern": "^https?://"})
    # None: OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else grpc.
    otlp_protocol: OTLPProtocol | None = None
    # Share of requests traced (parent-based: a request's spans are all kept or all dropped).
    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    # OTEL_SERVICE_NAME wins when set.
    service_name: str = Field(DEFAULT_SERVICE_NAME, min_length=1)
    # Continue the trace of a client's W3C `traceparent` HTTP header instead of starting a new
    # one. Off by default: a client's header also decides whether its request is sampled.
    accept_client_trace_context: bool = False

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be http(s)://HOST:PORT, got {v!r}")
        return v


@dataclass(frozen=True)
class TracingSetup:
    """What a replica needs to set tracing up in its own process; calling it does so."""

    component: str  # ingress | worker | prefill | decode: the `kvserve.component` resource attribute
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    trace_sample_ratio: float = 1.0
    service_name: str = DEFAULT_SERVICE_NAME
    accept_client_trace_context: bool = False

    @classmethod
    def of(cls, section: ObservabilitySection, component: str) -> TracingSetup:
        return cls(component, section.otlp_endpoint, section.otlp_protocol, section.trace_sample_ratio,
                   section.service_name, section.accept_client_trace_context)

    def endpoint(self, environ: dict[str, str] | Any = os.environ) -> str | None:
        """The configured endpoint, else the environment's; None: tracing is off."""
        if self.otlp_endpoint:
            return self.otlp_endpoint
        return next((environ[name] for name in ENDPOINT_ENVS if environ.get(name)), None)

    def protocol(self, environ: dict[str, str] | Any = os.environ) -> str:
        value = self.otlp_protocol or next((environ[n] for n in PROTOCOL_ENVS if environ.get(n)), DEFAULT_PROTOCOL)
        if value not in PROTOCOLS:
            raise ValueError(f"OTLP protocol {value!r} is not supported: use one of {', '.join(PROTOCOLS)}")
        return value

    def __call__(self) -> bool:
        """Set tracing up in this process when an endpoint is configured (once per process:
        a second call keeps the first provider). True when tracing is on."""
        global _provider
        if _provider is not None:
            return True
        endpoint = self.endpoint()
        if endpoint is None:
            return False
        protocol = self.protocol()
        _provider = self.provider(make_exporter(endpoint, protocol))
        install(_provider, self.accept_client_trace_context)
        logger.info("tracing on: OTLP %s to %s (component %s, sample ratio %g)",
                    protocol, endpoint, self.component, self.trace_sample_ratio)
        return True

    def provider(self, exporter: Any, batch: bool = True) -> Any:
        """A tracer provider exporting to `exporter` (batched off the request path; a test
        may ask for synchronous export), sampling at the configured ratio."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        attributes = {"kvserve.component": self.component}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = self.service_name
        provider = TracerProvider(resource=Resource.create(attributes),
                                  sampler=ParentBased(TraceIdRatioBased(self.trace_sample_ratio)))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return provider


# The provider this process set up (None: tracing is off here).
_provider: Any = None


def install(provider: Any, accept_client_context: bool = False) -> None:
    """Hand `provider` to every layer that traces (None: off). Tests install one with an
    in-memory exporter the same way."""
    from router import tracing as router_tracing
    from worker.serving import tracing as worker_tracing
    router_tracing.install(provider, accept_client_context)
    worker_tracing.install(provider)


def make_exporter(endpoint: str, protocol: str) -> Any:
    """The OTLP span exporter; MissingDependencyError (with the install hint) without it."""
    feature = f"tracing to {endpoint} (observability.otlp_endpoint or OTEL_EXPORTER_OTLP_ENDPOINT)"
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter
    except ImportError as e:
        raise missing(feature, e) from e
    return HTTPSpanExporter(endpoint=http_traces_url(endpoint))


def check_exporter(protocol: str) -> None:
    """Fail now (in the CLI or app builder), not in every replica, when the exporter is missing."""
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if protocol == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    try:
        __import__(module)
    except ImportError as e:
        raise missing("tracing (observability.otlp_endpoint)", e) from e


def http_traces_url(endpoint: str) -> str:
    """A base endpoint (http://collector:4318) with the traces path; a full URL as given."""
    return endpoint if urlsplit(endpoint).path.rstrip("/").endswith(HTTP_TRACES_PATH) else endpoint.rstrip("/") + HTTP_TRACES_PATH
