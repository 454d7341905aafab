"""Host work under device work (worker/scheduling/async_scheduler.py): on a device that works beside the
host, the async engine builds and publishes step N's outputs, takes its stats and drains
its inbox while step N+1 is on the device; the tokens are those of the serial loop.

Time is a fake clock (the simulated runner's `time`: perf_counter reads it, sleep advances
it), so "a step takes max(device, host)" is checked exactly, without wall time; host work
in the window is a stats call that advances the clock. Cross-thread ordering uses events.
"""
from __future__ import annotations

import asyncio
import random
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_api_helpers import all_free, await_condition, make_engine
from tests.support.sim_overlap import (SCHED, FakeClock, requests, serial_tokens, sim_engine, stream_tokens,
                                     token_lists)
from worker.api import RequestOutput, SamplingParams
from worker.engine.async_engine import STEP_THREAD_SWITCH_INTERVAL_S, AsyncEngine
from worker.config import CacheConfig
from worker.engine.stats import EngineStats
from worker.runner.model_runner import ModelRunner
from worker.sim.build import build_sim_engine
from worker.sim.runner import SimRunner

# -- which loop runs ----------------------------------------------------------------------------

def test_only_a_device_beside_the_host_overlaps(tiny_llama: Path) -> None:
    assert sim_engine().overlaps_device  # sleeping: the step runs on the clock
    assert not build_sim_engine("llama-3-8b", "h200", SCHED).overlaps_device  # the simulator's: no wall time
    cpu = make_engine(tiny_llama)
    assert isinstance(cpu.runner, ModelRunner) and not cpu.overlaps_device  # the host computes the step


# -- a step takes max(device, host), not the sum ------------------------------------------------

@pytest.mark.parametrize("host_s", [0.002, 0.030])  # under a decode step (~6 ms modelled), and over it
async def test_host_work_in_the_window_hides_under_the_device_step(
    clock: FakeClock, engines: list[AsyncEngine], host_s: float
) -> None:
    core = sim_engine(launch_ahead=False)  # one step on the device at a time
    runner = core.runner
    assert isinstance(runner, SimRunner)
    # The runner's device calls, timed on the fake clock: (launched, modelled, returned).
    steps: list[list[float]] = []
    launch, wait = runner.launch, runner.wait

    def timed_launch(plan: Any) -> Any:
        handle = launch(plan)
        steps.append([clock.now, runner.last_step_s, 0.0])
        return handle

    def timed_wait(handle: Any) -> Any:
        out = wait(handle)
        steps[-1][2] = clock.now
        return out

    runner.launch, runner.wait = timed_launch, timed_wait
    ae = AsyncEngine(core)
    engines.append(ae)
    stats = core.stats

    def stats_with_host_work() -> EngineStats:  # the loop's host work between launch and wait
        clock.now += host_s
        return stats()

    core.stats = stats_with_host_work  # type: ignore[method-assign]
    reqs = requests(1, 6)
    await stream_tokens(ae, reqs)
    assert len(steps) > 10
    for launched, modelled, returned in steps:
        # Time dilation 1: the device is busy for the modelled step from its launch; the host
        # works meanwhile, and the step returns at whichever ends last.
        assert returned - launched == pytest.approx(max(modelled, host_s), abs=1e-9)
    # Between a step's return and the next launch the loop does only update and schedule,
    # which take no fake time here: nothing else waits on the critical path.
    for (_, _, returned), (next_launch, _, _) in zip(steps, steps[1:]):
        assert next_launch == pytest.approx(returned, abs=1e-9)
    # So the run takes the sum of the maxima, where a serial loop would take the sum of both.
    total = steps[-1][2] - steps[0][0]
    assert total == pytest.approx(sum(max(m, host_s) for _, m, _ in steps), abs=1e-6)
    assert total < sum(m + host_s - 0.9 * min(m, host_s) for _, m, _ in steps)


async def test_advance_runs_under_the_device_and_update_after_it(clock: FakeClock, engines: list[AsyncEngine]) -> None:
    """Per step: launch, then advance (the plan alone) while the step is on the device,
    then wait, then update (the sampled tokens); the step thread takes the GIL back within
    a short switch interval. (Launched ahead, advance follows the previous step's update:
    tests/unit/worker/scheduling/test_launch_ahead.py.)"""
    core = sim_engine(launch_ahead=False)
    calls: list[str] = []

    def traced(obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def call(*args: Any) -> Any:
            calls.append(name)
            return fn(*args)

        setattr(obj, name, call)

    for obj, name in ((core.runner, "launch"), (core.runner, "wait"), (core.scheduler, "advance"),
                      (core.scheduler, "update")):
        traced(obj, name)
    ae = AsyncEngine(core)
    engines.append(ae)
    await stream_tokens(ae, requests(3, 6))
    assert sys.getswitchinterval() <= STEP_THREAD_SWITCH_INTERVAL_S
    steps = [calls[i:i + 4] for i in range(0, len(calls), 4)]
    assert len(steps) > 10
    assert all(step == ["launch", "advance", "wait", "update"] for step in steps)


# -- the same tokens as the serial loop ----------------------------------------------------------

async def test_overlapped_loop_gives_the_serial_loops_tokens(clock: FakeClock, engines: list[AsyncEngine]) -> None:
    reqs = requests(2, 12)
    # A small pool: preemptions happen (recomputed, the same tokens after).
    cache = CacheConfig(num_blocks_override=24)
    expected = serial_tokens(sim_engine(cache=cache), reqs)
    core = sim_engine(cache=cache)
    ae = AsyncEngine(core)
    engines.append(ae)
    assert core.overlaps_device
    got = await stream_tokens(ae, reqs)
    assert token_lists(got) == expected
    for rid, outs in got.items():
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        lp = [o.logprobs for o in outs if o.logprobs]
        assert (len(lp) == len(outs)) == (reqs[rid][1].logprobs is not None)
    assert core.kv.num_free_blocks == core.kv.num_total_blocks
    assert core.scheduler.num_plans_ahead > 0  # decode steps planned under the device


# -- an abort while the step that holds the request is on the device ----------------------------

async def test_abort_of_a_request_in_the_step_on_the_device(clock: FakeClock, engines: list[AsyncEngine]) -> None:
    core = sim_engine()
    runner = core.runner
    launched, proceed = threading.Event(), threading.Event()
    launch = runner.launch
    num_launches = 0

    def gated_launch(plan: Any) -> Any:
        nonlocal num_launches
        handle = launch(plan)
        num_launches += 1
        if num_launches == 3:  # step 3 is on the device: hold the host here until the abort is queued
            launched.set()
            assert proceed.wait(10)
        return handle

    runner.launch = gated_launch
    ae = AsyncEngine(core)
    engines.append(ae)
    stream = ae.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True, detokenize=False), request_id="a")
    consumer = asyncio.ensure_future(_collect(stream))
    assert await asyncio.to_thread(launched.wait, 10)
    ae.abort("a")  # in the inbox before the loop drains it under step 3
    proceed.set()
    outs = await consumer
    # Steps 1 and 2 sampled a token each (step 2's published under step 3); step 3's token,
    # sampled for a request aborted meanwhile, is dropped.
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 0]
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    await await_condition(all_free(ae), "the aborted request's blocks freed")
    assert not core.has_unfinished()


async def _collect(stream: Any) -> list[RequestOutput]:
    return [out async for out in stream]


# -- the real runner: launch / wait, and the overlapped order on it ----------------------------

async def test_real_runner_split_at_the_device_keeps_greedy_tokens(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, engines: list[AsyncEngine]
) -> None:
    rng = random.Random(3)
    reqs = {f"g{i}": ([rng.randrange(3, 512) for _ in range(rng.randrange(2, 150))],
                      SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True, detokenize=False))
            for i in range(6)}
    expected = serial_tokens(make_engine(tiny_llama), reqs)
    # The overlapped loop on a CPU runner (it would not choose it there: launch computes the
    # whole forward), to check its order of launch / outputs / inbox / wait on real tensors.
    monkeypatch.setattr(ModelRunner, "overlaps_device", property(lambda self: True))
    core = make_engine(tiny_llama)
    assert core.overlaps_device
    ae = AsyncEngine(core)
    engines.append(ae)
    got = await stream_tokens(ae, reqs)
    assert {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in got.items()} == expected
    assert core.scheduler.num_plans_ahead > 0


def test_no_plan_ahead_while_an_export_is_due(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-side request pins its blocks when its first token is sampled; a table grown
    ahead then would pin a block the export never needed."""
    monkeypatch.setattr(ModelRunner, "overlaps_device", property(lambda self: True))
    core = make_engine(tiny_llama)
    core.scheduler.launch_ahead = lambda: None  # type: ignore[method-assign]  # the plan stays readable
    params = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)
    core.add_request("x", list(range(3, 19)), params, export_kv=True)  # 16 tokens: one full block
    core.add_request("y", list(range(40, 50)), params)
    applied = core.complete_step(core.launch_step())
    assert core.scheduler._ahead is None
    assert core.num_pinned_blocks == 1  # the prompt's one block, nothing grown ahead
    exported = [o for o in core.step_outputs(applied) if o.request_id == "x"]
    assert exported and "kv_export" in exported[0].extra
    # Exported: the next decode step is planned ahead again.
    core.complete_step(core.launch_step())
    assert core.scheduler._ahead is not None
    assert core.release_kv("x")
