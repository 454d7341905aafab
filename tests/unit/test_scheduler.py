"""Scheduler with a real KVCacheManager: plan order, token budget, chunked prefill, admission,
preemption, stop conditions, abort, prefix-cache hits. No model: the "runner" is a function."""
from __future__ import annotations

import zlib
from collections.abc import Callable

from kv.cache_manager import KVCacheManager
from worker.config import SchedulerConfig
from worker.sampling_params import SamplingParams
from worker.scheduler import Scheduler, SchedulerOutput
from worker.sequence import Sequence, SequenceStatus

TOKEN = 9  # what the fake model samples unless a test says otherwise


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 128,
    prefix_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
    )
    return Scheduler(config, kv)


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


# ---------------------------------------------------------------- plan order and budget


def test_empty_schedule() -> None:
    sched = make_scheduler()
    plan = sched.schedule()
    assert plan.is_empty
    assert plan.num_batched_tokens == 0
    assert not sched.has_unfinished()


def test_single_request_prefill_then_decode() -> None:
    sched = make_scheduler()
    a = make_seq("a", 6, max_tokens=4)
    sched.add(a)
    assert sched.has_unfinished()
    assert (sched.num_waiting, sched.num_running) == (1, 0)

    plan, changed = step(sched)
    assert rids(plan.seqs) == ["a"]
    assert plan.num_new_tokens == [6]
    assert plan.block_ids == [[0, 1]]
    assert changed == [a]
    assert a.status is SequenceStatus.RUNNING
    assert (a.num_computed_tokens, a.num_tokens) == (6, 7)
    assert a.output_token_ids == [TOKEN]

    for _ in range(2):  # positions 6 and 7: still in block 1
        plan, _ = step(sched)
        assert plan.num_new_tokens == [1]
        assert plan.block_ids == [[0, 1]]
        assert not a.is_finished
    plan, changed = step(sched)
    assert plan.num_new_tokens == [1]
    assert plan.block_ids == [[0, 1, 2]]  # position 8 opens the third block
    assert changed == [a]
    assert a.is_finished and a.finish_reason == "length"
    assert a.output_token_ids == [TOKEN] * 4
    assert not sched.has_unfinished()
    assert all_free(sched)


def test_decodes_first_then_prompt_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq("a", 5)
    sched.add(a)
    plan, _ = step(sched)
    assert plan.num_new_tokens == [5]

    b = make_seq("b", 10)
    c = make_seq("c", 3)
    sched.add(b)
    sched.add(c)
    plan, changed = step(sched)
    # a's decode first, then b's prompt chunk fills the rest of the budget; c gets nothing.
    assert rids(plan.seqs) == ["a", "b"]
    assert plan.num_new_tokens == [1, 7]
    assert plan.num_batched_tokens == 8
    assert changed == [a]
    assert b.num_computed_tokens == 7 and b.num_output_tokens == 0
    assert rids(sched.running) == ["a", "b"]
    assert rids(sched.waiting) == ["c"]

    plan, changed = step(sched)
    # running first in admission order (a decode, b's last 3 prompt tokens), then c's 3
    assert rids(plan.seqs) == ["a", "b", "c"]
    assert plan.num_new_tokens == [1, 3, 3]
    assert changed == [a, b, c]
    assert [s.num_output_tokens for s in (a, b, c)] == [3, 1, 1]

    plan, _ = step(sched)
    assert plan.num_new_tokens == [1, 1, 1]


def test_samples_only_at_end_of_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add(make_seq("a", 6))
    plan = sched.schedule()
    assert plan.num_new_tokens == [4]
    assert plan.samples(0) is False
    sched.update(plan, [None])
    plan = sched.schedule()
    assert plan.num_new_tokens == [2]
    assert plan.samples(0) is True


def test_chunked_prefill_100_tokens_budget_32() -> None:
    sched = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=32, max_model_len=256)
    a = make_seq("a", 100, max_tokens=4)
    sched.add(a)
    chunks = []
    samples = []
    for _ in range(4):
        plan = sched.schedule()
        assert rids(plan.seqs) == ["a"]
        chunks.append(plan.num_new_tokens[0])
        samples.append(plan.samples(0))
        changed = sched.update(plan, [TOKEN if plan.samples(0) else None])
        assert changed == ([a] if samples[-1] else [])
    assert chunks == [32, 32, 32, 4]
    assert samples == [False, False, False, True]
    assert a.num_computed_tokens == 100
    assert a.output_token_ids == [TOKEN]
    assert sched.kv.block_ids("a") == [0, 1, 2, 3, 4, 5, 6]  # ceil(100 / 16)
    plan, _ = step(sched)
    assert plan.num_new_tokens == [1]


def test_budget_split_across_waiting_prompts() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    for rid in ("a", "b", "c"):
        sched.add(make_seq(rid, 8))
    plan, changed = step(sched)
    assert rids(plan.seqs) == ["a", "b"]
    assert plan.num_new_tokens == [8, 2]
    assert rids(changed) == ["a"]
    plan, changed = step(sched)
    assert rids(plan.seqs) == ["a", "b", "c"]
    assert plan.num_new_tokens == [1, 6, 3]
    assert rids(changed) == ["a", "b"]
    plan, changed = step(sched)
    assert plan.num_new_tokens == [1, 1, 5]
    assert rids(changed) == ["a", "b", "c"]


def test_max_num_seqs_respected() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"r{i}", 3, max_tokens=2) for i in range(5)]
    for s in seqs:
        sched.add(s)
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["r0", "r1"]
    assert rids(sched.waiting) == ["r2", "r3", "r4"]
    plan, _ = step(sched)  # r0 and r1 finish this step (max_tokens=2)
    assert rids(plan.seqs) == ["r0", "r1"]
    assert seqs[0].is_finished and seqs[1].is_finished
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["r2", "r3"]
    while sched.has_unfinished():
        plan, _ = step(sched)
        assert len(plan.seqs) <= 2
        assert sched.num_running <= 2
    assert all(s.finish_reason == "length" for s in seqs)
    assert all_free(sched)


# ---------------------------------------------------------------- admission


def test_fifo_head_of_line_blocking() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)
    a = make_seq("a", 12, max_tokens=1)  # 3 blocks
    b = make_seq("b", 8, max_tokens=1)  # 2 blocks: does not fit next to a
    c = make_seq("c", 2, max_tokens=1)  # 1 block: would fit, but waits behind b
    for s in (a, b, c):
        sched.add(s)
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["a"]
    assert plan.block_ids == [[0, 1, 2]]
    assert a.is_finished
    assert rids(sched.waiting) == ["b", "c"]
    assert b.status is SequenceStatus.WAITING and c.status is SequenceStatus.WAITING
    # a's blocks came back: b first (FIFO), then c.
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["b", "c"]
    assert plan.block_ids == [[3, 2], [1]]
    assert all_free(sched)
    assert not sched.has_unfinished()


def test_waiting_head_waits_for_blocks() -> None:
    # The head needs more blocks than are free: it waits (WAITING, no blocks) until some are.
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64, prefix_caching=False)
    a = make_seq("a", 8, max_tokens=3)  # 2 blocks, grows into the third
    sched.add(a)
    step(sched)
    b = make_seq("b", 8, max_tokens=1)
    sched.add(b)
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["a"]
    assert rids(sched.waiting) == ["b"]
    plan, _ = step(sched)  # a finishes
    assert a.is_finished
    plan, _ = step(sched)
    assert rids(plan.seqs) == ["b"]
    assert b.is_finished
    assert all_free(sched)


# ---------------------------------------------------------------- preemption


def test_preempts_most_recently_admitted_and_recomputes() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=3, prefix_caching=False)
    a = make_seq("a", 4, max_tokens=6)
    b = make_seq("b", 4, max_tokens=20)
    c = make_seq("c", 4, max_tokens=20)
    d = make_seq("d", 4, max_tokens=20)
    for s in (a, b, c, d):
        sched.add(s)

    plan, _ = step(sched)  # step 1: prefill a, b, c (max_num_seqs=3): one block each
    assert rids(plan.seqs) == ["a", "b", "c"]
    assert plan.block_ids == [[0], [1], [2]]
    assert rids(sched.waiting) == ["d"]
    plan, _ = step(sched)  # step 2: position 4 opens a second block for each
    assert plan.block_ids == [[0, 3], [1, 4], [2, 5]]
    assert sched.kv.num_free_blocks == 0
    for _ in range(3):  # steps 3-5: positions 5-7, no new blocks
        plan, _ = step(sched)
        assert plan.num_new_tokens == [1, 1, 1]
        assert not plan.preempted
    assert [s.num_tokens for s in (a, b, c)] == [9, 9, 9]

    # Step 6: a needs a third block, none is free: c (the youngest) is preempted.
    plan, _ = step(sched)
    assert rids(plan.preempted) == ["c"]
    assert rids(plan.seqs) == ["a", "b"]
    assert plan.num_new_tokens == [1, 1]
    # c's blocks were freed tail first (5, then 2) and went to a and b in that order.
    assert plan.block_ids == [[0, 3, 5], [1, 4, 2]]
    assert sched.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert c.num_tokens == 9  # its tokens are kept: prompt + 5 outputs
    assert sched.kv.block_ids("c") == []
    assert rids(sched.waiting) == ["c", "d"]  # requeued at the front
    assert a.is_finished  # a reached max_tokens=6 this step; its blocks are free
    assert rids(sched.running) == ["b"]

    # Step 7: c is recomputed in one chunk (its 9 tokens) and samples its 6th token.
    plan, changed = step(sched)
    assert rids(plan.seqs) == ["b", "c"]
    assert plan.num_new_tokens == [1, 9]
    assert plan.block_ids[1] == [5, 3, 0]  # a's blocks, freed tail first
    assert c in changed
    assert c.num_output_tokens == 6
    assert c.num_computed_tokens == 9
    assert rids(sched.waiting) == ["d"]  # no block left for d
    # Admission stats count the first admission only.
    assert sched.kv.prefix_cache_queries == 12

    while sched.has_unfinished():
        step(sched)
    assert [s.num_output_tokens for s in (a, b, c, d)] == [6, 20, 20, 20]
    assert all(s.finish_reason == "length" for s in (a, b, c, d))
    assert all_free(sched)


def test_running_seq_preempts_itself_when_it_is_the_youngest() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, prefix_caching=False)
    a = make_seq("a", 4, max_tokens=8)  # grows to 12 tokens: 3 blocks
    b = make_seq("b", 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)  # a [0], b [1]
    plan, _ = step(sched)  # a needs a 2nd block (2), b needs one: none left -> b preempts itself
    assert rids(plan.seqs) == ["a"]
    assert rids(plan.preempted) == ["b"]
    assert plan.block_ids == [[0, 2]]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert sched.kv.block_ids("b") == []
    while sched.has_unfinished():
        step(sched)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert all_free(sched)


def test_no_deadlock_pool_fits_exactly_one_max_length_request() -> None:
    # max_model_len 16 = 4 blocks of 4 = the whole pool.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_model_len=16)
    seqs = [make_seq(f"r{i}", 4, max_tokens=12) for i in range(5)]
    for s in seqs:
        sched.add(s)
    num_steps = 0
    while sched.has_unfinished():
        step(sched)
        num_steps += 1
        assert num_steps < 1000, "no progress"
        # invariant: blocks held by running sequences + free blocks = the pool
        held = sum(len(sched.kv.block_ids(s.request_id)) for s in sched.running)
        assert held + sched.kv.num_free_blocks == 4
    assert sched.num_preemptions > 0
    assert [s.num_output_tokens for s in seqs] == [12] * 5
    assert all(s.num_tokens == 16 for s in seqs)
    assert all(s.finish_reason == "length" for s in seqs)
    assert all_free(sched)


# ---------------------------------------------------------------- stop conditions


def run_one(sched: Scheduler, seq: Sequence, outputs: list[int]) -> int:
    """Run `seq` alone, sampling `outputs` in order; returns the number of steps."""
    sched.add(seq)
    n = 0
    while not seq.is_finished:
        step(sched, lambda s: outputs[s.num_output_tokens])
        n += 1
    return n


def test_finish_on_eos() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 3, max_tokens=10, eos=frozenset({2}))
    assert run_one(sched, seq, [5, 6, 2, 7, 7]) == 3
    assert seq.finish_reason == "stop"
    assert seq.stop_reason is None
    assert seq.output_token_ids == [5, 6, 2]
    assert all_free(sched)
    assert not sched.running


def test_ignore_eos() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 3, max_tokens=4, eos=frozenset({2}), ignore_eos=True)
    assert run_one(sched, seq, [2, 2, 2, 2, 2]) == 4
    assert seq.finish_reason == "length"
    assert seq.output_token_ids == [2, 2, 2, 2]


def test_finish_on_stop_token_ids() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 3, max_tokens=10, stop_token_ids=(7, 8))
    assert run_one(sched, seq, [5, 8, 7]) == 2
    assert seq.finish_reason == "stop"
    assert seq.stop_reason == 8
    assert seq.output_token_ids == [5, 8]
    assert all_free(sched)
    # ignore_eos does not switch off stop_token_ids
    seq = make_seq("b", 3, max_tokens=10, stop_token_ids=(7,), ignore_eos=True)
    assert run_one(sched, seq, [7]) == 1
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 7)


def test_finish_on_max_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 3, max_tokens=3, eos=frozenset({2}))
    assert run_one(sched, seq, [5, 6, 7, 8]) == 3
    assert seq.finish_reason == "length"
    assert seq.stop_reason is None
    assert seq.output_token_ids == [5, 6, 7]
    assert all_free(sched)


def test_finish_on_max_model_len() -> None:
    sched = make_scheduler(max_model_len=8)
    seq = make_seq("a", 6, max_tokens=100)
    assert run_one(sched, seq, [5] * 10) == 2
    assert seq.finish_reason == "length"
    assert seq.num_tokens == 8
    assert all_free(sched)


def test_eos_and_max_tokens_same_step_is_stop() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 3, max_tokens=2, eos=frozenset({2}))
    run_one(sched, seq, [5, 2])
    assert seq.finish_reason == "stop"


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 3, max_tokens=10, eos=frozenset({2}), min_tokens=3)
    assert run_one(sched, seq, [2, 2, 2, 2]) == 3
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == [2, 2, 2]
    seq = make_seq("b", 3, max_tokens=10, stop_token_ids=(7,), min_tokens=2)
    assert run_one(sched, seq, [7, 7, 7]) == 2
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 7)
    # min_tokens == max_tokens: length wins over a suppressed EOS
    seq = make_seq("c", 3, max_tokens=2, eos=frozenset({2}), min_tokens=2)
    assert run_one(sched, seq, [2, 5]) == 2
    assert seq.finish_reason == "length"
    assert all_free(sched)


def test_finished_sequence_leaves_running_same_step() -> None:
    sched = make_scheduler()
    a = make_seq("a", 3, max_tokens=1)
    b = make_seq("b", 3, max_tokens=3)
    sched.add(a)
    sched.add(b)
    _, changed = step(sched)
    assert changed == [a, b]
    assert a.is_finished
    assert rids(sched.running) == ["b"]
    assert sched.kv.block_ids("a") == []


# ---------------------------------------------------------------- abort


def test_finish_aborts_waiting_and_running() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    a = make_seq("a", 10, max_tokens=50)
    b = make_seq("b", 10, max_tokens=50)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert rids(sched.running) == ["a"] and rids(sched.waiting) == ["b"]
    assert sched.kv.num_free_blocks == 5

    sched.finish(b, "abort")  # waiting
    assert b.is_finished and b.finish_reason == "abort"
    assert rids(sched.waiting) == []
    sched.finish(a, "abort")  # running
    assert a.is_finished and a.finish_reason == "abort"
    assert rids(sched.running) == []
    assert all_free(sched)
    assert not sched.has_unfinished()
    sched.finish(a, "abort")  # idempotent
    assert a.finish_reason == "abort"
    assert sched.schedule().is_empty


def test_abort_mid_chunked_prefill_and_preempted() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    a = make_seq("a", 12)
    sched.add(a)
    plan, _ = step(sched)
    assert plan.num_new_tokens == [4]
    assert sched.kv.block_ids("a") == [0]
    sched.finish(a, "abort")
    assert all_free(sched)
    assert sched.kv._hashes == {}  # no per-request state left behind
    # A preempted (waiting, with kept hashes) sequence aborted: its hashes go too.
    b = make_seq("b", 4, max_tokens=4)
    sched.add(b)
    step(sched)
    sched.running.remove(b)
    sched._preempt(b)
    assert "b" in sched.kv._hashes
    sched.finish(b, "abort")
    assert sched.kv._hashes == {}
    assert all_free(sched)


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
