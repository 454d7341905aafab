"""worker/serving/replica.py: what a worker replica does when Serve removes it (no Ray).

The replica is the real WorkerReplica over the real engine core with a model-free runner
(tests/integration/fake_engine_worker.py). `remove` calls `__del__` as Serve does: it awaits
a coroutine that `__del__` returns."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from tests.integration.fake_engine_worker import TOKEN, FakeEngineWorker
from worker.api import RequestOutput
from worker.api import GenerateRequest, ReplicaDrainingError
from worker.api import SamplingParams


def request(request_id: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, [3, 4, 5, 6], SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def collect(stream: AsyncIterator[RequestOutput], started: asyncio.Event | None = None) -> list[RequestOutput]:
    outputs = []
    async for out in stream:
        outputs.append(out)
        if started is not None:
            started.set()
    return outputs


async def remove(worker: FakeEngineWorker) -> None:
    pending = worker.__del__()
    if pending is not None:
        await pending


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


async def test_drain_finishes_open_streams_then_stops_the_engine() -> None:
    worker = FakeEngineWorker(max_num_seqs=2, step_s=0.005, drain_timeout_s=30.0)
    started = [asyncio.Event() for _ in range(3)]
    # Two running and one waiting (max_num_seqs 2) when the drain starts.
    streams = [asyncio.create_task(collect(worker.generate(request(f"r{i}", 40)), started[i])) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(started[0].wait(), started[1].wait()), timeout=10)
    assert worker.engine.stats().num_waiting == 1

    drain = asyncio.create_task(remove(worker))
    await asyncio.sleep(0)  # the drain has begun: new work is refused ...
    with pytest.raises(ReplicaDrainingError):
        await collect(worker.generate(request("late", 4)))
    assert not drain.done()  # ... and it waits for the open streams

    results = await asyncio.wait_for(asyncio.gather(*streams), timeout=20)
    await asyncio.wait_for(drain, timeout=10)
    for outputs in results:  # every stream ran to the end, none was cut
        assert tokens(outputs) == [TOKEN] * 40
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert worker.engine._thread is None  # the step thread stopped, after the streams


async def test_drain_hands_back_streams_that_outlive_the_timeout() -> None:
    worker = FakeEngineWorker(max_num_seqs=2, step_s=0.01, drain_timeout_s=0.2)
    started = asyncio.Event()
    outputs: list[RequestOutput] = []

    async def consume() -> None:
        async for out in worker.generate(request("long", 600)):
            outputs.append(out)
            started.set()

    stream = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=10)
    await asyncio.wait_for(remove(worker), timeout=10)
    # A replica failure (the ingress resumes the request elsewhere), not a finished request.
    with pytest.raises(ReplicaDrainingError, match="resume it on another replica"):
        await asyncio.wait_for(stream, timeout=5)
    assert 0 < len(tokens(outputs)) < 600 and not any(out.finished for out in outputs)
    assert worker.engine._thread is None and worker._streams == {} and worker._cut == set()


async def test_drain_hands_back_batched_requests_that_outlive_the_timeout() -> None:
    """The same on the batched output path (worker/outputs/streams.py): the request's own
    call fails as a replica failure, and its stream never carries an "abort" end."""
    worker = FakeEngineWorker(max_num_seqs=2, step_s=0.01, drain_timeout_s=0.2)
    batched = replace(request("long", 600), output_stream="ingress-1")
    sent: list[RequestOutput] = []

    async def call() -> None:
        async for _ in worker.generate(batched):  # one item: the replica's id
            pass

    async def read() -> None:
        async for batch in worker.outputs("ingress-1"):
            sent.extend(batch)

    control = asyncio.create_task(call())
    reader = asyncio.create_task(read())
    async with asyncio.timeout(10):
        while not sent:
            await asyncio.sleep(0.005)  # polling for the first output
    await asyncio.wait_for(remove(worker), timeout=10)
    with pytest.raises(ReplicaDrainingError, match="resume it on another replica"):
        await asyncio.wait_for(control, timeout=5)
    await asyncio.wait_for(reader, timeout=5)  # the stream ends: nothing in flight
    assert 0 < len(tokens(sent)) < 600 and not any(out.finished for out in sent)
    assert worker._streams == {} and worker._cut == set()


async def test_drain_of_an_idle_replica_is_immediate() -> None:
    worker = FakeEngineWorker()
    assert worker.__del__() is None  # nothing to wait for: stopped at once
    assert worker.engine._thread is None
    started = asyncio.Event()
    worker = FakeEngineWorker(step_s=0.001)
    assert len(tokens(await collect(worker.generate(request("done", 5)), started))) == 5
    assert worker.engine._thread is not None and worker.__del__() is None
    assert worker.engine._thread is None and worker.__del__() is None  # once only


async def test_autoscaling_stats_count_the_waiting_queue() -> None:
    worker = FakeEngineWorker(max_num_seqs=1, step_s=0.01)
    started = asyncio.Event()
    streams = [asyncio.create_task(collect(worker.generate(request(f"q{i}", 30)), started)) for i in range(4)]
    await asyncio.wait_for(started.wait(), timeout=10)
    # The engine thread takes new requests in at its next step: on a loaded machine the
    # first token can arrive before it has taken the other three, so wait for that step.
    stats = worker.record_autoscaling_stats()
    for _ in range(1000):
        if stats["num_waiting"] == 3.0:
            break
        await asyncio.sleep(0.01)  # poll the condition, bounded (10 s)
        stats = worker.record_autoscaling_stats()
    assert stats["num_running"] == 1.0 and stats["num_waiting"] == 3.0
    assert stats["num_waiting_prompt_tokens"] == 12.0 and 0.0 < stats["kv_usage"] < 1.0
    await asyncio.wait_for(asyncio.gather(*streams), timeout=20)
    await remove(worker)
