"""GenerationStream's deadline (router/frontend/generation.py): a request that has not
finished within the ingress's request_timeout_s fails with 504, before its first output or
mid-stream, and its engine request is cancelled."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from router import errors
from router.frontend.generation import GenerationStream, InFlightLimiter
from router.frontend.key_limits import JointPermit
from router.frontend.metrics import IngressMetrics
from router.frontend.openai_api.convert import EngineInput
from tests.unit.router.frontend.test_migration import PROMPT, FakeCall, FakeHandle
from worker.api import RequestOutput, SamplingParams


class SlowCall(FakeCall):
    """Outputs `gap_s` apart, the first after `first_s`."""

    first_s = 0.0
    gap_s = 0.0

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        await asyncio.sleep(self.first_s)
        async for out in super().__aiter__():
            yield out
            await asyncio.sleep(self.gap_s)


def slow_handle(first_s: float, gap_s: float) -> FakeHandle:
    handle = FakeHandle([None])
    calls = handle.calls

    class _Generate:
        def remote(self, request: object) -> SlowCall:
            call = SlowCall(request, None, RuntimeError())  # type: ignore[arg-type]
            call.first_s, call.gap_s = first_s, gap_s
            calls.append(call)
            return call

    handle.generate = _Generate()  # type: ignore[assignment]
    return handle


def stream_of(handle: FakeHandle, timeout_s: float, limiter: InFlightLimiter) -> GenerationStream:
    params = SamplingParams(max_tokens=50, temperature=0.0)
    inputs = [EngineInput(index=0, prompt_index=0, prompt_token_ids=list(PROMPT), params=params)]
    return GenerationStream(handle, inputs, "cmpl-t", JointPermit(limiter.acquire(1), None), timeout_s, IngressMetrics("m"))


async def test_no_first_output_within_the_deadline_is_a_504() -> None:
    handle, limiter = slow_handle(first_s=5.0, gap_s=0.0), InFlightLimiter(4)
    stream = stream_of(handle, 0.1, limiter)
    with pytest.raises(errors.APIError) as info:
        await asyncio.wait_for(stream.start(), timeout=5)
    assert info.value.status == 504
    assert limiter.in_flight == 0


async def test_a_stream_past_its_deadline_fails_mid_stream_and_is_cancelled() -> None:
    handle, limiter = slow_handle(first_s=0.0, gap_s=0.03), InFlightLimiter(4)
    stream = stream_of(handle, 0.2, limiter)
    await stream.start()
    tokens = 0
    with pytest.raises(errors.APIError) as info:
        async for event in stream:
            tokens += len(event.output.new_token_ids)
    assert info.value.status == 504
    assert 1 <= tokens < 50
    await asyncio.sleep(0)  # the feeding task's cancellation runs
    assert handle.calls[0].cancelled and limiter.in_flight == 0


async def test_a_stream_within_its_deadline_is_not_cut() -> None:
    handle, limiter = slow_handle(first_s=0.0, gap_s=0.0), InFlightLimiter(4)
    stream = stream_of(handle, 0.5, limiter)
    await stream.start()
    outs = [event.output async for event in stream]
    assert sum(len(o.new_token_ids) for o in outs) == 50 and outs[-1].finished
    await asyncio.sleep(0.6)  # the deadline passes after the stream closed: nothing is queued, nothing fails
    assert limiter.in_flight == 0
