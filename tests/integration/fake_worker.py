"""A fake engine deployment for routing tests: real Serve replicas, no model.

`FakeWorker` speaks the worker contract the router relies on (worker/serving/replica.py):
`generate(GenerateRequest)` is an async generator, and `record_routing_stats()` returns the
worker.api.RoutingStats dict. Its state (free blocks, cached prefix hashes, waiting queue) is
set by the test through `FakeControl`, a named Ray actor every replica reads:

  * each replica registers with the control actor and gets an ordinal (0, 1, 2...) and
    reports it in its stats and in every stream's first item;
  * a request holds ceil((prompt + max_tokens) / block_size) - cached blocks, which the
    replica's reported free_blocks subtracts until the request ends; with
    `params.extra["hold"]` it ends only when the test calls `FakeControl.release`;
  * the replica "caches" the full blocks of every prompt it served (reported in
    prefix_hashes after the configured ones), like an engine with prefix caching;
  * `version` in the stats is the control actor's state version the report was built
    from, so a test can wait until the router has seen a given state;
  * state `freeze_stats=True` makes the replica repeat its last report unchanged (same
    timestamp), so the controller broadcasts nothing new: the router must then route a
    whole burst on one old report plus its own reservations. The replica acknowledges
    through `FakeControl.frozen`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from kv.block_hash import hash_full_blocks
from worker.api import GenerateRequest

CONTROL_NAMESPACE = "kvserve-tests"


@ray.remote(num_cpus=0)
class FakeControl:
    """Test-side state of every FakeWorker replica of one application."""

    def __init__(self) -> None:
        self._states: dict[int, dict[str, Any]] = {}
        self._actors: dict[int, Any] = {}
        self._replica_ids: dict[int, str] = {}
        self._version = 0
        self._release = asyncio.Event()
        self._release_generation = 0
        self._frozen: dict[int, float] = {}  # ordinal -> timestamp of the repeated report

    def register(self, replica_id: str, actor: Any) -> int:
        ordinal = len(self._replica_ids)
        self._replica_ids[ordinal] = replica_id
        self._actors[ordinal] = actor
        self._states.setdefault(ordinal, {"free_blocks": 1000, "prefix_hashes": [], "num_waiting": 0})
        return ordinal

    def set_state(self, ordinal: int, **state: Any) -> int:
        self._states.setdefault(ordinal, {"free_blocks": 1000, "prefix_hashes": [], "num_waiting": 0}).update(state)
        self._version += 1
        return self._version

    def get_state(self, ordinal: int) -> dict[str, Any]:
        return {**self._states.get(ordinal, {}), "version": self._version, "release_generation": self._release_generation}

    def ack_frozen(self, ordinal: int, timestamp: float | None) -> None:
        if timestamp is None:
            self._frozen.pop(ordinal, None)
        else:
            self._frozen[ordinal] = timestamp

    def frozen(self) -> dict[int, float]:
        return dict(self._frozen)

    def replica_ids(self) -> dict[int, str]:
        return dict(self._replica_ids)

    def actor(self, ordinal: int) -> Any:
        return self._actors[ordinal]

    async def wait_release(self, generation: int) -> None:
        """Hold until the first release after `generation` (read when the request started,
        so a release that overtakes this call still frees it)."""
        if self._release_generation > generation:
            return
        await self._release.wait()

    def release(self) -> None:
        """Let every held request finish; requests starting later hold until the next release."""
        self._release_generation += 1
        self._release.set()
        self._release = asyncio.Event()


class FakeWorker:
    def __init__(self, control_name: str, block_size: int = 16, total_blocks: int = 1000) -> None:
        self.control = ray.get_actor(control_name, namespace=CONTROL_NAMESPACE)
        self.block_size = block_size
        self.total_blocks = total_blocks
        replica_id = serve.get_replica_context().replica_id.unique_id
        me = ray.get_runtime_context().current_actor
        self.ordinal: int = ray.get(self.control.register.remote(replica_id, me))
        self.held_blocks = 0
        self.num_running = 0
        self.learned_hashes: dict[int, None] = {}  # insertion-ordered set, most recent last
        self.last_stats: dict[str, Any] | None = None
        self.frozen = False

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        state = await self.control.get_state.remote(self.ordinal)
        token_ids = request.prompt_token_ids
        hashes = hash_full_blocks(token_ids, self.block_size)
        known = set(state.get("prefix_hashes", ())) | set(self.learned_hashes)
        cacheable = max(len(token_ids) - 1, 0) // self.block_size
        cached = 0
        for h in hashes[:cacheable]:
            if h not in known:
                break
            cached += 1
        blocks = -(-(len(token_ids) + request.params.max_tokens) // self.block_size) - cached
        self.held_blocks += blocks
        self.num_running += 1
        for h in hashes:
            self.learned_hashes.pop(h, None)
            self.learned_hashes[h] = None
        try:
            yield {"ordinal": self.ordinal, "request_id": request.request_id, "blocks": blocks, "cached": cached}
            if request.params.extra.get("hold"):
                await self.control.wait_release.remote(state["release_generation"])
            yield {"ordinal": self.ordinal, "done": True}
        finally:
            self.held_blocks -= blocks
            self.num_running -= 1

    async def record_routing_stats(self) -> dict[str, Any]:
        state = await self.control.get_state.remote(self.ordinal)
        if state.get("freeze_stats") and self.last_stats is not None:
            if not self.frozen:
                self.frozen = True
                await self.control.ack_frozen.remote(self.ordinal, self.last_stats["timestamp"])
            return self.last_stats
        if self.frozen:
            self.frozen = False
            await self.control.ack_frozen.remote(self.ordinal, None)
        configured = list(state.get("prefix_hashes", ()))
        learned = list(reversed(self.learned_hashes))  # most recent first
        num_waiting = int(state.get("num_waiting", 0))
        self.last_stats = {
            "free_blocks": max(int(state.get("free_blocks", self.total_blocks)) - self.held_blocks, 0),
            "total_blocks": int(state.get("total_blocks", self.total_blocks)),
            "block_size": self.block_size,
            "num_running": self.num_running,
            "num_waiting": num_waiting,
            "num_waiting_prompt_tokens": num_waiting * self.block_size,
            "reserved_blocks": int(state.get("reserved_blocks", 0)),
            "prefix_hashes": configured + learned,
            "timestamp": time.time(),
            # Test-only keys (the policy ignores unknown keys).
            "ordinal": self.ordinal,
            "version": state["version"],
        }
        return self.last_stats

    async def stats(self) -> dict[str, Any]:
        return {"ordinal": self.ordinal, "held_blocks": self.held_blocks, "num_running": self.num_running}
