"""Scheduler with prefix caching: a cache hit skips the computed tokens, and the rest of
the prompt runs as chunked prefill."""
from __future__ import annotations

from tests.support.scheduler_helpers import TOKEN, all_free, make_scheduler, rids, step
from worker.api import SamplingParams
from worker.sequence import Sequence


# ---------------------------------------------------------------- prefix cache


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # 3 full blocks
    a = Sequence("a", prompt, SamplingParams(max_tokens=1))
    sched.add(a)
    plan, _ = step(sched)
    assert plan.block_ids == [[0, 1, 2]]
    assert a.is_finished
    assert sched.kv.stats().num_cached_blocks == 3

    b = Sequence("b", prompt + [1, 2, 3], SamplingParams(max_tokens=2))
    sched.add(b)
    plan = sched.schedule()
    assert rids(plan.seqs) == ["b"]
    assert b.num_computed_tokens == 12  # starts at the hit length
    assert b.num_cached_tokens == 12
    assert plan.num_new_tokens == [3]
    assert plan.block_ids == [[0, 1, 2, 3]]
    sched.update(plan, [TOKEN])
    assert b.num_computed_tokens == 15

    # Same prompt exactly: the last block stays uncomputed (one token must be computed).
    c = Sequence("c", list(prompt), SamplingParams(max_tokens=1))
    sched.add(c)
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["b", "c"]
    assert plan.num_new_tokens == [1, 4]
    assert c.num_cached_tokens == 8
    # b still holds 0, 1, 2; c shares 0, 1 and gets a new block for its last 4 tokens.
    assert plan.block_ids[1] == [0, 1, 4]

    stats = sched.kv.stats()
    assert stats.prefix_cache_queries == 12 + 15 + 12
    assert stats.prefix_cache_hits == 0 + 12 + 8
    assert stats.prefix_cache_hit_rate == 20 / 39
    while sched.has_unfinished():
        step(sched)
    assert all_free(sched)


def test_prefix_cache_hit_chunked_prefill_rest() -> None:
    # A hit plus a budget smaller than the rest of the prompt: the rest is chunked.
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=5)
    prompt = list(range(200, 208))
    a = Sequence("a", prompt, SamplingParams(max_tokens=1))
    sched.add(a)
    step(sched)
    step(sched)
    assert a.is_finished
    b = Sequence("b", prompt + list(range(300, 310)), SamplingParams(max_tokens=1))  # 18 tokens
    sched.add(b)
    chunks = []
    while not b.is_finished:
        plan, _ = step(sched)
        chunks.append(plan.num_new_tokens[0])
    assert b.num_cached_tokens == 8
    assert chunks == [5, 5]
    assert all_free(sched)


def test_waiting_uncached_tokens_leave_out_cached_prefixes() -> None:
    """The router's prefill backlog: a waiting request whose prefix is cached counts only
    what admission would still compute (whole blocks hit; one token always computed); a
    prompt_logprobs request skips the cache, so it counts whole. Nothing is allocated. The
    figure is each request's as the cache stood when it joined the queue."""
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1)
    prompt = list(range(300, 312))  # 3 full blocks
    a = Sequence("a", prompt, SamplingParams(max_tokens=1))
    sched.add(a)
    step(sched)
    assert a.is_finished and sched.kv.stats().num_cached_blocks == 3

    hog = Sequence("hog", list(range(900, 904)), SamplingParams(max_tokens=8))  # holds the one slot
    sched.add(hog)
    step(sched)
    b = Sequence("b", prompt + [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))  # 12 cached + 5
    c = Sequence("c", list(prompt), SamplingParams(max_tokens=1))  # the last block is computed
    d = Sequence("d", prompt + [7], SamplingParams(max_tokens=1, prompt_logprobs=0))  # skips the cache
    e = Sequence("e", list(range(500, 506)), SamplingParams(max_tokens=1))  # nothing cached
    for seq in (b, c, d, e):
        sched.add(seq)
    free = sched.kv.num_free_blocks
    assert sched.waiting_uncached_tokens() == 5 + 4 + 13 + 6
    assert sched.kv.num_free_blocks == free
    while sched.has_unfinished():
        step(sched)
    assert all_free(sched)
