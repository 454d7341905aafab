"""benchmarks.routing's pieces that are logic, not measurement: the goodput search, the
run sizing, the validation figures (no simulation, no Ray)."""
from __future__ import annotations

import math

import pytest
from worker.engine.build import build_engine

from benchmarks.routing.search import RunFigures, Search, Window, goodput_at_slo
from benchmarks.routing.engine_grid import workload_grid
from benchmarks.routing.validate import Figures, into_vocab, median_pair_errors, pair_error_spread, relative_errors
from cluster.workload.sim_kinds import SimRequest


def fake_run(capacity: float, calls: list[float]):
    def run(rate: float) -> RunFigures:
        calls.append(rate)
        ok = rate <= capacity
        # Past capacity the queue grows with the overload; with no capacity at all, nothing helps.
        ttft99 = 1.0 if ok else (5.0 if capacity <= 0 else 2.0 + rate / capacity)
        return RunFigures(rate, ok, min(rate, capacity), 0.1, ttft99, 0.02, 100.0 * rate, 0.0, 1.0)
    return run


def test_search_steps_up_then_bisects_geometrically() -> None:
    calls: list[float] = []
    best = goodput_at_slo(fake_run(37.0, calls), 10.0, Search(bisect_steps=2, step=2.0))
    # 10 ok, 20 ok, 40 fails -> bracket [20, 40]; sqrt(800) = 28.3 ok; sqrt(20 * 40 * ...) = 33.6 ok
    assert calls[:3] == [10.0, 20.0, 40.0]
    assert math.isclose(calls[3], math.sqrt(20 * 40)) and math.isclose(calls[4], math.sqrt(calls[3] * 40))
    assert best.meets_slo and best.rate_rps == calls[4]


def test_search_steps_down_when_the_start_fails() -> None:
    calls: list[float] = []
    best = goodput_at_slo(fake_run(3.0, calls), 10.0, Search(bisect_steps=0, step=2.0))
    assert calls == [10.0, 5.0, 2.5] and best.rate_rps == 2.5


def test_search_gives_up_with_a_zero_when_nothing_meets_the_slo() -> None:
    calls: list[float] = []
    best = goodput_at_slo(fake_run(0.0, calls), 10.0, Search(bisect_steps=1, step=2.0))
    assert not best.meets_slo and best.goodput_rps == 0.0
    # The second miss was no better than the first (TTFT p99 5.0 both): no rate will do.
    assert calls == [10.0, 5.0]


def test_window_sizes_runs_by_arrival_time() -> None:
    w = Window(5.0, 100, 500)
    assert [w.num_requests(r) for r in (1.0, 40.0, 1000.0)] == [100, 200, 500]


def test_validation_figures_and_dilation() -> None:
    f = Figures.of([0.0, 1.0, 2.0], [0.5, 1.5, 4.0], [1.0, 3.0, 6.0], 60)
    assert (f.ttft_p50_s, f.output_tokens_per_s) == (0.5, 10.0)
    g = f.scaled(10.0)
    assert (g.ttft_p50_s, g.output_tokens_per_s) == (0.05, 100.0)


def test_into_vocab_keeps_equal_ids_equal() -> None:
    reqs = [SimRequest("a", 0.0, (5, 1500, 2999), 4), SimRequest("b", 0.0, (5, 1500, 7), 4)]
    a, b = into_vocab(reqs, 1460)
    assert all(1 <= t < 1460 for t in a.prompt_token_ids + b.prompt_token_ids)
    assert a.prompt_token_ids[:2] == b.prompt_token_ids[:2]


def test_search_marks_a_goodput_it_never_saw_fail_as_a_lower_bound() -> None:
    calls: list[float] = []
    best = goodput_at_slo(fake_run(1e9, calls), 10.0, Search(bisect_steps=3, step=2.0, max_steps_out=2))
    assert calls == [10.0, 20.0, 40.0] and best.lower_bound and best.rate_rps == 40.0


def test_sticky_gets_the_cost_models_prefill_throughput_and_only_sticky() -> None:
    from benchmarks.routing.setup import modelled_prefill_tokens_per_s, sim_config
    from worker.costs.cost_model import SeqWork, StepCostModel
    from worker.costs.profiles import load_profile
    from worker.costs.shapes import load_shape

    config = sim_config("sticky", 4)
    chunk = config.max_num_batched_tokens
    step = StepCostModel(load_shape("llama-3-8b"), load_profile("h200")).step_time_s([SeqWork(chunk, 0)])
    assert dict(config.policy_options) == {"prefill_tokens_per_s": modelled_prefill_tokens_per_s()}
    assert math.isclose(modelled_prefill_tokens_per_s(), chunk / step)
    assert sim_config("headroom", 4).policy_options == ()


def test_quick_plan_never_clamps_a_window_and_covers_every_workload() -> None:
    """A cap on requests would shrink a high rate's arrival window into one burst (the
    batch slots absorb it and the search never sees the SLO flip): only a floor applies."""
    from benchmarks.routing.setup import FULL, MIN_REQUESTS, QUICK, WORKLOADS

    for plan in (QUICK, FULL):
        for workload in WORKLOADS:
            w = plan.window_for(workload)
            assert w.num_requests(10_000.0) == round(10_000.0 * w.window_s)
            assert w.num_requests(0.01) == MIN_REQUESTS
    assert QUICK.window_for("code").window_s > QUICK.window_for("sharegpt").window_s


def test_multi_ingress_configs_differ_from_one_router_only_in_routers_and_view() -> None:
    """No 1/N headroom share any more: several routers see the same parameters as one."""
    from benchmarks.routing.setup import NUM_INGRESS, sim_config

    private, shared = (sim_config("headroom", 4, NUM_INGRESS, shared_view=s) for s in (False, True))
    assert (private.num_ingress, private.shared_view, shared.shared_view) == (NUM_INGRESS, False, True)
    assert private.policy_params == shared.policy_params == sim_config("headroom", 4).policy_params


def test_b2b_is_sized_to_llm_ds_share_of_the_clusters_kv_with_a_warm_up() -> None:
    """b2b groups fill B2B_KV_SHARE (73%) of the simulated cluster's KV at any replica count
    (one replica cannot hold them all, the cluster holds each once), and the warm-up spreads
    one request per group so that their prefill is WARMUP_PREFILL_SHARE of the cluster's."""
    from benchmarks.routing.setup import (
        B2B_WARMUP_MAX_TOKENS,
        WARMUP_PREFILL_SHARE,
        modelled_prefill_tokens_per_s,
        sim_config,
        workload_kw,
    )
    from cluster.sim.setup import SimDevice
    from cluster.workload.sim_kinds import B2B_KV_SHARE, B2B_PREFIX_LEN, B2B_QUESTION_LEN

    assert workload_kw("sharegpt", 4) == {} and workload_kw("agentic", 8) == {"warmup_s": 24.0}
    for n in (4, 8):
        kw = workload_kw("b2b", n)
        kv_tokens = n * SimDevice.from_config(sim_config("round_robin", n)).num_blocks * 16
        assert kw["num_groups"] * B2B_PREFIX_LEN == pytest.approx(B2B_KV_SHARE * kv_tokens, rel=0.01)
        assert kw["warmup_max_tokens"] == B2B_WARMUP_MAX_TOKENS
        assert kw["num_groups"] * B2B_PREFIX_LEN > kv_tokens / n  # more than one replica holds
        prefill_s = kw["num_groups"] * (B2B_PREFIX_LEN + B2B_QUESTION_LEN) / (n * modelled_prefill_tokens_per_s())
        assert kw["warmup_s"] == pytest.approx(prefill_s / WARMUP_PREFILL_SHARE, abs=0.1)


def test_cell_goodput_is_the_highest_rate_that_met_the_slo() -> None:
    from benchmarks.routing.table import Cell

    met = RunFigures(40.0, True, 31.5, 0.1, 1.2, 0.05, 900.0, 0.8, 1.1)
    never = RunFigures(0.0, False, 0.0, math.nan, math.nan, math.nan, 0.0, 0.0, 1.0)
    assert Cell([met], []).goodput() == 40.0 and Cell([met], []).attained() == 31.5
    assert Cell([met, never], []).goodput() == 20.0


def test_search_tries_a_known_miss_first_and_stops_at_the_resolution() -> None:
    """A router as good as round robin: round robin's bracket top (tried first) misses,
    its start (round robin's goodput) meets, and the bracket is already as narrow as
    bisection makes it: two runs, the same rate."""
    search = Search(bisect_steps=2, step=2.0)
    rr_calls: list[float] = []
    rr = goodput_at_slo(fake_run(37.0, rr_calls), 10.0, search)
    assert math.isclose(rr.next_miss_rps, 40.0) and rr.next_miss_rps / rr.rate_rps <= search.resolution * (1 + 1e-9)
    calls: list[float] = []
    same = goodput_at_slo(fake_run(37.0, calls), rr.rate_rps, search, known_miss=rr.next_miss_rps)
    assert calls == [rr.next_miss_rps, rr.rate_rps] and same.rate_rps == rr.rate_rps
    assert same.next_miss_rps == rr.next_miss_rps
    # A better router meets the known miss: it steps on from there (never running the
    # start, below its bracket) and bisects as usual.
    calls = []
    better = goodput_at_slo(fake_run(150.0, calls), rr.rate_rps, search, known_miss=rr.next_miss_rps)
    assert calls[:3] == [40.0, 80.0, 160.0] and len(calls) == 5
    assert better.meets_slo and 80.0 <= better.rate_rps <= 150.0 and better.next_miss_rps / better.rate_rps <= 2 ** 0.25 + 1e-9


def test_search_with_a_known_miss_steps_down_from_the_start_when_both_miss() -> None:
    """A router worse than round robin misses the known miss and the start, then steps
    down from the start; the known miss's TTFT is not the "no relief" reference (only
    rates at or below the start are)."""
    calls: list[float] = []
    worse = goodput_at_slo(fake_run(12.0, calls), 20.0, Search(bisect_steps=1, step=2.0), known_miss=25.0)
    assert calls[:3] == [25.0, 20.0, 10.0] and len(calls) == 4 and math.isclose(calls[3], math.sqrt(200.0))
    assert worse.meets_slo and worse.rate_rps == 10.0 and worse.next_miss_rps == calls[3]


def test_validation_error_is_the_median_of_each_pairs_own_error() -> None:
    """Each simulation is compared with the real run its calibration was paired with (the
    shape of the 2026-12-01 17:10 log: one real run slowed by the machine). Medians taken
    apart set pair 3's real run against pair 2's simulation."""
    reals = [Figures(0.016, 0.10, 520.0), Figures(0.022, 0.12, 510.0), Figures(0.019, 0.12, 515.0)]
    sims = [Figures(0.016, 0.10, 520.0), Figures(0.017, 0.10, 510.0), Figures(0.019, 0.12, 515.0)]
    apart = relative_errors(Figures.median(reals), Figures.median(sims))
    assert apart["ttft_p50_s"] == pytest.approx(100.0 * (0.017 - 0.019) / 0.019)  # -10.5%
    paired = median_pair_errors(reals, sims)
    assert paired == {"ttft_p50_s": 0.0, "ttft_p99_s": 0.0, "output_tokens_per_s": 0.0}  # pairs: 0, -23, 0 %
    with pytest.raises(ValueError):
        median_pair_errors(reals, sims[:2])


def test_pair_error_spread_is_each_figures_lowest_and_highest_pair_error() -> None:
    reals = [Figures(0.010, 0.10, 500.0), Figures(0.020, 0.10, 500.0), Figures(0.010, 0.10, 400.0)]
    sims = [Figures(0.011, 0.10, 500.0), Figures(0.017, 0.12, 500.0), Figures(0.010, 0.09, 420.0)]
    spread = pair_error_spread(reals, sims)
    assert spread["ttft_p50_s"] == pytest.approx((-15.0, 10.0))
    assert spread["ttft_p99_s"] == pytest.approx((-10.0, 20.0))
    assert spread["output_tokens_per_s"] == pytest.approx((0.0, 5.0))


def test_validation_grid_takes_the_workloads_prompt_and_sequence_lengths() -> None:
    """Mixed points at the prompt-length quantiles (one chunk at most), beside a few decodes
    at the 90th-percentile sequence length; decodes up to the longest sequence."""
    from benchmarks.routing import engine_grid

    requests = [SimRequest(f"r{i}", 0.0, (1,) * (10 * (i + 1)), 4) for i in range(100)]  # prompts 10..1000
    spec = workload_grid(requests, 512)
    # prompt quantile indices round(q * 99): 25, 50, 74, 89 -> 260, 510, 750 -> 512, 900 -> 512;
    # sequences 14..1004, the 90th percentile index 89 -> 904
    assert engine_grid.ENGINE_MIXED_BATCHES == (2, 4, 8)
    assert spec.mixed == tuple((c, b, 904) for c in (260, 510, 512) for b in (2, 4, 8))
    assert spec.decode_batches == engine_grid.ENGINE_DECODE_BATCHES == (1, 2, 4, 8, 16)
    assert engine_grid.ENGINE_DECODE_CONTEXTS == (16, 128, 512)
    assert spec.decode_contexts == (16, 128, 512, 1004)
    assert spec.prefill_chunks == (32, 128, 256)
    assert spec.passes == engine_grid.ENGINE_GRID_PASSES == 3
    assert workload_grid(requests, 100).prefill_chunks == (32, 100)  # one chunk at most
    short = [SimRequest("s", 0.0, (1,) * 60, 40)]
    assert workload_grid(short, 512).decode_contexts == (16, 100, 128, 512)


def test_step_check_sets_each_model_step_against_its_prediction() -> None:
    """benchmarks.routing.validate_steps: the hooks read each plan's rows before execute,
    skip steps that ran nothing, restore the engine, and log each kind of step against the
    prediction of the cost model the record holds when the block ends (the pair's own
    profile, fitted after the run), each step priced as following its predecessor's kind;
    then each request's TTFT window (from the step after it joined to its first token)."""
    from types import SimpleNamespace

    from benchmarks.routing.validate_steps import step_check

    def seq(request_id: str, done: int, total: int) -> SimpleNamespace:
        return SimpleNamespace(request_id=request_id, num_computed_tokens=done, num_tokens=total)

    plans = [SimpleNamespace(seqs=[seq("a", 0, 64), seq("b", 10, 11)], num_new_tokens=[64, 1]), None,
             SimpleNamespace(seqs=[seq("a", 64, 65), seq("b", 11, 12)], num_new_tokens=[1, 1]),
             SimpleNamespace(seqs=[seq("a", 65, 66), seq("b", 12, 13), seq("c", 0, 1)], num_new_tokens=[1, 1, 1])]

    class Runner:
        def execute(self, plan: SimpleNamespace) -> str:
            return "ran"

    class Engine:  # the wrapper is under test, not the engine: steps that call the runner or not
        def __init__(self) -> None:
            self.runner = Runner()
            self.added: list[str] = []

        def add_request(self, request_id: str) -> None:
            self.added.append(request_id)

        def step(self) -> list[SimpleNamespace]:
            plan = plans.pop(0)
            if plan is None:
                return []
            self.runner.execute(plan)
            return [SimpleNamespace(request_id=s.request_id, new_token_ids=[1]) for s in plan.seqs]

    follows: list[bool] = []

    class Cost:
        def __init__(self, s_per_token: float) -> None:
            self.s_per_token = s_per_token

        def rows_features(self, rows: list[tuple[int, int, bool]], follows_prompt: bool) -> int:
            follows.append(follows_prompt)
            return sum(n for n, _, _ in rows)

        def predict(self, num_tokens: int) -> float:
            return self.s_per_token * num_tokens

    engine, lines = Engine(), []
    with step_check(engine, Cost(1.0), lines.append) as record:
        engine.add_request("a")
        engine.add_request("b")
        assert [len(engine.step()) for _ in range(2)] == [2, 0]
        engine.add_request("c")
        assert [len(engine.step()) for _ in range(2)] == [2, 3]
        record.cost = Cost(1e-3)  # 65 ms with the chunk, 2 and 3 ms decodes only
    assert engine.added == ["a", "b", "c"]
    assert engine.step.__func__ is Engine.step and engine.runner.execute.__func__ is Runner.execute  # unhooked
    assert follows == [False, True, False]  # the step after the chunk's step (the idle step ran no model)
    assert len(lines) == 5
    assert lines[0].startswith("    steps with a prefill chunk: 1, ") and "predicted 65.00 ms" in lines[0]
    assert lines[1].startswith("    steps decodes only: 2, ") and "predicted 2.50 ms" in lines[1]
    # The decode right after the chunk's step apart from the one after it.
    assert lines[2].startswith("    decodes only, after a step with a prefill chunk: 1, step/predicted ")
    assert "; after a decode-only step: 1, step/predicted " in lines[2]
    assert lines[3].startswith("    all steps, the rest: 3, step/predicted ")  # no gap between the steps
    # a and b: the chunk's step; c joined before the second decode step and got its token there.
    assert lines[4].startswith("    TTFT windows (3 requests): ")
    assert "first-token steps: prefill after decodes 2, prefill after prefill 0, decodes after prefill 0, " \
           "decodes after decodes 1" in lines[4]


def test_the_real_engine_runs_on_the_validations_clock(tiny_llama) -> None:  # noqa: ANN001 (Path)
    """Validation 1's real side: the run's time is the clock's, so the same run reads the
    same on a busy machine. A clock that advances 10 ms per reading makes every step cost
    exactly 10 ms (one reading before the step, one after): the first request's first token
    at 10 ms, its third at 30 ms; the second arrives while the engine is idle, which jumps
    to its arrival."""
    import itertools

    from benchmarks.routing.validate import run_engine_on_clock
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.engine.core import Engine

    engine = build_engine(EngineConfig(
        model=ModelConfig(model=str(tiny_llama), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks_override=32), scheduler=SchedulerConfig(max_model_len=256)))
    ticks = itertools.count()
    requests = [SimRequest("a", 0.0, (1, 2, 3, 4), 3), SimRequest("b", 5.0, (5, 6, 7), 2)]
    progress: list[float] = []  # between steps, off the clock: the share of requests added
    figures = run_engine_on_clock(engine, requests, clock=lambda: 0.01 * next(ticks), between_steps=progress.append)
    assert progress == [0.5, 0.5, 0.5, 1.0, 1.0]  # no step (and no call) while idle before b
    assert figures.ttft_p50_s == pytest.approx(0.01)
    assert figures.ttft_p99_s == pytest.approx(0.01)
    # 5 tokens from the first arrival (0 s) to the last finish (5 s + 2 steps).
    assert figures.output_tokens_per_s == pytest.approx(5 / 5.02)


def test_quick_trace_cells_skip_the_80_percent_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """--quick's trace cells search goodput only; the full plan's also run at 80% of it.
    (The simulation is replaced: what is checked is which runs a cell asks for.)"""
    from benchmarks.routing import table
    from benchmarks.routing.setup import FULL, QUICK

    runs: list[float] = []
    found = RunFigures(5.0, True, 4.0, 0.5, 1.5, 0.09, 100.0, 0.1, 1.1)

    class Runner:
        num_runs = 0

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def goodput(self, *args: object, **kwargs: object) -> RunFigures:
            return found

        def run(self, config: object, rate: float, stop_at_slo_miss: bool = True) -> RunFigures:
            runs.append(rate)
            return found

    monkeypatch.setattr(table, "Runner", Runner)
    assert table.router_cell("trace", 4, 0, QUICK, {}, "headroom").at_80 is None and runs == []
    assert table.router_cell("b2b", 4, 0, QUICK, {}, "headroom").at_80 is found and runs == [4.0]
    assert table.router_cell("trace", 4, 0, FULL, {}, "headroom").at_80 is found and runs == [4.0, 4.0]


def test_the_calibration_beside_a_run_measures_at_a_few_moments() -> None:
    """calibrate_beside runs grid plans only once the grid lags the run by a moment's share
    (then until it has caught up): a real step right after grid plans runs with the caches
    they left, so they come in ENGINE_GRID_MOMENTS runs, not one plan between every few steps."""
    from benchmarks.routing import engine_grid

    assert engine_grid.ENGINE_GRID_MOMENTS == 8
    assert not engine_grid.grid_moment(0.1, 0.0)
    assert engine_grid.grid_moment(0.125, 0.0)
    assert not engine_grid.grid_moment(0.3, 0.2)
    assert engine_grid.grid_moment(1.0, 0.875)
    # A run of 100 requests added one per step, a grid of 80 plans: its plans run at 7
    # moments of the run, each catching up with it; the 5 left run after the last step.
    grid_done, moments = 0, []
    for added in range(1, 101):
        if engine_grid.grid_moment(added / 100, grid_done / 80):
            moments.append(added)
            while grid_done < 80 and grid_done / 80 < added / 100:
                grid_done += 1
    assert moments == [13, 27, 40, 53, 67, 80, 93] and grid_done == 75
