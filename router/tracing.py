"""The ingress's part of a request's trace (OpenTelemetry): the request, each engine request
it sends, and each routing decision.

    kvserve.request        one API request: from its arrival to the end of its stream
      └ kvserve.generate   one engine request (one choice of n), across its migrations
          ├ kvserve.route  each routing decision for it (the request router, this process)
          └ kvserve.replica ... and the engine's phases (worker/serving/tracing.py, the replica's process)

The trace crosses Ray Serve handle calls inside the request: `kvserve.generate` puts its W3C
trace context (`traceparent`) in the GenerateRequest (`trace_context`), which the request
router reads from the pending call's arguments and the worker replica from its argument.
A migration (router/frontend/migration.py) is an event on `kvserve.generate`; the resumed call gets a
route and a replica span of its own under the same parent.

A request's trace is a new one, or, with observability.accept_client_trace_context, the
trace of the client's HTTP `traceparent` header (ClientTraceContext; off by default: it lets
clients choose which requests are sampled).

Off (no tracer installed: no OTLP endpoint configured, cluster/tracing.py) every entry
point returns at its first check, `_tracer is None`, once per request or routing
decision; nothing is done per token, on or off. A request the sampler drops is traced
nowhere: its GenerateRequests carry no context.
"""
from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from worker.api import GenerateRequest

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

REQUEST_SPAN = "kvserve.request"
GENERATE_SPAN = "kvserve.generate"
ROUTE_SPAN = "kvserve.route"
MIGRATION_EVENT = "kvserve.migration"
# Routing decisions list at most this many ranked replicas (the first is the choice).
_MAX_RANKED = 4

# What this process traces with; None: tracing is off here.
_tracer: Tracer | None = None
# Whether a client's own W3C context (HTTP `traceparent`) becomes the request span's parent.
_accept_client_context = False
# That context while the ingress handles the client's HTTP request (ClientTraceContext).
_client_context: ContextVar[dict[str, str] | None] = ContextVar("kvserve_client_trace_context", default=None)
_CLIENT_HEADERS = (b"traceparent", b"tracestate")


def install(provider: TracerProvider | None, accept_client_context: bool = False) -> None:
    """Trace the ingress and request routers of this process with `provider` (None: off);
    `accept_client_context`: continue the traces clients send (observability.accept_client_trace_context)."""
    global _tracer, _accept_client_context
    _tracer = provider.get_tracer("kvserve.router") if provider is not None else None
    _accept_client_context = accept_client_context and provider is not None


class ClientTraceContext:
    """ASGI middleware of the HTTP ingress: while a request is handled, the client's
    `traceparent` / `tracestate` headers are what RequestTrace.start continues. Off (the
    default, or tracing off): one check per request, then the app as it is."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not _accept_client_context or scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope.get("headers") or () if name in _CLIENT_HEADERS}
        token = _client_context.set(carrier or None)
        try:
            await self.app(scope, receive, send)
        finally:
            _client_context.reset(token)


def _propagator() -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


class RequestTrace:
    """The spans of one API request at the ingress. `start` returns None when tracing is
    off or the sampler dropped the request; callers then skip every call below."""

    __slots__ = ("_tracer", "span")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self._tracer = tracer
        self.span = span

    @classmethod
    def start(cls, request_id: str, arrival: float, num_choices: int, prompt_tokens: int) -> RequestTrace | None:
        """`arrival`: time.monotonic() when the request came in (the span starts there)."""
        tracer = _tracer
        if tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        start_ns = time.time_ns() - int((time.monotonic() - arrival) * 1e9)
        carrier = _client_context.get()
        parent = _propagator().extract(carrier) if carrier else None
        span = tracer.start_span(REQUEST_SPAN, context=parent, kind=SpanKind.SERVER, start_time=start_ns, attributes={
            "kvserve.request_id": request_id, "kvserve.num_choices": num_choices,
            "gen_ai.usage.input_tokens": prompt_tokens,
        })
        if not span.is_recording():  # not sampled
            return None
        return cls(tracer, span)

    def engine_request(self, request: GenerateRequest) -> tuple[GenerateRequest, Span]:
        """The engine request's own span, and the request carrying its trace context."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self._tracer.start_span(
            GENERATE_SPAN, context=set_span_in_context(self.span), kind=SpanKind.CLIENT, attributes={
                "kvserve.request_id": request.request_id,
                "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                "gen_ai.request.max_tokens": request.params.max_tokens,
                "kvserve.priority": request.params.priority,
            },
        )
        carrier: dict[str, str] = {}
        _propagator().inject(carrier, context=set_span_in_context(span))
        return replace(request, trace_context=carrier), span

    @staticmethod
    def migrated(span: Span, error: BaseException, num_generated_tokens: int, attempt: int) -> None:
        span.add_event(MIGRATION_EVENT, attributes={
            "kvserve.migration.attempt": attempt, "kvserve.migration.cause": type(error).__name__,
            "kvserve.migration.num_generated_tokens": num_generated_tokens,
        })

    @staticmethod
    def end_engine_request(span: Span, num_output_tokens: int, num_migrations: int, error: BaseException | None) -> None:
        span.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
        span.set_attribute("kvserve.num_migrations", num_migrations)
        _set_error(span, error)
        span.end()

    def end(self, num_output_tokens: int, error: BaseException | None) -> None:
        self.span.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
        _set_error(self.span, error)
        self.span.end()


def _set_error(span: Span, error: BaseException | None) -> None:
    if error is None:
        return
    if isinstance(error, asyncio.CancelledError):  # the client left, or the request ended first
        span.set_attribute("kvserve.cancelled", True)
        return
    from opentelemetry.trace import Status, StatusCode

    status = getattr(error, "status", None)  # router/errors.APIError: the client's status
    if status is not None:
        span.set_attribute("http.response.status_code", int(status))
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:200]))


def record_route(request: Any, mode: str, order: Any, num_candidates: int, started_s: float) -> None:
    """A request router's decision for one `generate`/`prefill`/`decode` call, as a span
    under the call's engine request. `request`: the object the call carries
    (router/routing/serve_router.py's call_request); `order`: the ranked replica ids
    (ReplicaID), best first; `started_s`: the router's time.time() when the decision
    began. Calls without a trace context (other methods, tracing off at the ingress) are
    not recorded."""
    tracer = _tracer
    if tracer is None:
        return
    carrier = getattr(request, "trace_context", None)
    if not carrier:
        return
    ranked = [getattr(key, "unique_id", str(key)) for key in list(order)[:_MAX_RANKED]]
    span = tracer.start_span(ROUTE_SPAN, context=_propagator().extract(carrier), start_time=int(started_s * 1e9),
                             attributes={
                                 "kvserve.request_id": getattr(request, "request_id", ""),
                                 "kvserve.routing.mode": mode,
                                 "kvserve.routing.replica": ranked[0] if ranked else "",
                                 "kvserve.routing.ranked": ranked,
                                 "kvserve.routing.num_candidates": num_candidates,
                             })
    span.end()
