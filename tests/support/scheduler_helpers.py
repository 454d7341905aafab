"""Shared helpers for the scheduler tests (tests/unit/worker/test_scheduler*.py): a Scheduler on a
real KVCacheManager, sequences with deterministic prompts, and one "iteration" where the
model is a function that picks each sampled token."""
from __future__ import annotations

import zlib
from collections.abc import Callable

from kv.cache_manager import KVCacheManager
from worker.config import SchedulerConfig
from worker.api import SamplingParams
from worker.scheduling.async_scheduler import AsyncScheduler
from worker.scheduling.scheduler import Scheduler, SchedulerOutput
from worker.sequence import Sequence

TOKEN = 9  # what the fake model samples unless a test says otherwise


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 128,
    prefix_caching: bool = True,
    async_scheduling: bool = False,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
    )
    return (AsyncScheduler if async_scheduling else Scheduler)(config, kv)


def make_seq(
    rid: str,
    prompt: list[int] | int,
    max_tokens: int = 16,
    eos: frozenset[int] = frozenset(),
    **params: object,
) -> Sequence:
    if isinstance(prompt, int):  # a length: distinct tokens per request id
        base = 1000 * (zlib.crc32(rid.encode()) % 1000 + 1)  # deterministic, unlike hash()
        prompt = list(range(base, base + prompt))
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos)


def step(
    sched: Scheduler, pick: Callable[[Sequence], int] = lambda seq: TOKEN
) -> tuple[SchedulerOutput, list[Sequence]]:
    """One iteration: schedule, "execute" (sample `pick(seq)` where the plan samples), update."""
    plan = sched.schedule()
    sampled = [pick(seq) if plan.samples(i) else None for i, seq in enumerate(plan.seqs)]
    changed = sched.update(plan, sampled)
    return plan, changed


def rids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def all_free(sched: Scheduler) -> bool:
    return sched.kv.num_free_blocks == sched.kv.num_total_blocks
