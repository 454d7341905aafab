"""The next plan made under the device (worker/scheduling/async_scheduler.py): AsyncScheduler.plan_ahead after
a step is advanced, taken by the next schedule when only decodes can follow, and the full
schedule otherwise. Block ids are exact: block_size 4, the pool hands out the lowest free."""
from __future__ import annotations

from tests.support.scheduler_helpers import TOKEN, all_free, make_scheduler, make_seq, rids
from worker.scheduling.scheduler import Scheduler
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence

EOS = 2


def launched(sched: Scheduler) -> SchedulerOutput:
    """Schedule, advance (the step is on the device), plan ahead: the overlapped loop's order."""
    plan = sched.schedule()
    sched.advance(plan)
    sched.plan_ahead()
    return plan


def sampled(plan: SchedulerOutput, pick: dict[str, int] | None = None) -> list[int | None]:
    return [(pick or {}).get(s.request_id, TOKEN) if plan.samples(i) else None for i, s in enumerate(plan.seqs)]


def test_a_decode_step_is_planned_under_the_device_with_its_grown_table() -> None:
    sched = make_scheduler(async_scheduling=True, block_size=4)
    a, b = make_seq("a", 4, max_tokens=5), make_seq("b", 3, max_tokens=5)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.block_ids == [[0], [1]]
    sched.advance(plan)
    sched.plan_ahead()  # the step is on the device
    # a's 4 prompt tokens fill block 0; its first sampled token (position 4) needs block 2,
    # taken now, while the step is on the device. b's token (position 3) fits block 1.
    assert sched.kv.held_block_ids("a", 5) == [0, 2] and sched.kv.held_block_ids("b", 4) == [1]
    sched.update(plan, sampled(plan))
    nxt = sched.schedule()
    assert sched.num_plans_ahead == 1
    assert (rids(nxt.seqs), nxt.num_new_tokens, nxt.block_ids) == (["a", "b"], [1, 1], [[0, 2], [1]])
    assert nxt.block_ids[0] is sched.kv.held_block_ids("a", 5)  # the request's own table


def test_taken_plans_are_the_full_schedules_plans() -> None:
    def run(ahead: bool) -> list[tuple[list[str], list[int], list[list[int]]]]:
        sched = make_scheduler(async_scheduling=True, block_size=4, num_blocks=16)
        seqs = [make_seq("a", 6, max_tokens=9), make_seq("b", 3, max_tokens=4, eos=frozenset({EOS})),
                make_seq("c", 9, max_tokens=7)]
        for s in seqs:
            sched.add(s)
        plans = []
        num = 0
        while sched.has_unfinished():
            plan = sched.schedule()
            plans.append((rids(plan.seqs), plan.num_new_tokens, [list(t) for t in plan.block_ids]))
            sched.advance(plan)
            if ahead:
                sched.plan_ahead()
            num += 1
            sched.update(plan, sampled(plan, {"b": EOS} if num == 3 else None))  # b stops on EOS
        assert all_free(sched)
        assert (sched.num_plans_ahead > 0) == ahead
        return plans

    assert run(ahead=True) == run(ahead=False)


def test_a_stopped_or_aborted_sequence_leaves_the_plan_and_frees_its_grown_table() -> None:
    sched = make_scheduler(async_scheduling=True, block_size=4)
    a, b, c = make_seq("a", 4, max_tokens=1), make_seq("b", 4, max_tokens=5), make_seq("c", 4, max_tokens=5)
    for s in (a, b, c):
        sched.add(s)
    plan = launched(sched)
    assert [sched.kv.held_block_ids(r, 5) for r in "abc"] == [[0, 3], [1, 4], [2, 5]]
    sched.finish(c, "abort")  # the inbox drained under the step: blocks 2 and 5 free
    sched.update(plan, sampled(plan))  # a reaches max_tokens: blocks 0 and 3 free
    nxt = sched.schedule()
    assert sched.num_plans_ahead == 1
    assert (rids(nxt.seqs), nxt.block_ids) == (["b"], [[1, 4]])
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks - 2


def test_no_plan_ahead_while_a_prompt_is_unfinished_or_a_request_waits() -> None:
    sched = make_scheduler(async_scheduling=True, block_size=4, max_num_batched_tokens=6)
    sched.add(make_seq("a", 10, max_tokens=2))
    launched(sched)  # 6 of a's 10 prompt tokens: a prompt chunk follows
    assert sched._ahead is None
    sched2 = make_scheduler(async_scheduling=True, block_size=4, max_num_seqs=1)
    sched2.add(make_seq("a", 4, max_tokens=3))
    sched2.add(make_seq("b", 4, max_tokens=3))  # waits for a's slot
    launched(sched2)
    assert sched2._ahead is None


def test_a_request_that_arrives_after_the_plan_was_made_gets_the_full_schedule() -> None:
    sched = make_scheduler(async_scheduling=True, block_size=4)
    a = make_seq("a", 4, max_tokens=5)
    sched.add(a)
    plan = launched(sched)
    assert sched._ahead is not None
    sched.add(make_seq("b", 3, max_tokens=2))  # a later add, after the plan was made
    sched.update(plan, sampled(plan))
    nxt = sched.schedule()
    assert sched.num_plans_ahead == 0
    assert (rids(nxt.seqs), nxt.num_new_tokens, nxt.block_ids) == (["a", "b"], [1, 3], [[0, 1], [2]])


def test_a_table_that_cannot_grow_leaves_preemption_to_the_full_schedule() -> None:
    # 3 blocks: a and b hold one each after their 4-token prompts; each first token needs a
    # second block, and only one is free.
    sched = make_scheduler(async_scheduling=True, block_size=4, num_blocks=3)
    a, b = make_seq("a", 4, max_tokens=3), make_seq("b", 4, max_tokens=3)
    sched.add(a)
    sched.add(b)
    plan = launched(sched)
    assert sched._ahead is None
    assert sched.kv.held_block_ids("a", 5) == [0, 2]  # grown before b's could not: as schedule would
    sched.update(plan, sampled(plan))
    nxt = sched.schedule()
    assert sched.num_plans_ahead == 0
    assert rids(nxt.seqs) == ["a"] and rids(nxt.preempted) == ["b"]
    assert b.num_computed_tokens == 0 and isinstance(b, Sequence)
