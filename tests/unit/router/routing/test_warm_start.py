"""The worker side of warm start (no Ray): a router that asks a replica for its routing stats
(router/routing/serve_router.py pulls them before its first decision) gets the prefix hashes of
everything the replica has cached, including the request that finished just before it
went idle. The engine loop snapshots prefix hashes at most every 0.5 s while busy; the
snapshot taken when it goes idle is what makes the answer current."""
from __future__ import annotations

import asyncio

from kv.block_hash import hash_full_blocks
from tests.integration.fake_engine_worker import FakeEngineWorker
from worker.api import GenerateRequest, SamplingParams

BS = 16


async def run(worker: FakeEngineWorker, request_id: str, prompt: list[int]) -> None:
    async for _ in worker.generate(GenerateRequest(request_id, prompt, SamplingParams(max_tokens=2, temperature=0.0))):
        pass


async def test_an_idle_replica_reports_the_prefix_it_cached_last() -> None:
    worker = FakeEngineWorker(max_num_seqs=2, step_s=0.001, block_size=BS)
    try:
        first, second = list(range(1, 50)), list(range(63, 14, -1))  # 3 full blocks each (vocab 64)
        await run(worker, "a", first)
        await run(worker, "b", second)  # finishes well within 0.5 s of the first
        # Idle now: the stats a router pulls name both prompts' cached blocks.
        await asyncio.sleep(0)
        reported = set(worker.record_routing_stats()["prefix_hashes"])
        assert set(hash_full_blocks(first, BS)) <= reported
        assert set(hash_full_blocks(second, BS)) <= reported
    finally:
        pending = worker.__del__()
        if pending is not None:
            await pending
