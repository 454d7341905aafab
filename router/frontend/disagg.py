"""Prefill/decode disaggregation at the ingress: one engine request becomes a prefill call
on the prefill pool and a decode stream on the decode pool.

    ingress ── prefill.prefill(request) ──> prefill replica (KV-headroom router, prefix overlap)
       │  <── (first output, KVHandle)        computes the prompt, samples token 1, exports the
       │                                      KV (kv/transfer.py) and PINS its blocks
       ├── first output ──> client            (time to first token = prefill only)
       ├── decode.decode(request, KVHandle) ─> decode replica (KV-headroom router): fetches the
       │  <── outputs, batched per step ─────  KV, imports it into its own blocks, decodes
       │      (router/frontend/output_hub.py: one stream per decode replica for all requests)
       └── prefill.release_kv(request_id, replica_id=...) once the decode side streams
           (or gave up): the prefill replica unpins. Sent to THAT replica by
           the prefill pool's router (router/routing/serve_router.py); unacknowledged exports expire on the replica (kv/transfer.py's DEFAULT_PIN_TIMEOUT_S).

`DisaggregatedGenerate` looks like the worker handle's `generate` to GenerationStream
(`.generate.remote(request)` -> an async-iterable response with `cancel()`), so streaming,
timeouts, cancellation and migration work unchanged. A resumed (migrated) request goes
straight to the decode pool as a plain generate: it recomputes its prompt there.

Requests between their prefill and their first decode output wait here; at most
`max_waiting_for_decode` of them per ingress replica (beyond it: 429 before any work).
Once admitted a request is never dropped: it waits for a decode replica (Serve queues the
call while every decode replica is at max_ongoing_requests; a decode engine short of
blocks keeps the import in its own FIFO until blocks free up).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any


from router import errors
from router.frontend.intake import release_when_sent
from router.frontend.output_hub import OutputHub
from router.frontend.settings import MAX_WAITING_FOR_DECODE
from worker.api import GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)


class DecodeQueue:
    """Counts requests between admission and their first decode output; over `limit`, 429."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_waiting = 0

    def acquire(self) -> None:
        if self.num_waiting >= self.limit:
            raise errors.APIError(
                429, f"{self.num_waiting} requests are already waiting for a decode replica; retry later.",
                "rate_limit_error", None, "decode_pool_full",
            )
        self.num_waiting += 1

    def release(self) -> None:
        self.num_waiting -= 1


class _Method:
    def __init__(self, owner: DisaggregatedGenerate) -> None:
        self._owner = owner

    def remote(self, request: GenerateRequest) -> DisaggregatedResponse:
        return DisaggregatedResponse(self._owner, request)


class DisaggregatedGenerate:
    """Stands in for `worker_handle.options(stream=True)` in GenerationStream."""

    def __init__(self, prefill_handle: Any, decode_handle: Any, max_waiting_for_decode: int = MAX_WAITING_FOR_DECODE) -> None:
        self.prefill = prefill_handle.options(stream=False)
        # The decode pool's tokens come back batched, as a mixed pool's do.
        self.decode = OutputHub(decode_handle)
        self.queue = DecodeQueue(max_waiting_for_decode)
        self.generate = _Method(self)
        self._acks: set[asyncio.Task[Any]] = set()  # keep fire-and-forget acks alive

    def ack(self, request_id: str, replica_id: str) -> None:
        """Tell the prefill replica to unpin the request's blocks (never awaited inline)."""

        async def send() -> None:
            try:
                await self.prefill.release_kv.remote(request_id, replica_id=replica_id)
            except Exception as e:  # the pin expires on the replica anyway
                logger.warning("release_kv(%s) failed: %r", request_id, e)

        task = asyncio.get_running_loop().create_task(send())
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)


class DisaggregatedResponse:
    """One engine request, prefill then decode, as one async stream of RequestOutputs."""

    def __init__(self, owner: DisaggregatedGenerate, request: GenerateRequest) -> None:
        self._owner = owner
        self._request = request
        self._calls: list[Any] = []  # Serve responses in flight, for cancel()
        self._handle: Any = None  # KVHandle once the prefill returned one
        self._acked = False
        self._queued = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[RequestOutput]:
        owner, request = self._owner, self._request
        if getattr(request, "num_resumed_tokens", 0):  # migrated: recompute on the decode pool
            response = owner.decode.generate.remote(request)
            self._calls.append(response)
            async for out in response:
                yield out
            return
        owner.queue.acquire()
        self._queued = True
        try:
            prefill = owner.prefill.prefill.remote(request)
            release_when_sent(prefill)  # the next request's intake may start (router/frontend/intake.py)
            self._calls.append(prefill)
            first, self._handle = await prefill
            if first is None:
                raise RuntimeError(f"the prefill replica returned no output for {request.request_id}")
            if self._handle is None:  # finished with its first token (or failed): final
                yield first
                return
            decode = owner.decode.decode(request, self._handle)
            self._calls.append(decode)
            yield first  # time to first token: the prefill alone
            async for out in decode:
                self._ack()
                yield out
        finally:
            self._ack()

    def _ack(self) -> None:
        if self._queued:
            self._queued = False
            self._owner.queue.release()
        if self._handle is not None and not self._acked:
            self._acked = True
            self._owner.ack(self._handle.request_id, self._handle.source_replica_id)

    def cancel(self) -> None:
        """The client went away: cancel the calls (each side's engine aborts and frees its
        blocks) and release the prefill side's pinned copy."""
        for call in self._calls:
            try:
                call.cancel()
            except Exception:  # already finished
                pass
        self._ack()
