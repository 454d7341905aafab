"""Scale to zero's bound (router/routing/cold_start.py) through the real GenerationStream and
OutputHub over real worker replicas (the engine core with a model-free runner), no Ray: a
stand-in handle for a pool at zero replicas holds each call in its queue, as Serve's handle
does, until a replica starts.

What it pins down: a request to an empty pool is held, not failed, and answered once a
replica starts; past the bound it is a 503 with Retry-After, its call is cancelled in the
handle's queue (nothing left there or on the replica that starts later) and everything it
held is given back; the first model_info call is bounded the same way; a health probe does
not wake a pool at zero; the config gives the bound and the pool's start-up time as
Retry-After."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.config import KVServeConfig
from router import errors
from router.frontend.generation import GenerationStream, InFlightLimiter
from router.frontend.key_limits import JointPermit
from router.frontend.metrics import IngressMetrics
from router.frontend.openai_api.convert import EngineInput
from router.frontend.output_hub import OutputHub
from router.frontend.workers import Workers
from router.routing import NO_BOUND, ColdStartBound
from tests.integration.fake_engine_worker import TOKEN, FakeEngineWorker
from tests.unit.router.frontend.test_output_hub import FakeHandle, replicas, stop
from worker.api import SamplingParams


class QueuedCall:
    """A call waiting in the handle's queue for a replica; cancel() takes it out."""

    def __init__(self, pool: ColdPool, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._pool, self._name, self._args, self._kwargs = pool, name, args, kwargs
        self._inner: Any = None
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        await self._pool.started.wait()
        self._pool.dispatch(self)
        self._inner = FakeHandle.call(self._pool, self._name, self._args, self._kwargs)
        async for item in self._inner:
            yield item

    def __await__(self) -> Any:
        return self._result().__await__()

    async def _result(self) -> Any:
        await self._pool.started.wait()
        self._pool.dispatch(self)
        replica = next(iter(self._pool.replicas.values()))
        result = getattr(replica, self._name)(*self._args, **self._kwargs)
        return await result if inspect.isawaitable(result) else result

    def cancel(self) -> None:
        self.cancelled = True
        self._pool.dispatch(self)
        if self._inner is not None:
            self._inner.cancel()


class ColdPool(FakeHandle):
    """A pool at zero replicas: calls queue until `start(worker)` (then go at once)."""

    def __init__(self) -> None:
        super().__init__([])
        self.asked: list[str] = []  # every method called, in order
        self.queued: list[QueuedCall] = []
        self.started = asyncio.Event()

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.asked.append(name)
        queued = QueuedCall(self, name, args, kwargs)
        self.queued.append(queued)
        return queued

    def dispatch(self, call: QueuedCall) -> None:
        if call in self.queued:
            self.queued.remove(call)

    def start(self, worker: FakeEngineWorker) -> None:
        self.replicas[worker.replica_id] = worker
        self.started.set()


def stream_of(hub: OutputHub, limiter: InFlightLimiter, bound: ColdStartBound, metrics: IngressMetrics) -> GenerationStream:
    params = SamplingParams(max_tokens=6, temperature=0.0)
    inputs = [EngineInput(index=0, prompt_index=0, prompt_token_ids=[3, 4, 5, 6], params=params)]
    return GenerationStream(hub, inputs, "cmpl-cold", JointPermit(limiter.acquire(1), None), 60.0,
                            metrics, cold_start=bound)


async def test_a_request_to_an_empty_pool_is_held_and_answered_when_a_replica_starts() -> None:
    pool, limiter = ColdPool(), InFlightLimiter(4)
    hub = OutputHub(pool)
    stream = stream_of(hub, limiter, ColdStartBound(30.0, 5.0), IngressMetrics("m"))
    starting = asyncio.ensure_future(stream.start())
    await asyncio.wait_for(_until(lambda: len(pool.queued) == 1), timeout=5)
    assert not starting.done()  # held in the handle's queue, not failed
    [worker] = replicas(1, max_num_seqs=4, step_s=0.001)
    pool.start(worker)
    try:
        await asyncio.wait_for(starting, timeout=10)
        tokens = [t async for event in stream for t in event.output.new_token_ids]
    finally:
        stop([worker])
    assert tokens == [TOKEN] * 6
    assert limiter.in_flight == 0 and not pool.queued


async def test_past_the_bound_a_503_with_retry_after_and_nothing_left_queued() -> None:
    pool, limiter, metrics = ColdPool(), InFlightLimiter(4), IngressMetrics("m")
    hub = OutputHub(pool)
    stream = stream_of(hub, limiter, ColdStartBound(0.2, 42.5), metrics)
    with pytest.raises(errors.APIError) as info:
        await asyncio.wait_for(stream.start(), timeout=5)
    assert info.value.status == 503 and info.value.code == "no_worker_replica"
    assert info.value.retry_after_s == 43  # type: ignore[attr-defined]  # whole seconds, rounded up
    assert "0.2 s" in info.value.message
    await asyncio.wait_for(_until(lambda: not pool.queued), timeout=5)  # cancelled at the handle
    assert limiter.in_flight == 0 and not hub._queues
    assert metrics.rejected.labels("m", "cold_start_timeout")._value.get() == 1
    # The replica that starts later gets nothing of it.
    [worker] = replicas(1, max_num_seqs=4, step_s=0.001)
    pool.start(worker)
    try:
        await asyncio.sleep(0)
        assert not worker.engine.engine.has_unfinished()
    finally:
        stop([worker])


async def test_a_warm_pool_is_not_bounded_by_time_to_first_token() -> None:
    """The bound is on a replica taking the call, not on the answer: a warm replica whose
    first token comes after the bound still answers."""
    [worker] = replicas(1, max_num_seqs=4, step_s=0.05)  # 6 tokens: ~0.3 s, past the bound
    hub, limiter = OutputHub(FakeHandle([worker])), InFlightLimiter(4)
    stream = stream_of(hub, limiter, ColdStartBound(0.1, 1.0), IngressMetrics("m"))
    try:
        await asyncio.wait_for(stream.start(), timeout=10)
        tokens = [t async for event in stream for t in event.output.new_token_ids]
    finally:
        stop([worker])
    assert tokens == [TOKEN] * 6


async def test_model_info_waits_for_a_replica_within_the_bound() -> None:
    pool = ColdPool()
    workers = Workers(pool, OutputHub(pool), 1.0, cold_start=ColdStartBound(0.2, 9.0))
    with pytest.raises(errors.APIError) as info:
        await asyncio.wait_for(workers.model_info(), timeout=5)
    assert info.value.status == 503 and info.value.retry_after_s == 9  # type: ignore[attr-defined]
    assert not pool.queued and not pool.started.is_set()
    held = asyncio.ensure_future(Workers(pool, OutputHub(pool), 1.0, cold_start=ColdStartBound(30.0, 9.0)).model_info())
    await asyncio.wait_for(_until(lambda: len(pool.queued) == 1), timeout=5)
    [worker] = replicas(1, max_num_seqs=4, step_s=0.001)
    pool.start(worker)
    try:
        info_ = await asyncio.wait_for(held, timeout=10)
    finally:
        stop([worker])
    assert info_["max_model_len"] > 0


class _RequestRouter:
    """What Serve's router in this process knows: its replica set (serve_internals.known_replica_count)."""

    def __init__(self, num_replicas: int) -> None:
        self.curr_replicas = {f"r{i}": object() for i in range(num_replicas)}


class _ServeRouter:
    def __init__(self, num_replicas: int) -> None:
        self._asyncio_router = type("AsyncioRouter", (), {"_request_router": _RequestRouter(num_replicas)})()


async def test_health_does_not_wake_a_pool_at_zero() -> None:
    pool = ColdPool()
    pool._router = _ServeRouter(0)  # type: ignore[attr-defined]
    assert await Workers(pool, OutputHub(pool), 1.0, scale_to_zero=True).unhealthy_reason(0.2) is None
    assert pool.asked == []  # nothing queued at the empty pool: no demand, no replica started
    # A pool that may not scale to zero is asked, and with no replica it is unhealthy.
    reason = await Workers(pool, OutputHub(pool), 1.0).unhealthy_reason(0.2)
    assert reason is not None and "health check" in reason
    assert pool.asked == ["check_health"] and not pool.queued  # the probe's call was cancelled
    # With a replica, a scale-to-zero pool is asked as any other.
    [worker] = replicas(1, max_num_seqs=4, step_s=0.001)
    pool._router = _ServeRouter(1)  # type: ignore[attr-defined]
    pool.start(worker)
    try:
        assert await Workers(pool, OutputHub(pool), 1.0, scale_to_zero=True).unhealthy_reason(5.0) is None
    finally:
        stop([worker])
    assert pool.asked == ["check_health", "check_health"]


async def test_no_bound_waits() -> None:
    assert await NO_BOUND.answer(_value(7)) == 7
    assert await ColdStartBound(5.0, 1.0).answer(_value(8)) == 8


def test_each_api_gets_its_own_503_shape() -> None:
    import grpc

    from router.frontend.grpc_api.convert import status_code_of
    from router.frontend.messages_api.errors import error_response

    error = ColdStartBound(2.0, 12.0).error()
    assert status_code_of(error) == grpc.StatusCode.UNAVAILABLE and "retry after 12 s" in error.message
    anthropic_style = error_response(error)
    assert anthropic_style.status_code == 503 and anthropic_style.headers["retry-after"] == "12"
    assert error.body()["error"]["code"] == "no_worker_replica"


def test_the_bound_is_checked() -> None:
    with pytest.raises(ValueError):
        ColdStartBound(0.0, 1.0)
    with pytest.raises(ValueError):
        ColdStartBound(1.0, -1.0)
    assert ColdStartBound(1.0, 0.0).error().retry_after_s == 1  # type: ignore[attr-defined]


def test_config_gives_the_bound_and_the_pools_start_up_time() -> None:
    default = KVServeConfig.from_dict({}).ingress_settings().cold_start
    assert default.max_wait_s == 300.0 and default.retry_after_s == 60.0
    config = KVServeConfig.from_dict({
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b"},
        "workers": {"autoscaling": {"min_replicas": 0, "scale_to_zero": True,
                                    "slo": {"ttft_ms": 2000, "itl_ms": 50, "startup_s": 7.5}}},
        "ingress": {"cold_start_max_wait_s": 20},
    })
    assert config.ingress_settings().cold_start == ColdStartBound(20.0, 7.5)
    assert config.ingress_settings().scale_to_zero and not KVServeConfig.from_dict({}).ingress_settings().scale_to_zero
    given = config.with_overrides({"ingress.cold_start_retry_after_s": 3})
    assert given.ingress_settings().cold_start.retry_after_s == 3
    unbounded = KVServeConfig.from_dict({"ingress": {"cold_start_max_wait_s": None}}).ingress_settings().cold_start
    assert unbounded == ColdStartBound(None, 60.0) and not unbounded.bounded


async def _value(v: int) -> int:
    return v


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.005)  # a polling period, bounded by the caller's wait_for
