"""Speculative decoding on the simulated device: the real scheduler plans verify rows, the
cost model prices them, drafts are accepted at the workload's rate, the tokens are those of
a run without speculation; the discrete-event simulator takes the rate per workload and its
capacity figures say when speculation pays."""
from __future__ import annotations

import pytest

from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig
from cluster.workload.sim_kinds import SimRequest
from worker.api import SamplingParams
from worker.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from worker.engine.core import Engine
from worker.sim.build import build_sim_engine


def _run(engine: Engine, num_requests: int, max_tokens: int) -> dict[str, list[int]]:
    for i in range(num_requests):
        engine.add_request(f"r{i}", list(range(1 + 100 * i, 1 + 100 * i + 64)), SamplingParams(max_tokens=max_tokens))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(num_requests)}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def _engine(num_tokens: int, acceptance: float, max_num_seqs: int = 64) -> Engine:
    return build_sim_engine("llama-3-8b", "h100", SchedulerConfig(max_num_seqs=max_num_seqs), CacheConfig(),
                            speculative=SpeculativeConfig(method="ngram", num_tokens=num_tokens) if num_tokens else None,
                            spec_acceptance=acceptance)


@pytest.mark.parametrize("acceptance", [0.3, 0.8])
def test_same_tokens_fewer_steps_and_the_rate_it_was_given(acceptance: float) -> None:
    plain, spec = _engine(0, 0.0), _engine(4, acceptance)
    assert _run(spec, 4, 200) == _run(plain, 4, 200)
    stats = spec.stats()
    counters = spec.scheduler.speculator.counters
    assert counters.draft_acceptance == pytest.approx(acceptance, abs=0.06)
    assert counters.num_verify_rows > 30
    assert stats.num_steps < plain.stats().num_steps
    assert stats.kv.free_blocks == stats.kv.total_blocks


def test_modelled_time_says_when_speculation_pays() -> None:
    """Batch 1 with a high rate: the verify steps cost about a decode step and yield ~3
    tokens, so the run takes far less modelled time. Batch 256 with a low rate and long
    drafts: each verify step computes 9 tokens a row for ~1.4 tokens, more time than it saves."""
    times = {}
    for name, (batch, k, rate) in {"small": (1, 4, 0.8), "large": (256, 8, 0.3)}.items():
        for side in ("plain", "spec"):
            engine = _engine(k if side == "spec" else 0, rate, max_num_seqs=256)
            _run(engine, batch, 64)
            times[name, side] = engine.runner.total_step_s
    assert times["small", "spec"] < 0.5 * times["small", "plain"]
    assert times["large", "spec"] > times["large", "plain"]


def test_simulation_takes_the_rate_per_workload() -> None:
    requests = [SimRequest(f"r{i}", 0.01 * i, tuple(range(1000 * i + 1, 1000 * i + 257)), 128) for i in range(4)]
    plain = simulate(SimConfig(num_replicas=1, keep_token_times=True), requests)
    spec = simulate(SimConfig(num_replicas=1, keep_token_times=True, spec_num_tokens=4, spec_acceptance=0.8), requests)
    assert [r.num_output_tokens for r in spec.records] == [r.num_output_tokens for r in plain.records]
    assert max(r.finish_s for r in spec.records) < 0.6 * max(r.finish_s for r in plain.records)
    with pytest.raises(ValueError, match="spec_acceptance"):
        SimConfig(spec_num_tokens=4, spec_acceptance=1.5)
