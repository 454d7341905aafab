"""router/frontend/pipeline.py: admit -> convert -> charge -> stream -> settle, on the unit tests'
fake worker. Whatever stage refuses a request, it holds nothing afterwards; a finished,
failed or cancelled stream settles the key's token charge with what it used."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router import errors
from router.frontend.auth import Principal
from router.frontend.key_limits import KeyLimits
from router.frontend.openai_api.convert import EngineInput
from router.frontend.pipeline import RequestPipeline
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress
from worker.api import SamplingParams

KEY = Principal("key-1")
TOKENS_PER_MINUTE = 1000


def pipeline(max_concurrent: int | None = 1) -> tuple[RequestPipeline, Any, KeyLimits]:
    # A clock that stands still: the bucket never refills, so its level is exact.
    limits = KeyLimits(max_concurrent, TOKENS_PER_MINUTE, clock=lambda: 0.0)
    ingress = FakeIngress(max_queued_requests=4, key_limits=limits)
    return ingress.pipeline, ingress.worker, limits


def inputs(num_prompt_tokens: int, max_tokens: int, n: int = 1) -> Any:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return lambda max_model_len: [EngineInput(i, 0, list(range(5, 5 + num_prompt_tokens)), params) for i in range(n)]


def tokens_left(limits: KeyLimits) -> float:
    return limits.store.tokens_left(KEY.key_id, TOKENS_PER_MINUTE)  # type: ignore[attr-defined]


def holds_nothing(p: RequestPipeline, limits: KeyLimits) -> bool:
    return p.limiter.in_flight == 0 and limits.store.in_flight(KEY.key_id) == 0  # type: ignore[attr-defined]


async def test_a_finished_request_is_charged_what_it_used() -> None:
    p, _, limits = pipeline(2)  # n=2: two engine requests, both inside the key's limit
    stream = await p.start(KEY, 2, 10, inputs(4, 3, n=2), "r", 0.0)
    # Admitted and charged the worst case: the prompt once, max_tokens per choice.
    assert p.limiter.in_flight == 2 and tokens_left(limits) == TOKENS_PER_MINUTE - (4 + 2 * 3)
    events = [e async for e in stream]
    assert len(events) == 6 and stream.used_tokens == 4 + 2 * 3
    assert holds_nothing(p, limits) and tokens_left(limits) == TOKENS_PER_MINUTE - 10


async def test_the_session_rides_on_every_engine_request() -> None:
    p, worker, _ = pipeline(None)
    stream = await p.start(KEY, 2, 10, inputs(4, 1, n=2), "r", 0.0, session_id="s-1")
    [e async for e in stream]
    assert [call.request.session_id for call in worker.calls] == ["s-1", "s-1"]
    stream = await p.start(KEY, 1, 10, inputs(4, 1), "r2", 0.0)
    [e async for e in stream]
    assert worker.calls[-1].request.session_id is None


async def test_a_cancelled_stream_is_charged_only_what_it_produced() -> None:
    p, worker, limits = pipeline()
    worker.hold = True
    stream = await p.start(KEY, 1, 10, inputs(4, 2), "r", 0.0)
    [e async for e in _first_two(stream)]  # both tokens; the call then waits, unfinished
    stream.close()
    await asyncio.sleep(0)
    assert worker.calls[0].cancelled and holds_nothing(p, limits)
    assert tokens_left(limits) == TOKENS_PER_MINUTE - (4 + 2)


async def _first_two(stream: Any) -> Any:
    count = 0
    async for event in stream:
        yield event
        count += 1
        if count == 2:
            return


@pytest.mark.parametrize(
    ("stage", "status"),
    [("admit", 429), ("convert", 400), ("charge", 429), ("stream", 503)],
)
async def test_a_request_refused_at_any_stage_holds_nothing(stage: str, status: int) -> None:
    p, worker, limits = pipeline()
    to_inputs = inputs(4, 3)
    held = None
    if stage == "admit":  # the key's only slot is taken
        held = await p.start(KEY, 1, 10, inputs(4, 3), "held", 0.0)
    elif stage == "convert":
        def to_inputs(max_model_len: int) -> list[EngineInput]:  # noqa: F811
            raise errors.bad_request("no")
    elif stage == "charge":
        to_inputs = inputs(4, TOKENS_PER_MINUTE)  # more than a minute's budget
    else:
        from tests.unit.router.frontend.grpc_api.test_grpc_servicer import EngineDeadError

        worker.fail = EngineDeadError("the engine loop has stopped")
    before = tokens_left(limits)
    with pytest.raises(errors.APIError) as info:
        await p.start(KEY, 1, 10, to_inputs, "r", 0.0)
    assert info.value.status == status
    assert before == TOKENS_PER_MINUTE - (held is not None) * (4 + 3)  # only the held request is charged
    used_by_held = 0
    if held is not None:
        held.close()
        used_by_held = held.used_tokens  # its prompt and first token
    assert holds_nothing(p, limits)
    # Refused before any output: nothing charged; the held request settled what it used.
    assert tokens_left(limits) == TOKENS_PER_MINUTE - used_by_held
