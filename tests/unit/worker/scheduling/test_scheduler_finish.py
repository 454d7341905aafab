"""How sequences leave the scheduler: stop conditions (EOS, stop token ids, max_tokens,
max_model_len, min_tokens) and abort, freeing their blocks."""
from __future__ import annotations

from tests.support.scheduler_helpers import all_free, make_scheduler, make_seq, rids, step
from worker.scheduling.scheduler import Scheduler
from worker.sequence import Sequence


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
