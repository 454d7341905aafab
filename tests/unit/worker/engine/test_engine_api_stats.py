"""Engine stats (KV usage, queue depths, step counts, throughput), from the sync engine
step by step and from the AsyncEngine after a batch. No Ray.
"""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

from tests.support.engine_api_helpers import (
    NUM_BLOCKS,
    all_free,
    await_condition,
    collect,
    make_engine,
    random_prompt,
    tokens_of,
)
# pytest fixtures, used by name (async_engine needs engine and tokenizer here too)
from tests.support.engine_api_helpers import async_engine, engine, tokenizer  # noqa: F401
from worker.engine.async_engine import AsyncEngine
from worker.api import SamplingParams


# -- stats ---------------------------------------------------------------------------------------------

def test_stats_sync_engine(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=1)
    s0 = engine.stats()
    assert s0.kv.total_blocks == s0.kv.free_blocks == NUM_BLOCKS and s0.kv.block_size == 16
    assert s0.num_running == s0.num_waiting == s0.num_steps == s0.num_generated_tokens == 0
    assert s0.kv.usage == 0.0 and s0.tokens_per_s == 0.0 and s0.forward_share == 0.0

    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), greedy)  # 37 tokens: 3 blocks
    engine.add_request("b", list(range(100, 120)), greedy)  # waits (max_num_seqs=1)
    engine.step()
    s1 = engine.stats()
    assert s1.num_running == 1 and s1.num_waiting == 1 and s1.num_waiting_prompt_tokens == 20
    # the SLO planner's arrival totals: both requests and their 37 + 20 prompt tokens
    assert (s0.num_arrived, s1.num_arrived, s1.num_arrived_prompt_tokens) == (0, 2, 57)
    assert s1.kv.free_blocks == NUM_BLOCKS - 3 and 0.0 < s1.kv.usage < 1.0
    assert s1.num_steps == 1 and s1.num_generated_tokens == 1
    while engine.has_unfinished():
        engine.step()
    s2 = engine.stats()
    assert s2.num_running == s2.num_waiting == s2.num_waiting_prompt_tokens == 0
    assert s2.kv.free_blocks == NUM_BLOCKS and s2.kv.usage == 0.0
    assert s2.num_generated_tokens == 10 and s2.num_steps == 10
    assert s2.tokens_per_s > 0.0 and 0.0 < s2.forward_share <= 1.0
    assert s2.kv.prefix_cache_queries == 37 + 20 and s2.kv.prefix_cache_hits == 0
    assert s2.kv.num_cached_blocks > 0  # the finished requests' full blocks stay cached
    d = s2.to_dict()
    for key in ("total_blocks", "free_blocks", "kv_usage", "num_running", "num_waiting",
                "num_preemptions", "num_generated_tokens", "tokens_per_s", "prefix_cache_hits"):
        assert key in d
    assert "kv" not in d and d["free_blocks"] == NUM_BLOCKS


async def test_stats_async_engine(async_engine: AsyncEngine) -> None:
    rng = random.Random(8)
    requests = [(random_prompt(rng, rng.randint(1, 60)), rng.randint(1, 20)) for _ in range(6)]
    results = await asyncio.gather(*(
        collect(async_engine.generate(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
        for p, n in requests
    ))
    assert [len(tokens_of(outs)) for outs in results] == [n for _, n in requests]
    for (p, n), outs in zip(requests, results):
        last = outs[-1]
        assert last.num_prompt_tokens == len(p) and last.num_output_tokens == n
        assert last.first_token_time is not None and last.first_token_time >= last.arrival_time
    # The snapshot after the last step shows an empty, idle engine.
    await await_condition(all_free(async_engine), "idle")
    s = async_engine.stats()
    assert s.num_generated_tokens == sum(n for _, n in requests)
    assert 0 < s.num_steps <= s.num_generated_tokens
    assert s.num_preemptions == 0 and s.kv.usage == 0.0
    assert s.tokens_per_s >= 0.0 and 0.0 < s.forward_share <= 1.0
