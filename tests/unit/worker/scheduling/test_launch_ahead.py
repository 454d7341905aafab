"""Step N+1 launched before step N's tokens are back (worker/scheduling/async_scheduler.py): the device
never idles between decode steps, a step's tokens are the serial loop's, a sequence that
stops on a token while the next step holds it loses only that row's token, and one that
stops by length is left out of the next step before its last token is drawn.

The simulated device sleeps on a fake clock (tests/support/sim_overlap.py), so "the next
step starts when this one ends" is checked exactly.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_api_helpers import make_engine
from tests.support.scheduler_helpers import make_scheduler
from tests.support.sim_overlap import FakeClock, requests, serial_tokens, sim_engine, stream_tokens, token_lists
from worker.api import SamplingParams
from worker.engine.async_engine import AsyncEngine
from worker.config import CacheConfig
from worker.scheduling.async_scheduler import last_by_length, launch_plan
from worker.runner.model_runner import ModelRunner
from worker.scheduling.plan import SchedulerOutput
from worker.sim.runner import SimRunner, SimStep
from worker.sequence import Sequence

STOPS = tuple(range(0, 200, 25))  # 8 of a 200-token vocabulary: about one token in 25 stops


def traced(obj: Any, name: str, calls: list[tuple[str, Any]]) -> None:
    fn = getattr(obj, name)

    def call(*args: Any) -> Any:
        out = fn(*args)
        calls.append((name, args[0], out))
        return out

    setattr(obj, name, call)


# -- the device never idles between decode steps --------------------------------------------------

async def test_the_next_decode_step_starts_when_the_one_before_ends(clock: FakeClock, engines: list[AsyncEngine]) -> None:
    core = sim_engine()
    runner = core.runner
    assert isinstance(runner, SimRunner) and core.launches_ahead
    steps: list[tuple[SchedulerOutput, SimStep]] = []
    launch = runner.launch

    def recorded(plan: SchedulerOutput) -> SimStep:
        handle = launch(plan)
        steps.append((plan, handle))
        return handle

    runner.launch = recorded  # type: ignore[method-assign]
    ae = AsyncEngine(core)
    engines.append(ae)
    await stream_tokens(ae, requests(4, 6))
    ahead = [i for i, (plan, _) in enumerate(steps) if plan.pending_inputs]
    assert len(ahead) > 10
    for i in ahead:
        # Queued behind step i-1: it starts on the device the moment that one is done.
        (_, before), (plan, step) = steps[i - 1], steps[i]
        device_s = step.output.forward_s
        assert step.done_at - device_s == pytest.approx(before.done_at, abs=1e-9)


async def test_launch_wait_update_advance_order(clock: FakeClock, engines: list[AsyncEngine]) -> None:
    """Launch N+1, then wait N and update N, then advance N+1 (its blocks are hashed from
    token_ids, which hold N's token only after update N)."""
    core = sim_engine()
    calls: list[tuple[str, Any, Any]] = []
    for obj, name in ((core.runner, "launch"), (core.runner, "wait"), (core.scheduler, "advance"),
                      (core.scheduler, "update")):
        traced(obj, name, calls)
    ae = AsyncEngine(core)
    engines.append(ae)
    await stream_tokens(ae, requests(3, 6))
    names = [name for name, _, _ in calls]
    checked = 0
    for i, (name, plan, _) in enumerate(calls):
        if name == "launch" and plan.pending_inputs:
            assert names[i + 1:i + 4] == ["wait", "update", "advance"]
            assert calls[i + 3][1] is plan  # the advance is the ahead plan's
            assert calls[i + 2][1] is not plan  # the update is the step before's
            checked += 1
    assert checked >= 10


# -- the same tokens as the serial loop --------------------------------------------------------------

@pytest.mark.parametrize("num_blocks", [None, 24])  # 24: preemptions (recomputed, the same tokens after)
async def test_tokens_are_the_serial_loops_with_stops_on_tokens(
    clock: FakeClock, engines: list[AsyncEngine], num_blocks: int | None
) -> None:
    reqs = requests(5, 12, stop_token_ids=STOPS)
    cache = CacheConfig(num_blocks_override=num_blocks)
    expected = serial_tokens(sim_engine(cache=cache, token_vocab_size=200), reqs)
    core = sim_engine(cache=cache, token_vocab_size=200)
    ae = AsyncEngine(core)
    engines.append(ae)
    got = await stream_tokens(ae, reqs)
    assert token_lists(got) == expected
    reasons = {outs[-1].finish_reason for outs in got.values()}
    assert reasons == {"stop", "length"}  # both kinds of stop happened
    assert core.kv.num_free_blocks == core.kv.num_total_blocks
    assert not core.has_unfinished()


async def test_a_token_stop_costs_one_dropped_row_and_a_length_stop_none(clock: FakeClock, engines: list[AsyncEngine]) -> None:
    """Rows computed = the serial loop's rows + one per request that stopped on a token
    while the step after held it; a request ending by length never rides a step past it."""
    reqs = requests(6, 10, stop_token_ids=STOPS)
    serial = sim_engine(token_vocab_size=200)
    serial_rows: list[int] = []
    execute = serial.runner.execute

    def counted(plan: SchedulerOutput) -> Any:
        serial_rows.append(len(plan.seqs))
        return execute(plan)

    serial.runner.execute = counted  # type: ignore[method-assign]
    expected = serial_tokens(serial, reqs)

    core = sim_engine(token_vocab_size=200)
    calls: list[tuple[str, Any, Any]] = []
    traced(core.runner, "launch", calls)
    ae = AsyncEngine(core)
    engines.append(ae)
    got = await stream_tokens(ae, reqs)
    assert token_lists(got) == expected
    # A wasted row: launched ahead for a sequence that stopped before its token was drawn.
    wasted = sum(token is None for _, plan, step in calls if plan.pending_inputs for token in step.output.token_ids)
    rows = sum(len(plan.seqs) for _, plan, _ in calls)
    num_stopped = sum(outs[-1].finish_reason == "stop" for outs in got.values())
    assert num_stopped > 0
    assert rows - wasted == sum(serial_rows)
    assert wasted <= num_stopped


# -- the real runner: inputs gathered from the step before's samples ------------------------------

async def test_real_runner_launched_ahead_gives_the_serial_tokens_and_logprobs(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, engines: list[AsyncEngine]
) -> None:
    """On CPU the runner would not overlap (launch computes the forward); forced to, it runs
    the CUDA path's logic on real tensors: step N sampled when N+1 is launched, N+1's input
    ids gathered from those samples. Greedy, seeded random, penalties, logprobs and stop
    tokens give the serial loop's tokens and logprobs."""
    rng = random.Random(7)

    def params(i: int, stops: tuple[int, ...] = ()) -> SamplingParams:
        return SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True, detokenize=False,
                              temperature=0.0 if i % 2 == 0 else 0.8, seed=i, logprobs=2 if i % 3 == 0 else None,
                              repetition_penalty=1.3 if i % 4 == 1 else 1.0, stop_token_ids=stops)

    reqs = {f"g{i}": ([rng.randrange(3, 512) for _ in range(rng.randrange(2, 60))], params(i)) for i in range(6)}
    first = serial_tokens(make_engine(tiny_llama), reqs)
    # Half stop on a token (their 8th, or its first earlier use), while the next step holds them.
    reqs = {rid: (prompt, params(int(rid[1:]), (first[rid][7],) if int(rid[1:]) % 2 else ()))
            for rid, (prompt, _) in reqs.items()}
    expected_outputs: dict[str, list[Any]] = {rid: [] for rid in reqs}
    serial = make_engine(tiny_llama)
    for rid, (prompt, p) in reqs.items():
        serial.add_request(rid, prompt, p)
    while serial.has_unfinished():
        for out in serial.step():
            expected_outputs[out.request_id].append(out)

    monkeypatch.setattr(ModelRunner, "overlaps_device", property(lambda self: True))
    core = make_engine(tiny_llama)
    assert core.launches_ahead
    calls: list[tuple[str, Any, Any]] = []
    traced(core.runner, "launch", calls)
    ae = AsyncEngine(core)
    engines.append(ae)
    got = await stream_tokens(ae, reqs)
    assert sum(plan.pending_inputs for _, plan, _ in calls) > 5
    assert token_lists(got) == {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in expected_outputs.items()}
    for rid, outs in got.items():
        # The same tokens and top ids; the values to float noise (a step launched ahead can
        # hold one more row, a sequence that stopped, than the serial step: other shapes).
        for o, e in zip(logprob_rows(outs), logprob_rows(expected_outputs[rid]), strict=True):
            assert (o.token_id, [t for t, _ in o.top]) == (e.token_id, [t for t, _ in e.top])
            assert [o.logprob, *(v for _, v in o.top)] == pytest.approx([e.logprob, *(v for _, v in e.top)], abs=1e-4)
        assert outs[-1].finish_reason == expected_outputs[rid][-1].finish_reason
    assert sum(len(logprob_rows(outs)) for outs in got.values()) > 10
    assert {outs[-1].finish_reason for outs in got.values()} == {"stop", "length"}
    assert core.kv.num_free_blocks == core.kv.num_total_blocks


def logprob_rows(outputs: list[Any]) -> list[Any]:
    return [lp for o in outputs if o.logprobs for lp in o.logprobs]


# -- the plan launched ahead ---------------------------------------------------------------------

def decoding(sched: Any, max_tokens: dict[str, int], prompt_len: int = 5) -> list[Sequence]:
    """Running sequences one step into their decode: each prompt computed, one token drawn."""
    seqs = [Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=n, ignore_eos=True))
            for rid, n in max_tokens.items()]
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()
    sched.update(plan, [7] * len(plan.seqs))
    return seqs


def test_a_sequence_whose_pending_token_is_its_last_is_left_out() -> None:
    sched = make_scheduler(async_scheduling=True, num_blocks=16, block_size=4)
    # "last" has drawn 1 of 2 tokens: the one the step on the device draws is its last.
    last, more = decoding(sched, {"last": 2, "more": 3})
    sched.advance(sched.schedule())  # the step on the device computes each one's token 1
    assert last_by_length(last, 4096) and not last_by_length(more, 4096)
    assert last_by_length(more, len(more.token_ids) + 1)  # the model's length ends it too
    sched.plan_ahead()
    plan = sched.launch_ahead()
    assert plan is not None and plan.pending_inputs
    assert plan.seqs == [more] and plan.num_new_tokens == [1]
    # The table holds the pending token (position 6) and the one this step draws: 7 tokens.
    assert plan.block_ids == [sched.kv.held_block_ids("more", 7)]
    assert sched.launch_ahead() is None  # taken: the next schedule plans afresh


def test_no_launch_ahead_when_every_row_ends_or_a_grammar_is_in_the_batch() -> None:
    sched = make_scheduler(async_scheduling=True, num_blocks=16, block_size=4)
    only, other = decoding(sched, {"only": 2, "other": 9})
    assert launch_plan([only], [[0, 1]], 4096) is None  # its pending token is its last
    other.grammar = object()  # type: ignore[assignment]
    assert launch_plan([other], [[2, 3]], 4096) is None  # its mask needs the matcher past N
