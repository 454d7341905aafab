"""The engine API everything above the worker uses: add a request and get an async
stream of outputs; abort; stats.

Threads: the step loop runs on its own thread and owns the engine core. Callers on the
asyncio loop talk to it through a thread-safe inbox (add / abort; worker/engine/inbox.py)
and receive outputs through one `call_soon_threadsafe` per step, into each request's sink
(worker/outputs/sink.py; `generate` iterates over one); neither side ever blocks the other. On a device that works beside the host, the loop publishes each step's
outputs, takes the stats and drains the inbox while the next step is on the device
(worker/scheduling/async_scheduler.py).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from worker.config import EngineConfig
from worker.kvcache.event_stream import KVEventStream
from worker.engine.core import Engine
from worker.engine.inbox import STOP, AbortRequest, AddRequest, ReleaseKV, ResetPrefixCache, UnloadLoRA
from worker.engine.stats import EngineStats
from worker.api import RequestError
from worker.outputs.processor import RequestOutputProcessor
from worker.outputs.sink import OutputSink, iterate
from worker.api import RequestOutput
from worker.api import SamplingParams
from worker.engine.overlap import AppliedStep
from worker.engine.build import build_engine
from worker.api import load_tokenizer

logger = logging.getLogger(__name__)

# The process's GIL switch interval while a step thread beside a device runs. When the
# device finishes a step, the step thread needs the GIL back to launch the next one; a
# thread holding it (the replica's event loop publishing outputs to its callers) gives it
# up only at the switch interval (Python's default: 5 ms), and a decode step only a few
# times longer would wait a large part of its length with the device idle.
STEP_THREAD_SWITCH_INTERVAL_S = 0.0005


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served by this engine."""


# How many cached block hashes are kept for prefix-aware routing. Chained hashes make a
# prefix match of depth d need all d hashes; the most recently cached are the likeliest.
MAX_PREFIX_HASHES = 4096


class AsyncEngine:
    def __init__(self, engine: Engine, tokenizer: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        # Per request, where the step loop's outputs go on the event loop: its sink.
        self._streams: dict[str, OutputSink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats: EngineStats = engine.stats()
        # KV events for the router's index, drained every step; the cached-hash snapshot it
        # rebuilds from is taken on the step thread (the pool is not thread-safe), at most
        # every period (worker/kvcache/event_stream.py).
        self.kv_events = KVEventStream(engine.enable_kv_events())
        self._prefix_hashes_time = 0.0
        self._dead: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        engine = build_engine(config)
        tokenizer = load_tokenizer(engine.model_path, config.model.trust_remote_code)
        compiler = engine.compiles.compiler
        # The structured-output tokenizer (slow for a large vocabulary) is built from the
        # replica's tokenizer on the compiler's thread while the replica serves: no start
        # waits for it, and only a grammar request arriving before it ends waits (for the
        # rest of it). Not during the weights' load: its Python work holds the GIL.
        if compiler is not None:
            compiler.prewarm(tokenizer)
        return cls(engine, tokenizer)

    # -- caller side (asyncio) ---------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            if self.engine.overlaps_device:
                sys.setswitchinterval(min(sys.getswitchinterval(), STEP_THREAD_SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        num_resumed_tokens: int = 0,
        export_kv: bool = False,
        kv_import: Any = None,
        lora: tuple[str, str | None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (`run_into` behind a queue). Leaving the iteration
        early (the caller went away, the task was cancelled) aborts the request; its blocks
        are freed within one step."""
        request_id = request_id or uuid.uuid4().hex

        def run(on_output: Callable[[RequestOutput], None]) -> Awaitable[None]:
            return self.run_into(prompt_token_ids, params, request_id, on_output, num_resumed_tokens, lora,
                                 export_kv=export_kv, kv_import=kv_import)

        async for out in iterate(run):
            yield out

    async def run_into(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        on_output: Callable[[RequestOutput], None],
        num_resumed_tokens: int = 0,
        lora: tuple[str, str | None] | None = None,
        text_at_end: bool = False,
        export_kv: bool = False,
        kv_import: Any = None,
        session_id: str | None = None,
    ) -> None:
        """Run a request whose outputs are handed to `on_output` in the event-loop turn that
        delivers their step: no task wakes per output (the batched output streams' path,
        worker/outputs/streams.py). Returns once the request finished; raises what failed
        it; cancelling it aborts the request.
        `num_resumed_tokens`: the prompt's last tokens are output a client already has (a
        migrated request); text deltas continue after them. `text_at_end`: the caller reads
        the text only at the end (worker/outputs/processor.py); unless a stop string must be
        watched for or logprobs were asked, the engine then makes no output between the
        first and the finished one (Engine.add_request's `quiet`). `export_kv` / `kv_import`:
        the prefill and decode halves of a disaggregated request (Engine.add_request).
        `session_id`: the client's session (Engine.add_request)."""
        self._ensure_started()
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.engine.validate(prompt_token_ids, params)  # reads config only: thread-safe
        if kv_import is not None:
            # Disaggregation, decode side: the first token was streamed by the prefill
            # replica; replay it so that text continues right after it.
            processor = RequestOutputProcessor(self.tokenizer, [*prompt_token_ids, kv_import.next_token_id], params,
                                               num_resumed_tokens + 1, text_at_end)
        else:
            processor = RequestOutputProcessor(self.tokenizer, prompt_token_ids, params, num_resumed_tokens,
                                               text_at_end)
        assert self._loop is not None
        sink = OutputSink(processor, on_output, self._loop.create_future(),
                          lambda: self._inbox.put(AbortRequest(request_id, notify=False)), export_kv,
                          on_end=lambda: self._forget(request_id, sink))
        self._streams[request_id] = sink
        self._inbox.put(AddRequest(request_id, list(prompt_token_ids), params, export_kv, kv_import, lora,
                                   processor.defers_text, num_resumed_tokens, session_id))
        try:
            await sink.done
        finally:
            self._forget(request_id, sink)
            if not sink.finished:
                self._inbox.put(AbortRequest(request_id, notify=False))

    def _forget(self, request_id: str, sink: OutputSink) -> None:
        if self._streams.get(request_id) is sink:  # not a later request that reused the id
            del self._streams[request_id]

    def release_kv(self, request_id: str) -> None:
        """The decode side has this request's exported KV (or gave up): unpin its blocks."""
        self._inbox.put(ReleaseKV(request_id))

    def abort(self, request_id: str) -> None:
        """Abort from outside the stream; the stream then ends with finish_reason 'abort'."""
        self._inbox.put(AbortRequest(request_id, notify=True))

    def stats(self) -> EngineStats:
        """A snapshot taken after the latest step (never blocks on the loop)."""
        return self._stats

    def prefix_hashes(self) -> list[int]:
        """Cached block hashes, most recent first, as of the latest snapshot."""
        return self.kv_events.snapshot.device

    def tier_prefix_hashes(self) -> tuple[list[int], list[int]]:
        """Block hashes in the host tier and on disk, most recent first (same snapshot)."""
        return self.kv_events.snapshot.host, self.kv_events.snapshot.disk

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (Engine.reset_prefix_cache) on the step thread;
        returns once done, its `cleared` event in a batch the next report carries."""
        self._ensure_started()
        assert self._loop is not None
        done = self._loop.create_future()
        self._inbox.put(ResetPrefixCache(done))
        await done

    async def unload_lora(self, name: str) -> bool:
        """Forget an unloaded adapter on the step thread (Engine.unload_lora)."""
        self._ensure_started()
        assert self._loop is not None
        done = self._loop.create_future()
        self._inbox.put(UnloadLoRA(name, done))
        return bool(await done)

    def _snapshot_prefix_hashes(self, period_s: float = 0.5) -> None:
        """This step's KV events as one batch; the cached-hash snapshot when due."""
        self.kv_events.drain()
        now = time.monotonic()
        if now - self._prefix_hashes_time >= period_s:
            host: list[int] = []
            disk: list[int] = []
            if self.engine.tiers is not None:
                host, disk = self.engine.tiers.routing_hashes(MAX_PREFIX_HASHES)
            self.kv_events.take_snapshot(self.engine.kv.cached_block_hashes(MAX_PREFIX_HASHES), host, disk)
            self._prefix_hashes_time = now

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(STOP)
            self._thread.join(timeout=30)
            self._thread = None

    # -- step-loop side (thread) ------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.engine.overlaps_device:
                self._run_overlapped()
            else:
                self._run_serial()
        except BaseException as e:  # a bug in the core: fail everything, loudly
            logger.exception("engine loop died")
            self._dead = e
            self._publish_error(EngineDeadError(f"the engine loop has stopped: {e}"))

    def _run_serial(self) -> None:
        """One step at a time: its outputs leave when it has run (a runner that computes on
        the host, where nothing could overlap)."""
        while True:
            block = not self.engine.has_unfinished()
            if not self._drain_inbox(block):
                return
            outputs = self.engine.step()
            self._after_step(outputs)

    def _run_overlapped(self) -> None:
        """Step N's outputs are built and published, the stats taken and the inbox drained
        while step N+1 is on the device (worker/scheduling/async_scheduler.py draws the timeline)."""
        applied: AppliedStep | None = None  # applied to the scheduler, outputs not yet built
        while True:
            if applied is None and not self.engine.has_unfinished():
                if not self._drain_inbox(block=True):
                    return
            launched = self.engine.launch_step()  # the device works from here
            outputs = self.engine.step_outputs(applied) if applied is not None else []
            self._after_step(outputs + launched.outputs)
            if not self._drain_inbox(block=False):
                return
            if launched.plan.is_empty:
                applied = None
                self.engine.wait_for_compiles()
                continue
            applied = self.engine.complete_step(launched)

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        """Stats, the prefix-hash snapshot, and the step's outputs to their streams."""
        self._stats = self.engine.stats()
        # Going idle: snapshot now, whatever the period, so that stats asked for while
        # idle (a router's warm start, the controller's poll) show the last request's
        # cached blocks; while busy, at most every 0.5 s (the walk is not free).
        self._snapshot_prefix_hashes(0.0 if not self.engine.has_unfinished() else 0.5)
        if outputs:
            self._publish(outputs)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds/aborts; wait for one when idle. False means stop."""
        while True:
            try:
                # Pinned KV exports expire even when no request is running.
                deadline = self.engine.next_pin_deadline() if block else None
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0) + 0.01
                item = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            block = False
            if item is STOP:
                return False
            if isinstance(item, AddRequest):
                try:
                    self.engine.add_request(
                        item.request_id, item.prompt_token_ids, item.params,
                        export_kv=item.export_kv, kv_import=item.kv_import, quiet=item.quiet,
                        num_resumed_tokens=item.num_resumed_tokens, session_id=item.session_id,
                        **({"lora_name": item.lora[0], "lora_path": item.lora[1]} if item.lora else {}),
                    )
                except RequestError as e:
                    self._publish([e], request_ids=[item.request_id])
            elif isinstance(item, ResetPrefixCache):
                self.engine.reset_prefix_cache()
                self.kv_events.cleared()
                self._snapshot_prefix_hashes(0.0)  # the next report carries the clear
                assert self._loop is not None
                self._loop.call_soon_threadsafe(_resolve, item.done)
            elif isinstance(item, UnloadLoRA):
                unloaded = self.engine.unload_lora(item.name)
                assert self._loop is not None
                self._loop.call_soon_threadsafe(_resolve, item.done, unloaded)
            elif isinstance(item, ReleaseKV):
                self.engine.release_kv(item.request_id)
            elif isinstance(item, AbortRequest):
                out = self.engine.abort_request(item.request_id)
                if out is not None and item.notify:
                    self._publish([out])

    def _publish(self, items: list[Any], request_ids: list[str] | None = None) -> None:
        assert self._loop is not None
        ids = request_ids or [o.request_id for o in items]
        self._loop.call_soon_threadsafe(self._deliver, ids, items)

    def _deliver(self, request_ids: list[str], items: list[Any]) -> None:
        for request_id, item in zip(request_ids, items):
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)  # a queue, or a sink that handles it now

    def _publish_error(self, error: BaseException) -> None:
        if self._loop is None:
            return

        def fail_all() -> None:
            for stream in self._streams.values():
                stream.put_nowait(error)

        self._loop.call_soon_threadsafe(fail_all)


def _resolve(done: asyncio.Future[Any], value: Any = None) -> None:
    if not done.done():
        done.set_result(value)
