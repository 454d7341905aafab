"""The classic continuous-batching example, on the real Engine + Scheduler with a fake runner.

Eight requests with output lengths [5, 50, 8, 12, 40, 3, 30, 7] share four slots.
- Continuous (iteration-level) batching: a finished request's slot is refilled at the next
  step, so the batch stays full until the queue drains: 50 steps, 155 / (4 * 50) = 77.5%
  slot use.
- Static batching: a batch of four runs until its longest request finishes, then the next
  batch starts: 50 + 40 = 90 steps, 155 / (4 * 90) = 43% slot use.
"""
from __future__ import annotations

from fractions import Fraction

from tests.support.fake_runner import FakeRunner
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.api import SamplingParams

OUTPUT_LENS = [5, 50, 8, 12, 40, 3, 30, 7]
NUM_SLOTS = 4
TOKEN = 7  # never EOS (and ignore_eos is set anyway)
EOS = 2


def make_engine() -> Engine:
    return Engine(
        SchedulerConfig(max_num_seqs=NUM_SLOTS, max_num_batched_tokens=4096, max_model_len=256),
        CacheConfig(block_size=16),
        FakeRunner(num_blocks=128, token=TOKEN),  # no model: samples TOKEN
        vocab_size=100,
        eos_token_ids=frozenset({EOS}),
    )


def add(engine: Engine, i: int) -> None:
    prompt = [10 + i, 20 + i, 30 + i, 40 + i]  # short, distinct prompts
    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=OUTPUT_LENS[i], ignore_eos=True))


def run_until_done(engine: Engine, slot_use: list[int], finished_at: dict[str, int], outputs: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        step_outputs = engine.step()
        slot_use.append(sum(1 for o in step_outputs if o.new_token_ids))
        for o in step_outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason == "length"
                finished_at[o.request_id] = len(slot_use)
        assert len(slot_use) <= 1000


def assert_all_free(engine: Engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks == 128
    assert engine.seqs == {}
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


def test_continuous_batching_takes_50_steps() -> None:
    engine = make_engine()
    for i in range(len(OUTPUT_LENS)):
        add(engine, i)
    slot_use: list[int] = []
    finished_at: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    run_until_done(engine, slot_use, finished_at, outputs)

    num_steps = len(slot_use)
    assert num_steps == 50
    assert engine.counters.num_steps == 50
    assert engine.runner.num_calls == 50
    assert sum(slot_use) == sum(OUTPUT_LENS) == 155
    use = Fraction(sum(slot_use), NUM_SLOTS * num_steps)
    assert use == Fraction(155, 200)
    assert f"{float(use):.1%}" == "77.5%"
    assert f"{float(use):.0%}" == "78%"
    # The batch is full until the queue drains, then shrinks as the long ones finish.
    assert slot_use == [4] * 19 + [3] * 22 + [2] * 4 + [1] * 5
    # Each freed slot is refilled at the very next step.
    assert finished_at == {
        "r0": 5, "r1": 50, "r2": 8, "r3": 12,
        "r4": 5 + 40, "r5": 8 + 3, "r6": 11 + 30, "r7": 12 + 7,
    }
    assert {rid: len(toks) for rid, toks in outputs.items()} == {f"r{i}": n for i, n in enumerate(OUTPUT_LENS)}
    assert all(set(toks) == {TOKEN} for toks in outputs.values())
    assert engine.counters.num_generated_tokens == 155
    assert_all_free(engine)


def test_static_batching_takes_90_steps() -> None:
    engine = make_engine()
    slot_use: list[int] = []
    finished_at: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    for batch_start in range(0, len(OUTPUT_LENS), NUM_SLOTS):
        for i in range(batch_start, batch_start + NUM_SLOTS):
            add(engine, i)
        run_until_done(engine, slot_use, finished_at, outputs)  # the whole batch finishes first

    num_steps = len(slot_use)
    assert num_steps == 90  # max(5, 50, 8, 12) + max(40, 3, 30, 7)
    assert sum(slot_use) == 155
    use = Fraction(sum(slot_use), NUM_SLOTS * num_steps)
    assert use == Fraction(155, 360)
    assert f"{float(use):.0%}" == "43%"
    assert finished_at == {
        "r0": 5, "r1": 50, "r2": 8, "r3": 12,
        "r4": 50 + 40, "r5": 50 + 3, "r6": 50 + 30, "r7": 50 + 7,
    }
    assert {rid: len(toks) for rid, toks in outputs.items()} == {f"r{i}": n for i, n in enumerate(OUTPUT_LENS)}
    assert_all_free(engine)

