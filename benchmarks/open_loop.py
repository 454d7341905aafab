"""Open-loop replay of a simulator workload against a real OpenAI endpoint: each request is
sent at its arrival time x `dilation` (real seconds per modelled second), streaming, whether
or not earlier ones have finished. Used by benchmarks.router and the simulator's validation
against a real Serve cluster (benchmarks/routing/validate_cluster.py), so both load the cluster the
same way."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any


async def replay(url: str, model: str, requests: Sequence[Any], dilation: float, timeout_s: float) -> list[Any]:
    """cluster/bench's RequestResult per request, in the order of `requests` (each has
    prompt_token_ids, max_tokens and arrival_s in modelled seconds)."""
    from cluster.bench.client import make_client
    from cluster.bench.stream import send_request
    from cluster.workload.text_prompts import BenchRequest

    client = make_client(None, timeout_s)
    loop = asyncio.get_running_loop()
    start_perf, start = time.perf_counter(), loop.time()

    async def one(i: int, r: Any) -> Any:
        bench = BenchRequest(index=i, prompt=list(r.prompt_token_ids), prompt_len=len(r.prompt_token_ids),  # type: ignore[arg-type]
                             max_tokens=r.max_tokens)
        body = {"model": model, "prompt": list(r.prompt_token_ids), "max_tokens": r.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
        return await send_request(client, url, body, bench, "completions", start_perf)

    tasks = []
    try:
        for i, r in enumerate(requests):
            delay = start + r.arrival_s * dilation - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the open-loop arrival schedule
            tasks.append(asyncio.create_task(one(i, r)))
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()
