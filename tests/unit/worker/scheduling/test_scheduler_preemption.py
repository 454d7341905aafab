"""Scheduler preemption: the youngest running sequence gives up its blocks and is
recomputed later; no deadlock when the pool fits exactly one max-length request."""
from __future__ import annotations

from tests.support.scheduler_helpers import all_free, make_scheduler, make_seq, rids, step
from worker.sequence import SequenceStatus


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
