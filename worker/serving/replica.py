"""The worker replica: one engine per Ray Serve replica (later: per tensor-parallel group).

cluster/ wraps this class with `serve.deployment(...)`; it stays free of HTTP, gRPC and
Redis. Ray Serve calls `record_routing_stats` (the KV-headroom router reads it) and
`record_autoscaling_stats` (the autoscaling policy reads it) periodically.

Removal (scale-down, redeploy, shutdown), as Ray Serve 2.60 does it: the controller stops
routing to the replica, which then waits, polling every graceful_shutdown_wait_loop_s, until
its ongoing requests (streams included) have finished; then it rejects new handle calls
(callers retry another replica), calls `__del__`, and the controller kills the actor. The
controller kills it anyway after graceful_shutdown_timeout_s (cluster/: drain_timeout_s).
`__del__` keeps the same order on its own: refuse new streams, let running ones finish,
and only then stop the engine thread (stopping it first would strand their streams).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import replace
from typing import Any

from kv.transfer import KVHandle, KVTransport, make_transport
from worker.serving import tracing
from worker.api import GenerateRequest, ReplicaDrainingError, RequestOutput
from worker.engine.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.outputs.sink import iterate
from worker.outputs.streams import OutputStreams
from worker.serving.routing_report import build_routing_stats
from worker.runner.protocols import HealthCheckedRunner

logger = logging.getLogger(__name__)


class WorkerReplica:
    def __init__(
        self, engine_config: EngineConfig, drain_timeout_s: float = 60.0, setup: Callable[[], object] | None = None,
        stream_interval_s: float = 0.0,
    ) -> None:
        if setup is not None:  # this process's set-up from cluster/ (tracing: cluster/tracing.py)
            setup()
        self._attach(AsyncEngine.from_config(engine_config), engine_config.cache.block_size, drain_timeout_s,
                     stream_interval_s)
        logger.info("worker replica ready: %s", engine_config.model.model)

    def _attach(self, engine: AsyncEngine, block_size: int, drain_timeout_s: float, stream_interval_s: float = 0.0) -> None:
        """Everything but building the engine (tests attach an engine with a fake runner)."""
        self.engine = engine
        self.block_size = block_size
        self.drain_timeout_s = drain_timeout_s
        self._draining = False
        self._stopped = False
        self._streams: dict[object, str] = {}  # open generate() streams -> request id
        self._cut: set[object] = set()  # streams the drain timeout ended (handed back)
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        # Batched outputs per ingress, paced by stream_interval_s (worker/outputs/streams.py).
        self._outboxes = OutputStreams(stream_interval_s)
        self.replica_id = _replica_id()  # Serve's unique id; what callers name this replica by

    async def generate(
        self, request: GenerateRequest, kv_handle: KVHandle | None = None
    ) -> AsyncIterator[RequestOutput | str]:
        """Stream outputs as they are produced. If the caller goes away, Serve cancels this
        generator and the engine aborts the request (blocks freed within one step).

        With `request.output_stream` set, the outputs go to that stream's outbox instead
        (worker/outputs/streams.py: one list per step for all of the ingress's requests,
        drained by `outputs`). This call then yields one item, this replica's id, so the
        caller knows which replica's stream to read, and ends when the request has."""
        stream_id = request.output_stream
        if stream_id is None:
            async for out in iterate(lambda on_output: self._run(request, on_output, kv_handle)):
                yield out
            return
        self._outboxes.open_request(stream_id, request.request_id, hold=not request.stream)
        try:
            yield self.replica_id
            # A non-streamed answer is read at its end: the engine makes no output between
            # its first and its last (AsyncEngine.run_into's text_at_end).
            await self._run(request, lambda out: self._outboxes.put(stream_id, out), kv_handle,
                            text_at_end=not request.stream and kv_handle is None)
        finally:
            self._outboxes.close_request(stream_id, request.request_id)

    async def outputs(self, stream_id: str, replica_id: str = "") -> AsyncIterator[list[RequestOutput]]:
        """The outputs of every request sent with `output_stream=stream_id`, one list per
        drain (a step's worth, or more when the caller reads slower than steps come).
        `replica_id` is for the router (router/routing/serve_router.py sends the call to that
        replica); a call that reached another replica fails, as that replica is gone."""
        if replica_id and replica_id != self.replica_id:
            raise ReplicaDrainingError(f"output stream for replica {replica_id} reached {self.replica_id}: "
                                       "that replica is gone; resume its requests elsewhere")
        async for batch in self._outboxes.drain(stream_id):
            yield batch

    async def _run(self, request: GenerateRequest, on_output: Callable[[RequestOutput], None],
                   kv_handle: KVHandle | None = None, *, text_at_end: bool = False, export_kv: bool = False,
                   call: str | None = None) -> None:
        """Run one request on the engine, its outputs handed to `on_output`: every request
        this replica serves takes this path (plain, traced, KV import or export).

        The cut-short rule: a request the drain timeout ended (`_cut`) ends in the engine
        with "abort"; that is a replica failure, not an abort the client asked for, so it
        is not handed on but raised as ReplicaDrainingError, which the ingress resumes on
        another replica (router/frontend/migration.py)."""
        with self._tracked(request) as key:
            kv_import = await self._kv_transport().receive(kv_handle) if kv_handle is not None else None
            trace = (tracing.CallTrace(request, self.replica_id, call or ("decode" if kv_handle else "generate"))
                     if tracing.is_traced(request) else None)  # spans at the end, from recorded times
            cut_short = False

            def deliver(out: RequestOutput) -> None:
                nonlocal cut_short, trace
                if key in self._cut and out.finished and out.finish_reason == "abort":
                    cut_short = True
                    return
                if trace is not None:
                    trace.observe(out)
                if out.finished:  # the request's bookkeeping ends before its caller sees the end
                    if trace is not None:
                        trace, last = None, trace
                        last.end()
                    self._untrack(key)
                on_output(self._output(out))

            error: BaseException | None = None
            try:
                await self.engine.run_into(request.prompt_token_ids, request.params, request.request_id, deliver,
                                           request.num_resumed_tokens, lora=_lora_of(request),
                                           text_at_end=text_at_end, export_kv=export_kv, kv_import=kv_import,
                                           session_id=request.session_id)
            except BaseException as e:
                error = e
                raise
            finally:
                if trace is not None:
                    trace.end(error)
            if cut_short:
                raise ReplicaDrainingError("this worker replica was removed before the request "
                                           "finished; resume it on another replica")

    def _output(self, out: RequestOutput) -> RequestOutput:
        """Every output this replica sends passes here (a test double tags its outputs)."""
        return out

    @contextlib.contextmanager
    def _tracked(self, request: GenerateRequest) -> Iterator[object]:
        """The request counts as an open stream (the drain waits for it) while inside."""
        if self._draining:
            raise ReplicaDrainingError("this worker replica is shutting down; retry on another replica")
        key = object()  # not the request id: a duplicate id must not untrack the original
        self._streams[key] = request.request_id
        self._no_streams.clear()
        try:
            yield key
        finally:
            self._untrack(key)

    def _untrack(self, key: object) -> None:
        """The request no longer counts as open (once: its last output or its end)."""
        if self._streams.pop(key, None) is None:
            return
        self._cut.discard(key)
        if not self._streams:
            self._no_streams.set()

    # -- prefill/decode disaggregation (kv/transfer.py, router/frontend/disagg.py) -------------------
    async def prefill(self, request: GenerateRequest) -> tuple[RequestOutput | None, KVHandle | None]:
        """Compute the prompt's KV and first token; export the KV. Returns the first output
        and a handle to the KV, or no handle when the request ends with that token (then
        the output is final). The exported blocks stay pinned until `release_kv` (the
        decode side has them) or the engine's pin timeout."""
        params, prompt = request.params, request.prompt_token_ids
        outputs: list[RequestOutput] = []
        if params.max_tokens == 1 or len(prompt) + 1 >= self.engine.engine.max_model_len:
            await self._run(request, outputs.append)
            return (outputs[-1] if outputs else None), None
        prefill = replace(request, params=replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)))
        await self._run(prefill, outputs.append, export_kv=True, call="prefill")
        last = outputs[-1] if outputs else None
        export = last.extra.pop("kv_export", None) if last is not None else None
        if last is None or last.finished or export is None:
            self.engine.release_kv(request.request_id)
            return last, None
        return last, self._kv_transport().send(export, self.replica_id)

    async def decode(self, request: GenerateRequest, kv_handle: KVHandle) -> AsyncIterator[RequestOutput]:
        """Continue a request a prefill replica started: import its KV, then stream the
        tokens after the first one."""
        async for out in self.generate(request, kv_handle=kv_handle):
            yield out

    async def release_kv(self, request_id: str, replica_id: str = "") -> None:
        """The decode side has the request's KV (or gave up on it): free the prefill copy.
        `replica_id` is for the router (router/frontend/disagg.py sends it to that replica)."""
        self.engine.release_kv(request_id)
        self._kv_transport().release(request_id)

    def _kv_transport(self) -> KVTransport:
        transport = self.__dict__.get("kv_transport")
        if transport is None:
            transport = self.kv_transport = make_transport(_default_kv_transport())
        return transport

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def record_routing_stats(self) -> dict:
        return build_routing_stats(self.engine.engine, self.engine.stats(), [], time.time(), self._is_healthy(),
                                   kv_events=self.engine.kv_events.report()).to_dict()

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (device, host tier, local disk), as vLLM's
        POST /reset_prefix_cache; the router's index drops them at the next report."""
        await self.engine.reset_prefix_cache()

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.engine.stats()
        return {
            "num_waiting": float(stats.num_waiting),
            "num_waiting_prompt_tokens": float(stats.num_waiting_prompt_tokens),
            "num_running": float(stats.num_running),
            "kv_usage": stats.kv.usage,
            # Totals since the engine started (the SLO planner takes their differences).
            "num_arrived": float(stats.num_arrived),
            "num_arrived_prompt_tokens": float(stats.num_arrived_prompt_tokens),
            "num_generated_tokens": float(stats.num_generated_tokens),
        }

    async def stats(self) -> dict[str, float | str]:
        """Engine stats plus `replica_id` (the ingress labels per-replica metrics with it;
        it gathers these from every replica with DeploymentHandle.broadcast)."""
        stats: dict[str, float | str] = {**self.engine.stats().to_dict(), "replica_id": self.replica_id}
        modelled = getattr(self.engine.engine.runner, "total_step_s", None)
        if modelled is not None:  # a simulated device: the device seconds its steps model
            stats["modelled_device_s"] = float(modelled)
        return stats

    async def check_lora(self, name: str, path: str, roots: tuple[str, ...] = ()) -> tuple[str, str]:
        """Read a PEFT adapter as a request would, off the event loop: raises
        LoRAAdapterError saying what is wrong (the load API's 400); returns its resolved
        directory and content digest (worker/lora/identity.py)."""
        return await asyncio.to_thread(self.engine.engine.check_lora, name, path, tuple(roots))

    async def unload_lora(self, name: str) -> bool:
        """The ingress unloaded `name`: this replica forgets it and its weights (True when it
        knew it)."""
        return await self.engine.unload_lora(name)

    async def model_info(self) -> dict:
        eng = self.engine.engine
        return {"max_model_len": eng.max_model_len, "vocab_size": eng.vocab_size, "block_size": self.block_size}

    def _is_healthy(self) -> bool:
        try:
            self.check_health()
            return True
        except Exception:
            return False

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError("engine loop has stopped")
        # A tensor-parallel runner with a dead rank cannot recover: Serve must replace us.
        runner = self.engine.engine.runner
        if isinstance(runner, HealthCheckedRunner):
            runner.check_health()
        tiers = self.engine.engine.tiers  # a hung KV tier store (worker/kvcache/tiers.py)
        if tiers is not None:
            tiers.check_health()

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Serve calls this once when it removes the replica, after its own drain, and awaits
        a coroutine it returns (ray/serve/_private/replica.py: call_destructor ->
        _call_func_or_gen); garbage collection calls it too. So: refuse new streams; with
        none open (the normal case), stop the engine thread now; otherwise return a coroutine
        that waits for them, up to drain_timeout_s, hands the rest back (they end with
        ReplicaDrainingError, which the ingress resumes elsewhere) and then stops it. Garbage
        collection never meets an open stream: each one holds a reference to the replica."""
        if "engine" not in self.__dict__ or self._stopped:  # constructor failed, or done
            return None
        self._draining = True
        if self._streams:
            return self._drain_then_stop()
        self._stop_engine()
        return None

    async def _drain_then_stop(self) -> None:
        try:
            if not await self._wait_for_streams(self.drain_timeout_s):
                logger.warning("drain: %d streams still open after %.0f s; handing them back",
                               len(self._streams), self.drain_timeout_s)
                self._cut.update(self._streams)
                for request_id in list(self._streams.values()):
                    self.engine.abort(request_id)
                await self._wait_for_streams(5.0)
        finally:
            await asyncio.to_thread(self._stop_engine)  # joins the step thread: off the loop

    async def _wait_for_streams(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._no_streams.wait(), timeout=timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _stop_engine(self) -> None:
        """Stop the step thread (it finishes at most the step it is in)."""
        self._stopped = True
        self.engine.shutdown()


def _default_kv_transport() -> str:
    import ray  # a required dependency (not optional: no fallback)

    return "ray_object_store" if ray.is_initialized() else "local"


def _lora_of(request: GenerateRequest) -> tuple[str, str | None] | None:
    return (request.lora_name, request.lora_path) if request.lora_name is not None else None


def _replica_id() -> str:
    try:
        from ray import serve  # ray: unit tests and the simulator run a replica without Ray

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (unit tests)
        return "local"
