"""One API request's engine requests, sent to the workers and merged back into one stream.

    API request ──> n EngineInputs ──> n handle calls (stream=True), one task each
                                         │ RequestOutput ...
                                         v
                 consumer <── one asyncio.Queue of (choice index, output | exception)

Every engine request goes out through the worker DeploymentHandle, so the request
router (KV headroom) places each one; n > 1 choices share the prompt and find its blocks
in the prefix cache of whichever replica already holds them.

Ending the stream early (client gone, timeout, error) cancels every task; each cancels
its DeploymentResponseGenerator, Serve cancels the worker's generator, and the engine
aborts the request (its blocks are freed within one step). Nothing here blocks the event
loop or calls ray.get.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router import errors
from router.frontend.metrics import IngressMetrics
from router.frontend.migration import Migration, is_replica_failure
from router.frontend.openai_api.convert import EngineInput
from router.routing import NO_BOUND, ColdStartBound
from router.serve_internals import use_child_request_id
from router.tracing import RequestTrace
from worker.api import GenerateRequest, LoRANotFoundError, RequestError, RequestOutput, SamplingParamsError

if TYPE_CHECKING:
    from opentelemetry.trace import Span

logger = logging.getLogger(__name__)


class Permit:
    """A share of the ingress's in-flight bound; release() is idempotent."""

    def __init__(self, limiter: InFlightLimiter, weight: int) -> None:
        self._limiter = limiter
        self.weight = weight
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limiter._release(self.weight)

    def __del__(self) -> None:  # a stream dropped without closing must not leak its share
        self.release()


class InFlightLimiter:
    """Bounds what one ingress replica holds at once. Over the bound: 429 at once, so that
    overload shows up at the client instead of as an ever-growing queue here."""

    def __init__(self, limit: int, metrics: IngressMetrics | None = None) -> None:
        self.limit = limit
        self.in_flight = 0
        self._metrics = metrics
        self.draining = False  # shutting down: refuse new requests (503), finish the others

    def acquire(self, weight: int) -> Permit:
        if self.draining:
            raise errors.APIError(503, "The server is shutting down; retry on another instance.", "server_error", None, "shutting_down")
        # A request heavier than the whole bound still runs when it is alone.
        weight = min(weight, self.limit)
        if self.in_flight + weight > self.limit:
            if self._metrics is not None:
                self._metrics.rejected.labels(self._metrics.model_name, "overloaded").inc()
            raise errors.overloaded(self.limit)
        self.in_flight += weight
        self._report()
        return Permit(self, weight)

    def _release(self, weight: int) -> None:
        self.in_flight -= weight
        self._report()

    def _report(self) -> None:
        if self._metrics is not None:
            self._metrics.in_flight.labels(self._metrics.model_name).set(self.in_flight)


class StreamPermit(Protocol):
    """What a GenerationStream holds while it runs (router/frontend/key_limits.py's JointPermit):
    `settle(used)` refunds the unused part of the key's token charge, `release()` gives
    back the in-flight share and the key's slot. Both idempotent."""

    def settle(self, used_tokens: int) -> None: ...

    def release(self) -> None: ...


def api_error_of(error: BaseException) -> errors.APIError:
    """A worker-side or Serve exception as the API error a client should see."""
    cause = getattr(error, "cause", None) or error  # RayTaskError carries the original
    if isinstance(cause, errors.APIError):
        return cause
    if isinstance(cause, LoRANotFoundError):
        return errors.APIError(404, str(cause), "invalid_request_error", "model", "model_not_found")
    if isinstance(cause, (RequestError, SamplingParamsError)):
        return errors.bad_request(str(cause.args[0]) if cause.args else str(cause))
    name = type(cause).__name__
    if name == "BackPressureError":
        return errors.APIError(429, "The workers' queues are full; retry later.", "rate_limit_error", None, "server_overloaded")
    if name == "DeploymentUnavailableError" or is_replica_failure(error):
        return errors.APIError(503, f"No worker is available: {name}.", "server_error", None, "service_unavailable")
    logger.error("request failed: %r", error)
    return errors.internal(f"The request failed: {name}.")


_DEADLINE = object()  # queued when the request's time is up
_NOT_TAKEN = object()  # queued when no replica took an engine call within the cold-start bound


@dataclass
class ChoiceEvent:
    index: int
    output: RequestOutput


class _ChoiceTiming:
    __slots__ = ("last", "first_seen")

    def __init__(self) -> None:
        self.last = 0.0
        self.first_seen = False


class GenerationStream:
    """Async-iterate ChoiceEvents of all choices until every choice has finished.

    `start()` waits for the first output, so that errors the workers raise before any
    token (a prompt the pool can never hold, a dead engine) become a proper HTTP status
    rather than an error inside a 200 stream.
    """

    def __init__(
        self,
        generate_handle: Any,  # worker DeploymentHandle with options(stream=True)
        inputs: list[EngineInput],
        request_id: str,
        permit: StreamPermit,
        timeout_s: float,
        metrics: IngressMetrics,
        arrival_time: float | None = None,  # time.monotonic() when the HTTP request came in
        max_migrations: int = 2,  # resumes per engine request after a replica dies (router/frontend/migration.py)
        session_id: str | None = None,  # the client's session (router/routing/sessions.py), for the request router
        stream: bool = True,  # False: the client reads only the final text (workers may fold outputs)
        lora: tuple[str, str] | None = None,  # the LoRA adapter (name, path) that serves it
        # How long each engine call may wait for a replica to take it (router/routing/cold_start.py).
        cold_start: ColdStartBound = NO_BOUND,
    ) -> None:
        self._cold_start = cold_start
        self._stream = stream
        self._lora = lora
        self._handle = generate_handle
        self._session_id = session_id
        self._max_migrations = max_migrations
        self.num_migrations = 0
        self.inputs = inputs
        self.request_id = request_id
        self._permit = permit
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        # The deadline is one timer per request that queues _DEADLINE, not a timeout
        # around every wait for an output (that costs more than the wait itself).
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._metrics = metrics
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | object]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._unfinished = {inp.index for inp in inputs}
        self._first: ChoiceEvent | None = None
        self._start_time = arrival_time if arrival_time is not None else time.monotonic()
        self._timing = {inp.index: _ChoiceTiming() for inp in inputs}
        self._closed = False
        # Usage as the client is billed: each prompt once (its choices share it), counted
        # from the first output on, plus every choice's output tokens.
        self._prompt_tokens = sum({inp.prompt_index: len(inp.prompt_token_ids) for inp in inputs}.values())
        self._output_tokens = {inp.index: 0 for inp in inputs}
        self._started = False
        # OpenTelemetry spans of this request (router/tracing.py); None when tracing is off.
        self._trace = RequestTrace.start(request_id, self._start_time, len(inputs), self._prompt_tokens)
        self._error: BaseException | None = None

    @property
    def used_tokens(self) -> int:
        """Prompt + output tokens so far: what the key's token budget is settled with."""
        return (self._prompt_tokens if self._started else 0) + sum(self._output_tokens.values())

    async def start(self) -> None:
        self._deadline_timer = asyncio.get_running_loop().call_later(
            max(self._deadline - time.monotonic(), 0.0), self._queue.put_nowait, (-1, _DEADLINE))
        for inp in self.inputs:
            request = GenerateRequest(f"{self.request_id}-{inp.index}", inp.prompt_token_ids, inp.params,
                                      session_id=self._session_id, stream=self._stream,
                                      lora_name=self._lora[0] if self._lora else None,
                                      lora_path=self._lora[1] if self._lora else None)
            self._tasks.append(asyncio.create_task(self._feed(inp.index, request)))
        try:
            self._first = await self._next()
        except BaseException:
            self.close()
            raise

    async def _feed(self, index: int, request: GenerateRequest) -> None:
        use_child_request_id(index)  # this task's own context: the others are untouched
        if self._trace is None:
            await self._stream_choice(index, Migration(request, self._max_migrations), None)
            return
        request, span = self._trace.engine_request(request)
        migration = Migration(request, self._max_migrations)
        error: BaseException | None = None
        try:
            error = await self._stream_choice(index, migration, span)
        except BaseException as e:  # cancelled: the client left or the request ended
            error = e
            raise
        finally:
            RequestTrace.end_engine_request(span, len(migration.generated_token_ids), migration.num_migrations, error)

    async def _stream_choice(self, index: int, migration: Migration, span: Span | None) -> BaseException | None:
        """Stream one engine request into the queue, migrating it when its replica dies.
        Returns the error that ended it (also queued for the consumer), or None."""
        request = migration.request
        while True:
            response = self._handle.generate.remote(migration.request)
            finished = False
            bound = self._bound_taking(index, response)
            try:
                async for out in response:
                    finished = out.finished
                    self._queue.put_nowait((index, migration.observe(out)))
                return None
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                # The replica died mid-stream (or before the first token): resume elsewhere
                # from prompt + the tokens already streamed, within the migration limit.
                if migration.next_request(e) is None:
                    if migration.num_migrations:
                        logger.warning("request %s: replica failed again after %d migrations: %r",
                                       request.request_id, migration.num_migrations, e)
                    self._queue.put_nowait((index, e))
                    return e
                if span is not None:
                    RequestTrace.migrated(span, e, len(migration.generated_token_ids), migration.num_migrations)
                self.num_migrations += 1
                self._metrics.migrations.labels(self._metrics.model_name).inc()
                logger.warning("request %s: replica failed (%s); migrating with %d tokens (%d/%d)",
                               request.request_id, type(e).__name__, len(migration.generated_token_ids),
                               migration.num_migrations, migration.max_migrations)
                use_child_request_id(f"{index}-m{migration.num_migrations}")
            finally:
                if bound is not None:
                    bound.cancel()
                if not finished:
                    response.cancel()  # the worker's generator is cancelled -> engine abort

    def _bound_taking(self, index: int, response: Any) -> asyncio.TimerHandle | None:
        """A timer that fails the request (503) unless a replica has taken `response` within
        the cold-start bound; None without a bound, or for a call that does not say when it
        was taken (no `taken`: a disaggregated request's prefill answers with its output)."""
        max_wait_s = self._cold_start.max_wait_s
        if max_wait_s is None or not hasattr(response, "taken"):
            return None

        def check() -> None:
            if not response.taken:
                self._queue.put_nowait((index, _NOT_TAKEN))

        return asyncio.get_running_loop().call_later(max_wait_s, check)

    async def _next(self) -> ChoiceEvent:
        index, item = await self._queue.get()
        if item is _DEADLINE:
            self._error = errors.timed_out(self._timeout_s)
            raise self._error
        if item is _NOT_TAKEN:
            self._metrics.rejected.labels(self._metrics.model_name, "cold_start_timeout").inc()
            self._error = self._cold_start.error()
            raise self._error
        if isinstance(item, BaseException):
            self._error = api_error_of(item)
            raise self._error
        if item.finish_reason == "error":
            self._error = errors.internal(item.error or "The engine failed this request.")
            raise self._error
        self._observe(index, item)
        if item.finished:
            self._unfinished.discard(index)
        return ChoiceEvent(index, item)

    def _observe(self, index: int, out: RequestOutput) -> None:
        self._started = True
        self._output_tokens[index] = max(self._output_tokens[index], out.num_output_tokens)
        now = time.monotonic()
        timing = self._timing[index]
        if out.new_token_ids:
            if not timing.first_seen:
                timing.first_seen = True
                self._metrics.observe_first_token(now - self._start_time, out.num_cached_tokens)
            else:
                self._metrics.observe_inter_token(now - timing.last, len(out.new_token_ids))
            timing.last = now
        if out.finished:
            self._metrics.observe_finished(now - self._start_time, out.num_prompt_tokens, out.num_output_tokens, out.finish_reason)

    async def __aiter__(self) -> AsyncIterator[ChoiceEvent]:
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield first
            while self._unfinished:
                yield await self._next()
        finally:
            self.close()

    def close(self) -> None:
        """Cancel what is still running, settle the key's token charge with what was used
        (a request that failed before its first output is refunded in full), and give the
        permit back. Sync: safe in finally blocks of cancelled tasks."""
        if self._closed:
            return
        self._closed = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        for task in self._tasks:
            if not task.done():
                task.cancel()
        if self._trace is not None:
            self._trace.end(sum(self._output_tokens.values()), self._error)
        try:
            self._permit.settle(self.used_tokens)
        finally:
            self._permit.release()

    def __del__(self) -> None:
        try:
            self.close()
        except RuntimeError:  # collected after its event loop closed: nothing left to cancel
            pass
