"""A minimal OTLP/HTTP trace receiver for tests: what an OpenTelemetry Collector does on
POST /v1/traces (protobuf ExportTraceServiceRequest), decoded into plain records that the
test waits on. It runs in the test process; replicas in other processes export to it over
loopback through the real OTLP exporter (cluster/tracing.py)."""
from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.waiting import wait_until


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, Any]
    resource: dict[str, Any]  # service.name, kvserve.component, ...
    start_ns: int
    end_ns: int
    events: tuple[str, ...]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 -- http.server's name
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                receiver._add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _add(self, request: Any) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(ReceivedSpan(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), _attributes(s.attributes),
                        resource, s.start_time_unix_nano, s.end_time_unix_nano, tuple(e.name for e in s.events),
                    ))
        with self._lock:
            self.spans.extend(received)

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], Any], what: str, timeout_s: float = 60.0) -> Any:
        """Until `condition(spans received so far)` is truthy (exporters batch: seconds)."""
        return wait_until(lambda: condition(self.snapshot()), timeout_s, 0.1,
                          message=lambda: f"{what}; received {sorted({s.name for s in self.snapshot()})}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
