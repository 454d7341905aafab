"""The worker deployment as both front ends see it: the generate stream, the model's
facts, every replica's stats, and a health check.

One place for what /v1/models and gRPC ListModels, /metrics and gRPC Stats, /health and
gRPC Health ask the worker handle.

Disaggregated (router/frontend/disagg.py), the engine requests touch two pools: the decode pool
(`handle`) and the prefill pool (`prefill_handle`). Stats then come from both, each
replica's dict tagged with its `pool` ("prefill" | "decode"), and health needs both: a
cluster whose prefill pool is down cannot answer a single request.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from router import errors
from router.frontend.generation import api_error_of
from router.frontend.health_verdict import HealthVerdict
from router.routing import NO_BOUND, ColdStartBound
from router.serve_internals import known_replica_count

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0


class Workers:
    def __init__(self, handle: Any, generate: Any, stats_timeout_s: float, prefill_handle: Any = None,
                 cold_start: ColdStartBound = NO_BOUND, scale_to_zero: bool = False) -> None:
        self.handle = handle  # DeploymentHandle of the worker deployment (the decode pool when disaggregated)
        self.prefill_handle = prefill_handle  # the prefill pool's, when disaggregated
        # What GenerationStream sends engine requests through: handle.options(stream=True),
        # or router/frontend/disagg.py's DisaggregatedGenerate.
        self.generate = generate
        self._stats_timeout_s = stats_timeout_s
        # The first model_info waits for a replica like a request does (a pool at zero).
        self._cold_start = cold_start
        # The pools may have no replica (scale to zero): the health check does not ask one then.
        self._scale_to_zero = scale_to_zero
        self._model_info: dict[str, Any] | None = None
        self._stats_call: asyncio.Future[list[dict[str, Any]]] | None = None
        # What /health and gRPC Health read: one check at a time, cached briefly.
        self.health = HealthVerdict(self.unhealthy_reason)

    async def model_info(self) -> dict[str, Any]:
        """The workers' model facts, fetched once. `max_model_len` is the longest sequence
        a worker can hold: the model's limit, or the KV pool's when that is smaller (so that
        a default max_tokens always fits, and a too-long request is a 400 here). A worker
        call that fails is the API error a client should see (503 when no worker is up, or
        none took the call within the cold-start bound)."""
        if self._model_info is None:
            try:
                info = dict(await self._cold_start.answer(self.handle.model_info.remote()))
                stats = await self._cold_start.answer(self.handle.stats.remote())
            except errors.APIError:
                raise
            except Exception as e:
                raise api_error_of(e) from None
            capacity = int(stats["total_blocks"]) * int(info["block_size"])
            info["max_model_len"] = min(int(info["max_model_len"]), capacity)
            self._model_info = info
        return self._model_info

    async def check_lora(self, name: str, path: str, roots: tuple[str, ...] = ()) -> tuple[str, str]:
        """One worker replica reads the adapter as a request would (against the model), its
        directory confined to `roots`: (resolved directory, content digest). What is wrong
        with it is the caller's 400 (LoRAAdapterError through api_error_of)."""
        try:
            path, digest = await self.handle.check_lora.remote(name, path, roots)
            return str(path), str(digest)
        except errors.APIError:
            raise
        except Exception as e:
            raise api_error_of(e) from None

    def pools(self) -> dict[str, Any]:
        """Pool name -> handle: {"decode", "prefill"} when disaggregated; otherwise the one
        pool, unnamed ("" : its stats carry no `pool` key)."""
        if self.prefill_handle is None:
            return {"": self.handle}
        return {"prefill": self.prefill_handle, "decode": self.handle}

    async def stats(self) -> list[dict[str, Any]]:
        """`stats` of every worker replica of every pool (Serve's broadcast, the pools
        asked at once); ones that fail are left out. One broadcast at a time: callers that
        arrive while one is out share its answer (a flood of /metrics or gRPC Stats calls
        costs the workers one call each per broadcast, not one per caller)."""
        if self._stats_call is None:
            self._stats_call = asyncio.ensure_future(self._broadcast_stats())
            self._stats_call.add_done_callback(self._stats_done)
        return [dict(s) for s in await asyncio.shield(self._stats_call)]

    def _stats_done(self, call: asyncio.Future[list[dict[str, Any]]]) -> None:
        if self._stats_call is call:
            self._stats_call = None

    async def _broadcast_stats(self) -> list[dict[str, Any]]:
        pools = self.pools()
        answers = await asyncio.gather(*(self._pool_stats(h) for h in pools.values()))
        return [{**s, "pool": name} if name else s for name, pool in zip(pools, answers) for s in pool]

    async def _pool_stats(self, handle: Any) -> list[dict[str, Any]]:
        try:
            results = await handle.broadcast("stats").results_async(
                timeout_s=self._stats_timeout_s, return_exceptions=True
            )
        except Exception as e:
            logger.warning("worker stats unavailable: %r", e)
            return []
        return [r for r in results if isinstance(r, dict)]

    async def unload_lora(self, name: str) -> int:
        """Every worker replica of every pool forgets adapter `name` and its weights (Serve's
        broadcast): how many replicas failed or did not answer (logged)."""
        failed = 0
        for handle in self.pools().values():
            try:
                results = await handle.broadcast("unload_lora", name).results_async(
                    timeout_s=self._stats_timeout_s, return_exceptions=True)
            except Exception as e:
                logger.warning("unload_lora failed: %r", e)
                failed += 1
                continue
            failed += sum(isinstance(r, BaseException) for r in results)
        if failed:
            logger.warning("LoRA adapter unload did not reach %d worker replica(s); requests under a new load "
                           "carry the new content digest, so they never get the old weights", failed)
        return failed

    async def reset_prefix_cache(self) -> tuple[int, int]:
        """vLLM's reset_prefix_cache on every worker replica of every pool (Serve's
        broadcast): (replicas that cleared, replicas that failed or did not answer)."""
        results = []
        for handle in self.pools().values():
            try:
                results += await handle.broadcast("reset_prefix_cache").results_async(
                    timeout_s=self._stats_timeout_s, return_exceptions=True)
            except Exception as e:
                logger.warning("reset_prefix_cache failed: %r", e)
                return 0, 1
        num_failed = sum(isinstance(r, BaseException) for r in results)
        return len(results) - num_failed, num_failed

    async def unhealthy_reason(self, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
        """None when a worker of every pool answers its health check within `timeout_s`;
        else why not (the pools are asked at once). A pool that may scale to zero and has
        no replica is healthy and is not asked: a health call queued at its handle would be
        demand, and every probe would start a replica (requests wake it: cold_start.py)."""
        asked = {name: h for name, h in self.pools().items()
                 if not (self._scale_to_zero and known_replica_count(h) == 0)}
        reasons = await asyncio.gather(*(_unhealthy(h, timeout_s) for h in asked.values()))
        for name, reason in zip(asked, reasons):
            if reason is not None:
                return f"{name} pool: {reason}" if name else reason
        return None


async def _unhealthy(handle: Any, timeout_s: float) -> str | None:
    response = handle.check_health.remote()
    try:
        await asyncio.wait_for(_awaited(response), timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        return f"No worker answered its health check within {timeout_s:g} s."
    except Exception as e:
        # The cause (actor ids, addresses, paths) is logged, never shown to a probe.
        cause = getattr(e, "cause", None) or e
        logger.warning("worker health check failed: %s: %s", type(cause).__name__, str(cause)[:1000])
        return "No healthy worker."
    return None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
