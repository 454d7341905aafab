"""The worker's part of a request's trace: one span per replica call, with the engine's
phases as its children.

    kvserve.request                  the API request, at the ingress    (router/tracing.py)
      └ kvserve.generate             one engine request (a choice)      (router/tracing.py)
          ├ kvserve.route            each routing decision               (router/tracing.py)
          └ kvserve.replica          each call on a worker replica       (this module)
              ├ kvserve.engine.queue     arrival -> first admission by the scheduler
              ├ kvserve.engine.prefill   first admission -> first token  (event: first_token)
              └ kvserve.engine.decode    first token -> the last output

The replica span is a child of the ingress's `kvserve.generate` span through the W3C trace
context the ingress put in the GenerateRequest (`trace_context`). Everything here is
emitted ONCE, when the request's stream ends, from the times the engine's Sequence recorded
anyway (arrival, first admission, first token; time.monotonic() of this process): no span
is opened inside the step loop and nothing is done per step.

Off (no tracer installed, or a request without trace context: the ingress did not sample
it) the replica streams the engine's outputs untouched; `is_traced` is the one check per
request. The tracer provider (SDK, exporter) is set up by cluster/tracing.py; this module
only uses the OpenTelemetry API.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from worker.api import GenerateRequest, RequestOutput

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

REPLICA_SPAN = "kvserve.replica"
QUEUE_SPAN = "kvserve.engine.queue"
PREFILL_SPAN = "kvserve.engine.prefill"
DECODE_SPAN = "kvserve.engine.decode"
FIRST_TOKEN_EVENT = "first_token"

# What this process traces with; None: tracing is off here.
_tracer: Tracer | None = None


def install(provider: TracerProvider | None) -> None:
    """Trace worker replicas of this process with `provider` (None: stop tracing)."""
    global _tracer
    _tracer = provider.get_tracer("kvserve.worker") if provider is not None else None


def is_traced(request: GenerateRequest) -> bool:
    return _tracer is not None and request.trace_context is not None


class CallTrace:
    """One replica call's trace: `observe` each output; `end` records the replica span and
    its phases (finished, failed or abandoned). `call`: generate | prefill | decode."""

    def __init__(self, request: GenerateRequest, replica_id: str, call: str) -> None:
        self.request, self.replica_id, self.call = request, replica_id, call
        self.started = time.monotonic()
        self.last: RequestOutput | None = None

    def observe(self, out: RequestOutput) -> None:
        self.last = out

    def end(self, error: BaseException | None = None) -> None:
        record(self.request, self.replica_id, self.call, self.started, time.monotonic(), self.last, error)


def record(
    request: GenerateRequest,
    replica_id: str,
    call: str,
    started: float,
    ended: float,
    last: RequestOutput | None,
    error: BaseException | None = None,
) -> None:
    """Emit the replica span of one call and its engine phases. Times: time.monotonic()."""
    tracer = _tracer
    if tracer is None or request.trace_context is None:
        return
    # optional dependency (otel extra): only when tracing is on
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
    # optional dependency (otel extra)
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    to_ns = _monotonic_to_epoch_ns()
    parent = TraceContextTextMapPropagator().extract(request.trace_context)
    span = tracer.start_span(
        REPLICA_SPAN, context=parent, kind=SpanKind.SERVER, start_time=to_ns(started),
        attributes=_attributes(request, replica_id, call, last),
    )
    if last is not None:
        _phases(tracer, set_span_in_context(span), span, call, started, ended, last, to_ns)
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):  # the caller left: not a failure here
        span.set_attribute("kvserve.cancelled", True)
    elif error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:200]))
    elif last is not None and last.finish_reason == "error":
        span.set_status(Status(StatusCode.ERROR, (last.error or "engine error")[:200]))
    span.end(end_time=to_ns(ended))


def _attributes(request: GenerateRequest, replica_id: str, call: str, last: RequestOutput | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "kvserve.request_id": request.request_id,
        "kvserve.replica": replica_id,
        "kvserve.replica.call": call,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        "kvserve.num_resumed_tokens": request.num_resumed_tokens,
        "gen_ai.request.max_tokens": request.params.max_tokens,
        "kvserve.priority": request.params.priority,
    }
    if last is not None:
        attributes.update({
            "gen_ai.usage.output_tokens": last.num_output_tokens,
            "kvserve.cached_tokens": last.num_cached_tokens,
            "kvserve.num_preemptions": last.num_preemptions,
            "kvserve.finish_reason": last.finish_reason or "",
        })
    return attributes


def _phases(
    tracer: Tracer, context: Any, span: Span, call: str, started: float, ended: float, last: RequestOutput,
    to_ns: Any,
) -> None:
    """queue -> prefill -> decode, each from one recorded time to the next. Disaggregated,
    a prefill call stops at its first token, and a decode call imported its prompt's KV:
    it waits for blocks, then decodes (no prefill there)."""
    arrival = max(last.arrival_time or started, started)
    scheduled, first = last.scheduled_time, last.first_token_time

    def phase(name: str, start: float, end: float) -> None:
        tracer.start_span(name, context=context, start_time=to_ns(start)).end(end_time=to_ns(max(end, start)))

    phase(QUEUE_SPAN, arrival, scheduled if scheduled is not None else ended)
    if scheduled is None:
        return
    if call == "decode":
        phase(DECODE_SPAN, scheduled, ended)
        return
    phase(PREFILL_SPAN, scheduled, first if first is not None else ended)
    if first is not None:
        span.add_event(FIRST_TOKEN_EVENT, timestamp=to_ns(first))
        if call != "prefill":  # a prefill call ends with its first token; decode is elsewhere
            phase(DECODE_SPAN, first, ended)


def _monotonic_to_epoch_ns() -> Any:
    """time.monotonic() seconds -> epoch nanoseconds, as OpenTelemetry wants them."""
    offset_ns = time.time_ns() - time.monotonic_ns()
    return lambda t: int(t * 1e9) + offset_ns
