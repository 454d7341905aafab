"""The worker replica: one engine per Ray Serve replica (later: per tensor-parallel group).

cluster/ wraps this class with `serve.deployment(...)`; it stays free of HTTP, gRPC and
Redis. Ray Serve calls `record_routing_stats` (the KV-headroom router reads it) and
`record_autoscaling_stats` (the autoscaling policy reads it) periodically.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.outputs import RequestOutput
from worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateRequest:
    """What the ingress sends a worker: token ids, never text (workers never tokenize)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


# Keys of the routing-stats dict (the contract with router/request_router.py).
ROUTING_STATS_KEYS = (
    "free_blocks",  # free KV blocks, evictable cached ones included
    "total_blocks",
    "block_size",
    "num_running",
    "num_waiting",
    "num_waiting_prompt_tokens",
    "reserved_blocks",  # blocks the waiting requests will need at admission
    "prefix_hashes",  # list[int]: cached full-block hashes (kv.block_hash chain)
    "timestamp",  # time.time() when taken
)


class WorkerReplica:
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine = AsyncEngine.from_config(engine_config)
        self.block_size = engine_config.cache.block_size
        logger.info("worker replica ready: %s", engine_config.model.model)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream outputs as they are produced. If the caller goes away, Serve cancels this
        generator and the engine aborts the request (blocks freed within one step)."""
        async for out in self.engine.generate(request.prompt_token_ids, request.params, request.request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def record_routing_stats(self) -> dict:
        stats = self.engine.stats()
        waiting_blocks = -(-stats.num_waiting_prompt_tokens // self.block_size)
        return {
            "free_blocks": stats.kv.free_blocks,
            "total_blocks": stats.kv.total_blocks,
            "block_size": stats.kv.block_size,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_waiting_prompt_tokens": stats.num_waiting_prompt_tokens,
            "reserved_blocks": waiting_blocks,
            "prefix_hashes": self.engine.prefix_hashes(),
            "timestamp": time.time(),
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.engine.stats()
        return {
            "num_waiting": float(stats.num_waiting),
            "num_waiting_prompt_tokens": float(stats.num_waiting_prompt_tokens),
            "num_running": float(stats.num_running),
            "kv_usage": stats.kv.usage,
        }

    async def stats(self) -> dict[str, float | str]:
        """Engine stats plus `replica_id` (the ingress labels per-replica metrics with it;
        it gathers these from every replica with DeploymentHandle.broadcast)."""
        return {**self.engine.stats().to_dict(), "replica_id": _replica_id()}

    async def model_info(self) -> dict:
        eng = self.engine.engine
        return {"max_model_len": eng.max_model_len, "vocab_size": eng.vocab_size, "block_size": self.block_size}

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError("engine loop has stopped")

    def __del__(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            pass


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (unit tests)
        return "local"
