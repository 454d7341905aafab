"""Tracing in one process (no Ray cluster): the span tree of one request through the real
ingress stream (router/frontend/generation.py), the real KV-headroom router's decision
(router/routing/serve_router.py) and a real worker replica on the tiny model (worker/serving/replica.py),
exported to OpenTelemetry's in-memory exporter. Plus: off is free, migration events, and
the set-up's endpoint / protocol / missing-exporter rules (cluster/tracing.py)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster import tracing as cluster_tracing
from cluster.tracing import TracingSetup, http_traces_url, make_exporter
from router import tracing as router_tracing
from router.frontend.generation import GenerationStream, InFlightLimiter
from router.frontend.key_limits import JointPermit
from router.frontend.metrics import IngressMetrics
from router.frontend.openai_api.convert import EngineInput
from router.routing.serve_router import PolicyRouter
from tests.support.engine_api_helpers import make_engine, tokenizer  # noqa: F401 -- fixture
from worker.serving import tracing as worker_tracing
from worker.api import GenerateRequest, MissingDependencyError, RequestOutput, SamplingParams
from worker.engine.async_engine import AsyncEngine
from worker.serving.replica import WorkerReplica

PROMPT = [5, 17, 33, 9, 41, 8, 12, 99, 100, 3]
MAX_TOKENS = 6
REPLICA_ID = "replica-a"
ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, exported synchronously to memory; off again after."""
    exporter = InMemorySpanExporter()
    cluster_tracing.install(TracingSetup("test").provider(exporter, batch=False))
    try:
        yield exporter
    finally:
        cluster_tracing.install(None)


@pytest.fixture
def replica(tiny_llama: Path, tokenizer: Any) -> Iterator[WorkerReplica]:  # noqa: F811
    worker = WorkerReplica.__new__(WorkerReplica)
    worker._attach(AsyncEngine(make_engine(tiny_llama), tokenizer), block_size=16, drain_timeout_s=5.0)
    try:
        yield worker
    finally:
        worker.engine.shutdown()


class RoutedHandle:
    """Stands in for `worker_handle.options(stream=True)`: each call is ranked by a real
    PolicyRouter over one replica reporting the real replica's routing stats (as Serve
    does in the ingress's process), then streamed from that replica."""

    def __init__(self, worker: WorkerReplica) -> None:
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

        deployment = DeploymentID(name="worker", app_name="test")
        self.router = PolicyRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
        self.replica = SimpleNamespace(replica_id=ReplicaID(unique_id=REPLICA_ID, deployment_id=deployment),
                                       routing_stats={})
        self.worker = worker
        self.requests: list[GenerateRequest] = []
        self.generate = self

    def remote(self, request: GenerateRequest) -> Any:
        self.requests.append(request)
        return _Call(self, request)


class _Call:
    def __init__(self, handle: RoutedHandle, request: GenerateRequest) -> None:
        self._handle, self._request = handle, request

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        handle, request = self._handle, self._request
        handle.replica.routing_stats = handle.worker.record_routing_stats()
        pending = SimpleNamespace(args=[request], kwargs={}, metadata=SimpleNamespace(internal_request_id=request.request_id),
                                  routing_context=SimpleNamespace(should_backoff=False))
        ranks = await handle.router.choose_replicas([handle.replica], pending)
        assert ranks == [[handle.replica]]
        async for out in handle.worker.generate(request):
            yield out

    def cancel(self) -> None:
        pass


def stream_of(handle: Any, n: int, request_id: str = "cmpl-trace", max_migrations: int = 2) -> GenerationStream:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    inputs = [EngineInput(index=i, prompt_index=0, prompt_token_ids=list(PROMPT), params=params) for i in range(n)]
    permit = JointPermit(InFlightLimiter(8).acquire(n), None)
    return GenerationStream(handle, inputs, request_id, permit, 60.0, IngressMetrics("m"), max_migrations=max_migrations)


async def run(stream: GenerationStream) -> list[RequestOutput]:
    await stream.start()
    return [event.output async for event in stream]


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in finished:
        out.setdefault(span.name, []).append(span)
    return out


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_span_tree_of_one_request(spans: InMemorySpanExporter, replica: WorkerReplica) -> None:
    handle = RoutedHandle(replica)
    outputs = await run(stream_of(handle, n=2))
    assert sum(len(o.new_token_ids) for o in outputs) == 2 * MAX_TOKENS

    named = by_name(spans.get_finished_spans())
    assert {name: len(s) for name, s in named.items()} == {
        "kvserve.request": 1, "kvserve.generate": 2, "kvserve.route": 2, "kvserve.replica": 2,
        "kvserve.engine.queue": 2, "kvserve.engine.prefill": 2, "kvserve.engine.decode": 2,
    }
    (request,) = named["kvserve.request"]
    assert request.parent is None
    assert {s.context.trace_id for group in named.values() for s in group} == {request.context.trace_id}
    assert request.attributes["kvserve.request_id"] == "cmpl-trace"
    assert request.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)  # the prompt once: n shares it
    assert request.attributes["gen_ai.usage.output_tokens"] == 2 * MAX_TOKENS
    assert request.attributes["kvserve.num_choices"] == 2

    generates = {s.attributes["kvserve.request_id"]: s for s in named["kvserve.generate"]}
    assert set(generates) == {"cmpl-trace-0", "cmpl-trace-1"}
    for engine_request_id, generate in generates.items():
        assert parent_of(generate) == request.context.span_id
        assert generate.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
        assert generate.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert generate.attributes["kvserve.num_migrations"] == 0
        (route,) = [s for s in named["kvserve.route"] if parent_of(s) == generate.context.span_id]
        assert route.attributes["kvserve.request_id"] == engine_request_id
        assert route.attributes["kvserve.routing.replica"] == REPLICA_ID
        assert route.attributes["kvserve.routing.mode"] in ("headroom", "load_gate", "pow2")
        assert route.attributes["kvserve.routing.num_candidates"] == 1
        (on_replica,) = [s for s in named["kvserve.replica"] if parent_of(s) == generate.context.span_id]
        assert on_replica.attributes["kvserve.request_id"] == engine_request_id
        assert on_replica.attributes["kvserve.replica"] == "local"  # outside Serve (worker/serving/replica.py)
        assert on_replica.attributes["kvserve.replica.call"] == "generate"
        assert on_replica.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
        assert on_replica.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert on_replica.attributes["kvserve.finish_reason"] == "length"
        assert [e.name for e in on_replica.events] == ["first_token"]
        phases = {s.name: s for group in named.values() for s in group if parent_of(s) == on_replica.context.span_id}
        queue, prefill, decode = (phases[f"kvserve.engine.{p}"] for p in ("queue", "prefill", "decode"))
        # Consecutive phases from the Sequence's recorded times, inside the replica span.
        assert on_replica.start_time <= queue.start_time <= queue.end_time <= prefill.start_time
        assert prefill.end_time == on_replica.events[0].timestamp == decode.start_time
        assert decode.end_time <= on_replica.end_time <= generate.end_time <= request.end_time
    # Each GenerateRequest carried its own span's context, W3C traceparent.
    assert [r.trace_context is not None and "traceparent" in r.trace_context for r in handle.requests] == [True, True]


async def test_off_means_no_context_and_no_spans(replica: WorkerReplica) -> None:
    assert router_tracing._tracer is None and worker_tracing._tracer is None
    handle = RoutedHandle(replica)
    stream = stream_of(handle, n=1)
    assert stream._trace is None
    await run(stream)
    assert [r.trace_context for r in handle.requests] == [None]
    assert not worker_tracing.is_traced(handle.requests[0])


def test_no_endpoint_sets_nothing_up() -> None:
    """Off and free: without an endpoint, no provider is made and the SDK is never imported
    (a fresh interpreter: this one has imported it)."""
    code = (
        "import sys\n"
        "from cluster.tracing import TracingSetup\n"
        "import cluster.tracing as t, router.tracing as r, worker.serving.tracing as w\n"
        "assert TracingSetup('worker')() is False\n"
        "assert t._provider is None and r._tracer is None and w._tracer is None\n"
        "assert 'opentelemetry.sdk.trace' not in sys.modules, 'the SDK was imported'\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # no OTEL_* variables
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


class DyingHandle:
    """The first call dies after two tokens (a replica failure, by name), the next lives."""

    def __init__(self) -> None:
        self.generate = self
        self.calls = 0

    def remote(self, request: GenerateRequest) -> Any:
        self.calls += 1
        return _DyingCall(request, die_after=2 if self.calls == 1 else None)


class ActorDiedError(RuntimeError):
    """Named like ray.exceptions.ActorDiedError (router/frontend/migration.py matches by name)."""


class _DyingCall:
    def __init__(self, request: GenerateRequest, die_after: int | None) -> None:
        self.request, self.die_after = request, die_after

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        n = self.request.params.max_tokens
        for i in range(n):
            if i == self.die_after:
                raise ActorDiedError("the actor died")
            await asyncio.sleep(0)
            yield RequestOutput(self.request.request_id, [7], finished=i == n - 1, finish_reason="length" if i == n - 1 else None,
                                num_prompt_tokens=len(self.request.prompt_token_ids), num_output_tokens=i + 1)

    def cancel(self) -> None:
        pass


async def test_a_migration_is_an_event_of_its_engine_request(spans: InMemorySpanExporter) -> None:
    outputs = await run(stream_of(DyingHandle(), n=1))
    assert sum(len(o.new_token_ids) for o in outputs) == MAX_TOKENS
    (generate,) = by_name(spans.get_finished_spans())["kvserve.generate"]
    assert generate.attributes["kvserve.num_migrations"] == 1
    assert generate.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    (event,) = generate.events
    assert event.name == "kvserve.migration"
    assert event.attributes["kvserve.migration.cause"] == "ActorDiedError"
    assert event.attributes["kvserve.migration.num_generated_tokens"] == 2


def test_endpoint_and_protocol_come_from_the_config_else_the_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert TracingSetup("worker").endpoint({}) is None
    assert TracingSetup("worker").endpoint(env) == "http://collector:4318"
    assert TracingSetup("worker").protocol(env) == "http/protobuf"
    assert TracingSetup("worker").protocol({}) == "grpc"
    configured = TracingSetup("worker", otlp_endpoint="http://other:4317", otlp_protocol="grpc")
    assert configured.endpoint(env) == "http://other:4317" and configured.protocol(env) == "grpc"
    # The signal-specific variable wins over the general one, as the OTel spec says.
    assert TracingSetup("worker").endpoint({**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1"}) == "http://t:1"
    with pytest.raises(ValueError, match="not supported"):
        TracingSetup("worker").protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert http_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert http_traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_an_endpoint_without_the_exporter_fails_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'kvserve\[otel\]'"):
        make_exporter("http://collector:4317", "grpc")


def test_the_config_section_validates_the_endpoint() -> None:
    from cluster.config import ConfigError, KVServeConfig

    config = KVServeConfig.from_dict({"observability": {"otlp_endpoint": "http://c:4317", "trace_sample_ratio": 0.5}})
    assert TracingSetup.of(config.observability, "ingress").trace_sample_ratio == 0.5
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        KVServeConfig.from_dict({"observability": {"otlp_endpoint": "collector:4317"}})


async def test_disaggregated_calls_trace_their_own_phases(
    spans: InMemorySpanExporter, tiny_llama: Path, tokenizer: Any  # noqa: F811
) -> None:
    """A prefill replica's call ends at its first token (queue, prefill); the decode
    replica's call imported the KV (queue, decode; no prefill there). Both under the one
    engine request's span."""
    from kv.transfer import LocalKVTransport

    def worker() -> WorkerReplica:
        r = WorkerReplica.__new__(WorkerReplica)
        r._attach(AsyncEngine(make_engine(tiny_llama), tokenizer), block_size=16, drain_timeout_s=5.0)
        r.kv_transport = transport
        return r

    transport = LocalKVTransport()
    prefill, decode = worker(), worker()
    try:
        trace = router_tracing.RequestTrace.start("cmpl-disagg", 0.0, 1, len(PROMPT))
        assert trace is not None
        request, generate = trace.engine_request(
            GenerateRequest("cmpl-disagg-0", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))
        first, kv_handle = await prefill.prefill(request)
        assert kv_handle is not None
        outputs = [first] + [out async for out in decode.decode(request, kv_handle)]
        await prefill.release_kv(request.request_id)
        router_tracing.RequestTrace.end_engine_request(generate, MAX_TOKENS, 0, None)
        trace.end(MAX_TOKENS, None)
    finally:
        prefill.engine.shutdown()
        decode.engine.shutdown()
    assert sum(len(o.new_token_ids) for o in outputs) == MAX_TOKENS

    named = by_name(spans.get_finished_spans())
    calls = {s.attributes["kvserve.replica.call"]: s for s in named["kvserve.replica"]}
    assert set(calls) == {"prefill", "decode"}
    (generate_span,) = named["kvserve.generate"]
    for call, expected in (("prefill", ["kvserve.engine.prefill", "kvserve.engine.queue"]),
                           ("decode", ["kvserve.engine.decode", "kvserve.engine.queue"])):
        span = calls[call]
        assert parent_of(span) == generate_span.context.span_id
        children = sorted(s.name for group in named.values() for s in group if parent_of(s) == span.context.span_id)
        assert children == expected
    assert [e.name for e in calls["prefill"].events] == ["first_token"]
    assert calls["prefill"].attributes["gen_ai.usage.output_tokens"] == 1


@pytest.mark.parametrize("accept", [True, False])
async def test_a_client_traceparent_is_continued_only_when_accepted(accept: bool) -> None:
    import time

    exporter = InMemorySpanExporter()
    cluster_tracing.install(TracingSetup("test").provider(exporter, batch=False), accept_client_context=accept)
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def ingress(scope: dict[str, Any], receive: Any, send: Any) -> None:
        trace = router_tracing.RequestTrace.start("cmpl-client", time.monotonic(), 1, len(PROMPT))
        assert trace is not None
        trace.end(0, None)

    try:
        headers = [(b"traceparent", f"00-{client_trace}-{client_span}-01".encode()), (b"x-other", b"1")]
        await router_tracing.ClientTraceContext(ingress)({"type": "http", "headers": headers}, None, None)
    finally:
        cluster_tracing.install(None)
    (span,) = exporter.get_finished_spans()
    if accept:
        assert format(span.context.trace_id, "032x") == client_trace
        assert span.parent is not None and format(span.parent.span_id, "016x") == client_span
    else:
        assert format(span.context.trace_id, "032x") != client_trace and span.parent is None
