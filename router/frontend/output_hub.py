"""The ingress end of the batched output streams (worker/outputs/streams.py).

Every engine request still goes out as its own routed `generate` call (the request router
places it; cancelling it aborts the request; a dead replica fails it, which migration
resumes), but that call carries only one item back: the id of the replica that took it.
The tokens come back on one `outputs` stream per worker replica, shared by every request
this ingress has there, one list per engine step; the hub hands each output to its
request's queue:

    generate.remote(r1) ──> "replica A"      outputs(stream, replica_id=A) ──> [o(r1), o(r2)]
    generate.remote(r2) ──> "replica A"                                  ──> [o(r1), o(r2)] ...
                                                    │ demux by request id
    r1's queue <── o(r1) ...        r2's queue <── o(r2) ...

A stream ends on the worker when none of its requests is in flight; the hub opens it
again while a request there still waits for outputs. A stream that fails (the replica
died) fails every request waiting on it, each with the replica's error.

`OutputHub.generate` stands in for `worker_handle.options(stream=True).generate` in
router/frontend/generation.py: `.remote(request)` returns an async iterator of
RequestOutputs with `.cancel()`. `OutputHub.decode` does the same for a disaggregated
request's decode half (router/frontend/disagg.py): the decode replica imports the KV
the prefill replica exported, and its tokens come back on the same batched stream.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from router.frontend.intake import release_when_sent
from worker.api import GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)

# Pause before reopening a stream that came back empty while requests still wait on it.
_EMPTY_STREAM_BACKOFF_S = 0.01


class OutputHub:
    """One per ingress process and worker deployment."""

    def __init__(self, worker_handle: Any) -> None:
        self.stream_id = uuid.uuid4().hex
        self._calls = worker_handle.options(stream=True)
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._replica_of: dict[str, str] = {}  # request id -> replica id, once it answered
        self._waiting: dict[str, set[str]] = {}  # replica id -> request ids waiting for outputs
        self._readers: dict[str, asyncio.Task[None]] = {}  # replica id -> its stream's reader
        self._finished: set[str] = set()  # finished output delivered, request not yet closed
        self.generate = _GenerateMethod(self)
        self.num_batches = 0  # lists received (tests, metrics)

    # -- one request -----------------------------------------------------------------------
    def open(self, request: GenerateRequest, kv_handle: Any = None) -> BatchedResponse:
        """The request's `generate` call, or with `kv_handle` its `decode` call (the decode
        half of a disaggregated request), its outputs read from this hub."""
        request = replace(request, output_stream=self.stream_id)
        if request.request_id in self._queues:
            raise ValueError(f"request id {request.request_id!r} is already in flight on this ingress")
        self._queues[request.request_id] = asyncio.Queue()
        call = (self._calls.generate.remote(request) if kv_handle is None
                else self._calls.decode.remote(request, kv_handle))
        release_when_sent(call)  # the next request's intake may start (router/frontend/intake.py)
        return BatchedResponse(self, request, call)

    def decode(self, request: GenerateRequest, kv_handle: Any) -> BatchedResponse:
        return self.open(request, kv_handle)

    def attach(self, request_id: str, replica_id: str) -> None:
        """The request runs on `replica_id`: read that replica's stream."""
        if request_id not in self._queues or request_id in self._finished:
            return  # already ended, or its outputs all came before its replica's answer
        self._replica_of[request_id] = replica_id
        self._waiting.setdefault(replica_id, set()).add(request_id)
        if replica_id not in self._readers:
            # A fresh context: Serve makes every call a task sends a child of the request the
            # task's context belongs to, and cancels the children with it. The stream serves
            # every request here, so it must not die with the one that happened to open it.
            self._readers[replica_id] = asyncio.get_running_loop().create_task(
                self._read(replica_id), context=contextvars.Context())

    def fail(self, request_id: str, error: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._finished.discard(request_id)
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is not None:
            waiting = self._waiting.get(replica_id)
            if waiting is not None:
                waiting.discard(request_id)

    # -- one replica's stream ----------------------------------------------------------------
    async def _read(self, replica_id: str) -> None:
        try:
            while self._waiting.get(replica_id):
                stream = self._calls.outputs.remote(self.stream_id, replica_id=replica_id)
                num_batches = self.num_batches
                try:
                    async for batch in stream:
                        self._deliver(batch)
                except asyncio.CancelledError:
                    stream.cancel()
                    raise
                if self.num_batches == num_batches:
                    # Nothing pending there: the requests still waiting here ended on the
                    # worker without output (an error their own calls are bringing), so
                    # do not spin on empty streams while those calls arrive.
                    await asyncio.sleep(_EMPTY_STREAM_BACKOFF_S)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the replica is gone: its requests resume elsewhere
            logger.warning("output stream of replica %s failed: %r", replica_id, e)
            for request_id in list(self._waiting.get(replica_id, ())):
                self.fail(request_id, e)
        finally:
            self._readers.pop(replica_id, None)
            if not self._waiting.get(replica_id):
                self._waiting.pop(replica_id, None)

    def _deliver(self, batch: list[RequestOutput]) -> None:
        self.num_batches += 1
        for out in batch:
            queue = self._queues.get(out.request_id)
            if queue is not None:  # else cancelled here: its abort is on the way
                queue.put_nowait(out)
                if out.finished:
                    self._done_on_replica(out.request_id)

    def _done_on_replica(self, request_id: str) -> None:
        self._finished.add(request_id)
        replica_id = self._replica_of.get(request_id)
        if replica_id is not None:
            self._waiting.get(replica_id, set()).discard(request_id)


class _GenerateMethod:
    def __init__(self, hub: OutputHub) -> None:
        self._hub = hub

    def remote(self, request: GenerateRequest) -> BatchedResponse:
        return self._hub.open(request)


class BatchedResponse:
    """One engine request's outputs, read from the hub; `cancel()` aborts it on the worker
    (its `generate` call is cancelled, as Serve cancels any call)."""

    def __init__(self, hub: OutputHub, request: GenerateRequest, call: Any) -> None:
        self._hub = hub
        self._request_id = request.request_id
        self._call = call
        self._control: asyncio.Task[None] | None = None
        self._ended = False
        self.taken = False  # a replica took the call (its first item, the replica's id, came)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[RequestOutput]:
        hub, request_id = self._hub, self._request_id
        queue = hub._queues[request_id]
        self._control = asyncio.get_running_loop().create_task(self._watch_call())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    self._ended = True
                    return
        finally:
            hub.close(request_id)

    async def _watch_call(self) -> None:
        """The request's own call: its first item says where it runs; an error ends it."""
        try:
            async for replica_id in self._call:
                self.taken = True
                self._hub.attach(self._request_id, replica_id)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._hub.fail(self._request_id, e)

    def cancel(self) -> None:
        if not self._ended:
            self._call.cancel()
        if self._control is not None and not self._control.done():
            self._control.cancel()
        self._hub.close(self._request_id)
