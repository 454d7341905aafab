"""router/frontend/output_hub.py over real worker replicas (worker/serving/replica.py with the real
engine core and a model-free runner), no Ray: a stand-in handle dispatches calls to the
replicas in this event loop as Serve would (a `replica_id` kwarg names the replica, as
router/routing/serve_router.py honours it; `.cancel()` cancels the call's generator).

What it pins down: outputs of many requests come back in per-step lists, not one object
per output; each request sees exactly its own tokens; a cancelled request is aborted on its
replica; a stream that ended while idle is reopened for the next request; a dead replica
fails every request waiting on it with a replica failure (which migration resumes)."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.frontend.intake import IntakeWindow
from router.frontend.migration import is_replica_failure
from router.frontend.output_hub import OutputHub
from tests.integration.fake_engine_worker import TOKEN, FakeEngineWorker
from worker.api import GenerateRequest, RequestOutput, SamplingParams


class _Call:
    """One Serve streaming call: iterate it once; cancel() cancels the replica's generator."""

    def __init__(self, gen: AsyncIterator[Any]) -> None:
        self._gen = gen
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump())
        # Serve's: resolved once the call is routed and sent (router/serve_internals.py when_sent).
        self._replica_result_future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(self._replica_result_future.set_result, None)

    async def _pump(self) -> None:
        try:
            async for item in self._gen:
                self._queue.put_nowait(("item", item))
            self._queue.put_nowait(("end", None))
        except asyncio.CancelledError:
            await self._gen.aclose()
            raise
        except BaseException as e:
            self._queue.put_nowait(("error", e))

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            kind, value = await self._queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value

    def cancel(self) -> None:
        self._task.cancel()

    def die(self) -> None:
        """The replica's process is gone: the call fails as Ray's calls to a dead actor do."""
        self._task.cancel()
        self._queue.put_nowait(("error", ActorDiedError("the actor died unexpectedly")))


class ActorDiedError(Exception):
    """Named as Ray's: migration recognises a replica failure by the error's class name."""


class _Method:
    def __init__(self, handle: FakeHandle, name: str) -> None:
        self._handle, self._name = handle, name

    def remote(self, *args: Any, **kwargs: Any) -> _Call:
        return self._handle.call(self._name, args, kwargs)


class FakeHandle:
    """Round robin over live replicas; a call naming `replica_id` goes there, or, when that
    replica is gone, anywhere (the router's rule)."""

    def __init__(self, replicas: list[FakeEngineWorker]) -> None:
        self.replicas = {r.replica_id: r for r in replicas}
        self._next = itertools.count()
        self.calls: dict[str, int] = {}
        self._open: dict[str, list[_Call]] = {}  # replica id -> its calls

    def options(self, **_: Any) -> FakeHandle:
        return self

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        self.calls[name] = self.calls.get(name, 0) + 1
        live = list(self.replicas.values())
        target = self.replicas.get(kwargs.get("replica_id", ""))
        replica = target or live[next(self._next) % len(live)]
        call = _Call(getattr(replica, name)(*args, **kwargs))
        self._open.setdefault(replica.replica_id, []).append(call)
        return call

    def kill(self, replica_id: str) -> None:
        del self.replicas[replica_id]
        for call in self._open.pop(replica_id, []):
            call.die()


def replicas(n: int, **kwargs: Any) -> list[FakeEngineWorker]:
    out = []
    for i in range(n):
        worker = FakeEngineWorker(**kwargs)
        worker.replica_id = f"replica-{i}"
        out.append(worker)
    return out


def request(request_id: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, [3, 4, 5, 6], SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def collect(response: Any) -> list[RequestOutput]:
    return [out async for out in response]


def stop(workers: list[FakeEngineWorker]) -> None:
    for worker in workers:
        worker.engine.shutdown()


async def test_many_requests_share_one_stream_per_replica_in_step_batches() -> None:
    workers = replicas(2, max_num_seqs=16, step_s=0.002)
    handle = FakeHandle(workers)
    hub = OutputHub(handle)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(hub.generate.remote(request(f"r{i}", 20))) for i in range(16))), timeout=30)
    finally:
        stop(workers)
    for outputs in results:
        assert [t for out in outputs for t in out.new_token_ids] == [TOKEN] * 20
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert sum(1 for out in outputs if out.finished) == 1
    # 16 requests x 20 outputs each arrived in far fewer lists: one per step per replica.
    assert hub.num_batches <= 2 * 21 + 4
    assert handle.calls["outputs"] <= 4  # one stream per replica (maybe reopened once)
    assert not hub._queues and not hub._readers  # nothing left behind


async def test_cancel_aborts_on_the_replica_and_others_go_on() -> None:
    workers = replicas(1, max_num_seqs=4, step_s=0.005)
    hub = OutputHub(FakeHandle(workers))
    try:
        keep = asyncio.ensure_future(collect(hub.generate.remote(request("keep", 30))))
        doomed = hub.generate.remote(request("doomed", 1000))
        seen = 0
        async for out in doomed:
            seen += len(out.new_token_ids)
            if seen >= 3:
                break
        doomed.cancel()
        kept = await asyncio.wait_for(keep, timeout=30)
        engine = workers[0].engine
        await asyncio.wait_for(_until(lambda: not engine.engine.has_unfinished()), timeout=10)
    finally:
        stop(workers)
    assert [t for out in kept for t in out.new_token_ids] == [TOKEN] * 30
    assert engine.stats().kv.usage == 0.0  # the aborted request's blocks are free


async def test_a_stream_that_ended_idle_is_reopened_for_the_next_request() -> None:
    workers = replicas(1, max_num_seqs=4, step_s=0.001)
    handle = FakeHandle(workers)
    hub = OutputHub(handle)
    try:
        first = await asyncio.wait_for(collect(hub.generate.remote(request("a", 5))), timeout=10)
        await asyncio.wait_for(_until(lambda: not hub._readers), timeout=10)  # the idle stream ended
        second = await asyncio.wait_for(collect(hub.generate.remote(request("b", 5))), timeout=10)
    finally:
        stop(workers)
    # A reader slower than the steps gets several steps' tokens in one output (absorb).
    assert sum(len(o.new_token_ids) for o in first) == 5 and first[-1].finished and second[-1].finished
    assert handle.calls["outputs"] == 2


async def test_a_dead_replica_fails_its_waiting_requests_as_replica_failures() -> None:
    workers = replicas(2, max_num_seqs=4, step_s=0.01)
    handle = FakeHandle(workers)
    hub = OutputHub(handle)
    try:
        on_0 = hub.generate.remote(request("x", 500))  # round robin: replica-0
        on_1 = asyncio.ensure_future(collect(hub.generate.remote(request("y", 10))))  # replica-1
        async for _ in on_0:
            break
        handle.kill("replica-0")  # its calls fail as Ray's do; a call naming it lands elsewhere
        with pytest.raises(Exception) as failure:
            async for _ in on_0:
                pass
        other = await asyncio.wait_for(on_1, timeout=10)
    finally:
        stop(workers)
    assert is_replica_failure(failure.value)
    assert other[-1].finished


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


async def test_a_non_streamed_request_gets_its_first_output_and_then_the_rest_in_one() -> None:
    workers = replicas(1, max_num_seqs=4, step_s=0.002)
    hub = OutputHub(FakeHandle(workers))
    try:
        plain = replace(request("plain", 40), stream=False)
        outputs = await asyncio.wait_for(collect(hub.generate.remote(plain)), timeout=30)
    finally:
        stop(workers)
    assert [len(o.new_token_ids) for o in outputs] == [1, 39] and outputs[-1].finished
    assert outputs[-1].num_output_tokens == 40


async def test_a_request_gives_back_its_intake_slot_once_its_call_is_sent() -> None:
    workers = replicas(1, max_num_seqs=4, step_s=0.002)
    hub = OutputHub(FakeHandle(workers))
    window = IntakeWindow(1, max_waiting=16, hold_s=3600.0)
    try:
        async with window.slot() as slot:
            assert slot is not None
            response = hub.generate.remote(request("r1", 4))
            assert slot.held  # not sent yet
            for _ in range(3):
                await asyncio.sleep(0)
            assert not slot.held and window.num_held == 0  # sent: the next request may start
        assert [o.finished for o in await collect(response)][-1]
    finally:
        stop(workers)
