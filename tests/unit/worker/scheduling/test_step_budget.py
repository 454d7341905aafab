"""The step-time budget (worker/scheduling/step_budget.py): the prefill tokens a step with decodes may
carry, its correction by measured steps, the scheduler using it, and engines on a simulated
and a real (CPU) device under it."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.scheduler_helpers import make_scheduler, make_seq, step
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.scheduling.step_budget import MIN_PREFILL_TOKENS, StepTimeBudget
from worker.engine.build import build_engine

MS = 1e-3


def linear(rows: list[tuple[int, int, bool]]) -> float:
    """1 ms a step, 0.1 ms a decode, 0.01 ms a prefill token, 0.001 ms a context token of a prefill."""
    t = 1 * MS
    for n, context, _ in rows:
        t += 0.1 * MS if n == 1 else 0.01 * MS * n + 0.001 * MS * context
    return t


class Linear:
    """`linear` as the budget's StepPredictor."""

    def predict_rows(self, rows: list[tuple[int, int, bool]]) -> float:
        return linear(rows)

    def predict_beside(self, planned: list[tuple[int, int, bool]]) -> Callable[[tuple[int, int, bool]], float]:
        return lambda row: linear(planned + [row])


def test_prefill_tokens_fill_the_time_left_by_the_decodes() -> None:
    budget = StepTimeBudget(Linear(), 10 * MS)
    decodes = [(1, 500, True)] * 20  # 1 + 2 ms: 7 ms left, minus 1 ms of context at 1000
    n = budget.prefill_tokens(decodes, 1000, 2048)
    assert 600 - 16 <= n <= 600 and linear(decodes + [(n, 1000, True)]) <= 10 * MS
    assert budget.num_capped == 1


def test_a_fitting_chunk_keeps_the_token_budget() -> None:
    budget = StepTimeBudget(Linear(), 10 * MS)
    assert budget.prefill_tokens([(1, 10, True)], 0, 256) == 256  # 1 + 0.1 + 2.56 ms fits
    assert budget.num_capped == 0


def test_a_step_without_decodes_keeps_the_whole_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=512, max_model_len=2048, num_blocks=512)
    sched.step_budget = StepTimeBudget(Linear(), 1 * MS)  # less than any step takes
    sched.add(make_seq("long", 1000))
    plan, _ = step(sched)
    assert plan.num_new_tokens == [512]  # nothing waits on this step
    assert sched.step_budget.num_capped == 0


def test_a_prompt_always_advances() -> None:
    budget = StepTimeBudget(Linear(), 2 * MS)  # 200 decodes alone take 21 ms
    assert budget.prefill_tokens([(1, 10, True)] * 200, 0, 2048) == MIN_PREFILL_TOKENS


def test_measured_steps_correct_the_prediction() -> None:
    budget = StepTimeBudget(Linear(), 10 * MS)
    decodes = [(1, 500, True)] * 20
    before = budget.prefill_tokens(decodes, 0, 2048)
    for _ in range(200):  # the device runs twice as slow as its profile says
        budget.observe(decodes + [(256, 0, True)], 2 * linear(decodes + [(256, 0, True)]))
    assert budget.ratio == pytest.approx(2.0, rel=1e-3)
    after = budget.prefill_tokens(decodes, 0, 2048)
    assert 2 * linear(decodes + [(after, 0, True)]) <= 10 * MS < 2 * linear(decodes + [(before, 0, True)])


def test_a_later_prefill_row_gets_only_what_is_left() -> None:
    budget = StepTimeBudget(Linear(), 10 * MS)
    planned = [(1, 500, True)] * 20 + [(500, 0, True)]  # 3 + 5 ms: 2 ms left
    n = budget.prefill_tokens(planned, 1000, 2048, floor=0)  # 1 ms of it goes to the context
    assert 100 - 16 <= n <= 100
    assert budget.prefill_tokens(planned + [(n, 1000, True)], 1000, 2048, floor=0) == 0


def test_a_step_that_reads_zero_carries_its_prediction() -> None:
    budget = StepTimeBudget(Linear(), 10 * MS)
    rows = [(1, 0, True), (128, 0, True)]
    for _ in range(300):  # CUDA: a chunk that samples nothing reads 0, the next reading holds both
        budget.observe(rows, 0.0)
        budget.observe(rows, 2 * 2 * linear(rows))
    assert budget.ratio == pytest.approx(2.0, rel=1e-3)


def test_rejects_a_non_positive_target() -> None:
    with pytest.raises(ValueError):
        StepTimeBudget(Linear(), 0.0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_step_time_s=-1.0)
    from cluster.config import ConfigError, KVServeConfig

    with pytest.raises(ConfigError, match="max_step_time_s"):
        KVServeConfig.from_dict({"engine": {"max_step_time_s": 0}})


def test_scheduler_prices_each_admitted_prompt_at_its_own_place() -> None:
    sched = make_scheduler(max_num_batched_tokens=512, max_model_len=2048, num_blocks=512)
    sched.step_budget = StepTimeBudget(Linear(), 3 * MS)
    for i in range(4):
        sched.add(make_seq(f"d{i}", 8, max_tokens=50))
    step(sched)
    sched.add(make_seq("short", 40))
    sched.add(make_seq("long", 1000))
    plan, _ = step(sched)
    # 1.4 ms for the step and its decodes, 0.4 ms for the 40-token prompt: 1.2 ms (<= 120 tokens) left
    assert plan.num_new_tokens[:5] == [1, 1, 1, 1, 40]
    assert 104 <= plan.num_new_tokens[5] <= 120
    rows = [(n, 0, True) for n in plan.num_new_tokens]
    assert linear(rows) <= 3 * MS


def test_scheduler_gives_the_prompt_only_what_fits_beside_the_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=512, max_model_len=2048, num_blocks=512)
    sched.step_budget = StepTimeBudget(Linear(), 3 * MS)
    decoding = [make_seq(f"d{i}", 8, max_tokens=50) for i in range(4)]
    for seq in decoding:
        sched.add(seq)
    plan, _ = step(sched)  # four prompts of 8, no decodes yet: the whole token budget
    assert plan.num_new_tokens == [8, 8, 8, 8]
    long = make_seq("long", 1000)
    sched.add(long)
    plan, _ = step(sched)
    # 1 ms + 4 decodes (0.4 ms) leave 1.6 ms: 160 tokens at context 0, within the search's 16
    assert plan.num_new_tokens[:4] == [1, 1, 1, 1]
    first = plan.num_new_tokens[4]
    assert 144 <= first <= 160
    plan, _ = step(sched)  # the chunk continues at its context (0.001 ms a token of it)
    assert 128 <= plan.num_new_tokens[4] < first
    assert linear([(1, s.num_computed_tokens, True) for s in decoding] + [(plan.num_new_tokens[4], first, True)]) <= 3 * MS


def test_sim_engine_steps_stay_within_the_budget_and_tokens_do_not_change() -> None:
    from worker.sim.build import build_sim_engine

    def run(max_step_time_s: float | None) -> tuple[dict[str, list[int]], list[float], int]:
        sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=16384,
                                max_step_time_s=max_step_time_s)
        engine = build_sim_engine("llama-3-8b", "h200", sched, CacheConfig(num_blocks_override=4096))
        mixed: list[float] = []  # modelled times of the steps that carried decodes and a prompt chunk
        execute = engine.runner.execute

        def recording(plan):  # noqa: ANN001, ANN202
            result = execute(plan)
            if 1 in plan.num_new_tokens and any(n > 1 for n in plan.num_new_tokens):
                mixed.append(engine.runner.last_step_s)
            return result

        engine.runner.execute = recording
        for i in range(48):  # decodes with long contexts, and long prompts arriving beside them
            engine.add_request(f"d{i}", [i + 1] * 6000, SamplingParams(max_tokens=64))
        out: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps += 1
            if steps == 60:
                for i in range(8):
                    engine.add_request(f"p{i}", [7000 + i] * 8000, SamplingParams(max_tokens=4))
        return out, mixed, engine.scheduler.step_budget.num_capped if engine.scheduler.step_budget else 0

    free, free_steps, _ = run(None)
    capped, capped_steps, num_capped = run(0.05)
    assert capped == free  # tokens are a function of the history, not of the chunking
    assert num_capped > 0 and len(capped_steps) > 10 and max(free_steps) > 0.05
    assert max(capped_steps) <= 0.05 + 1e-9


def test_real_engine_needs_a_profile_and_keeps_greedy_tokens() -> None:
    from worker.default_model import default_model_path
    from worker.engine.core import Engine

    def engine(max_step_time_s: float | None, profile: str | None) -> Engine:
        return build_engine(EngineConfig(
            model=ModelConfig(model=default_model_path(), device="cpu", dtype="float32", num_threads=1,
                              step_time_profile=profile),
            cache=CacheConfig(kv_cache_bytes=16 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                                      max_step_time_s=max_step_time_s)))

    with pytest.raises(ValueError, match="step_time_profile"):
        engine(0.01, None)

    def run(e: Engine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i in range(4):
            e.add_request(f"d{i}", list(range(10 + i, 40 + i)), SamplingParams(max_tokens=24, temperature=0.0))
        n = 0
        while e.has_unfinished():
            n += 1
            if n == 3:
                e.add_request("long", list(range(100, 700)), SamplingParams(max_tokens=4, temperature=0.0))
            for o in e.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    budgeted = engine(0.002, "cpu-calibrated")  # tighter than a 256-token chunk beside 4 decodes
    assert run(budgeted) == run(engine(None, None))
    budget = budgeted.scheduler.step_budget
    assert budget is not None and budget.num_capped > 0 and budget.ratio != 1.0  # measured steps observed
