"""Scheduler with a real KVCacheManager: plan order, token budget, chunked prefill and
admission. No model: the "runner" is a function (tests/support/scheduler_helpers.py).
Preemption, stop conditions/abort and prefix-cache hits are in the test_scheduler_*.py
files beside this one."""
from __future__ import annotations

from tests.support.scheduler_helpers import TOKEN, all_free, make_scheduler, make_seq, rids, step
from worker.sequence import SequenceStatus


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
