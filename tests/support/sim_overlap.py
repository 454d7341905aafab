"""What the overlapped-loop tests share (tests/unit/worker/scheduling/test_step_overlap.py and
test_launch_ahead.py): a fake clock for the simulated device, a sleeping sim engine, a
request mix, and the serial loop's tokens to compare against."""
from __future__ import annotations

import asyncio
import random

from worker.api import RequestOutput, SamplingParams
from worker.engine.async_engine import AsyncEngine
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.sim.build import build_sim_engine

SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096)

Requests = dict[str, tuple[list[int], SamplingParams]]


class FakeClock:
    """Stands in for the simulated runner's `time` module (read on the step thread only)."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def sim_engine(scheduler: SchedulerConfig = SCHED, cache: CacheConfig = CacheConfig(),
               launch_ahead: bool = True, token_vocab_size: int | None = None) -> Engine:
    """A sleeping simulated device at dilation 1 (it overlaps the host). `launch_ahead=False`:
    every step waits for the previous one's tokens (the overlapped loop without
    worker/scheduling/async_scheduler.py). `token_vocab_size`: draw tokens from that few (so that stop
    tokens come up)."""
    engine = build_sim_engine("llama-3-8b", "h200", scheduler, cache, sleep=True, time_dilation=1.0,
                              token_vocab_size=token_vocab_size)
    if not launch_ahead:
        engine.scheduler.launch_ahead = lambda: None  # type: ignore[method-assign]
    return engine


def requests(seed: int, n: int, stop_token_ids: tuple[int, ...] = ()) -> Requests:
    """Prompts long enough to be chunked (64-token budget), lengths, logprobs, seeds, and
    the stop tokens given."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        params = SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True, detokenize=False,
                                logprobs=2 if i % 4 == 1 else None, seed=i if i % 3 == 0 else None,
                                stop_token_ids=stop_token_ids)
        out[f"r{i}"] = ([rng.randrange(1, 128000) for _ in range(rng.randrange(3, 150))], params)
    return out


def serial_tokens(engine: Engine, reqs: Requests) -> dict[str, list[int]]:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in reqs}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


async def stream_tokens(ae: AsyncEngine, reqs: Requests) -> dict[str, list[RequestOutput]]:
    async def one(rid: str) -> list[RequestOutput]:
        prompt, params = reqs[rid]
        return [out async for out in ae.generate(prompt, params, request_id=rid)]

    results = await asyncio.gather(*(one(rid) for rid in reqs))
    return dict(zip(reqs, results))


def token_lists(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
