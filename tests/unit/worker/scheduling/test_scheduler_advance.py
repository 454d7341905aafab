"""Applying a step in two halves (Scheduler.advance, then Scheduler.update): the overlapped
loop advances a plan while its step is on the device and updates it with the sampled
tokens after (worker/scheduling/async_scheduler.py). The two halves leave exactly the state the serial
update leaves, and an abort between them drops the token and frees every block."""
from __future__ import annotations

from tests.support.scheduler_helpers import TOKEN, all_free, make_scheduler, make_seq, rids
from worker.sequence import SequenceStatus


def test_advance_moves_past_the_plan_and_registers_filled_blocks() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6)
    a = make_seq("a", 10, max_tokens=3)
    sched.add(a)
    plan = sched.schedule()
    assert (plan.num_new_tokens, plan.block_ids) == ([6], [[0, 1]])
    sched.advance(plan)
    # positions 0..5 written: block 0 (positions 0..3) is full and now a prefix-cache hit
    assert plan.advanced and a.num_computed_tokens == 6
    assert [b.block_id for b in sched.kv.get_computed_blocks("probe", a.token_ids)] == [0]
    sched.advance(plan)  # once only
    assert a.num_computed_tokens == 6
    assert sched.update(plan, [None]) == []  # a prompt chunk: no token, no second advance
    assert a.num_computed_tokens == 6 and a.num_tokens == 10


def test_two_halves_leave_the_state_the_serial_update_leaves() -> None:
    def run(split: bool) -> tuple[list[int], list[list[int]], list[int]]:
        sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
        seqs = [make_seq("a", 7, max_tokens=4), make_seq("b", 5, max_tokens=2)]
        for s in seqs:
            sched.add(s)
        computed, tables = [], []
        while sched.has_unfinished():
            plan = sched.schedule()
            if split:
                sched.advance(plan)
            sched.update(plan, [TOKEN if s.num_computed_tokens + (0 if split else n) == s.num_tokens else None
                                for s, n in zip(plan.seqs, plan.num_new_tokens)])
            computed.append(sum(plan.num_new_tokens))
            tables.append([len(b) for b in plan.block_ids])
        assert all_free(sched)
        return computed, tables, [s.num_output_tokens for s in seqs]

    assert run(split=True) == run(split=False)


def test_an_abort_between_the_halves_drops_the_token_and_frees_the_blocks() -> None:
    sched = make_scheduler(block_size=4)
    a, b = make_seq("a", 4, max_tokens=5), make_seq("b", 4, max_tokens=5)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.advance(plan)
    sched.finish(a, "abort")  # the inbox drained while the step was on the device
    changed = sched.update(plan, [TOKEN, TOKEN])
    assert changed == [b] and a.num_output_tokens == 0 and b.num_output_tokens == 1
    assert a.status is SequenceStatus.FINISHED and rids(sched.running) == ["b"]
    sched.finish(b, "abort")
    assert all_free(sched)
