"""benchmarks/planner_cases.py: the phased workload, SLO attainment and GPU time of a run."""
from __future__ import annotations

import pytest

from benchmarks.planner_cases import (
    DAY_RATES, Phase, attainment, bursty_phases, gpu_seconds, oracle_gpu_seconds, phased_requests,
)
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig


def test_phases_alternate_and_arrivals_follow_their_rates() -> None:
    phases = bursty_phases(1.0, 24.0, 100.0, 2)
    assert [p.rate_rps for p in phases] == [1.0, 24.0, 1.0, 24.0]
    requests = phased_requests(phases, 16, 4, seed=0)
    high = [r for r in requests if 100.0 <= r.arrival_s < 200.0]
    low = [r for r in requests if r.arrival_s < 100.0]
    assert 2000 < len(high) < 2800 and 60 < len(low) < 140  # Poisson around 2400 and 100
    assert len({r.prompt_token_ids[:16] for r in requests}) == len(requests)  # no shared prefix
    assert all(len(rates) == 24 for rates in DAY_RATES.values())
    assert DAY_RATES["night"][12] == 0.0  # the model idle for hours


def test_attainment_and_gpu_time_of_a_small_run() -> None:
    requests = phased_requests([Phase(5.0, 2.0)], 64, 8, seed=1)
    result = simulate(SimConfig(num_replicas=2, num_blocks=2000, seed=0), requests)
    end = max(r.finish_s for r in result.records)
    assert gpu_seconds(result) == pytest.approx(2 * end)  # two replicas up from 0 to the end
    assert attainment(result, 10.0, 1.0) == 1.0  # generous targets: every request
    assert attainment(result, 1e-6, 1.0) == 0.0  # no first token that fast
    assert attainment(result, 10.0, 1.0, start_s=100.0) == 0.0  # no request in that window


def test_the_oracle_fleet_holds_the_peak_from_a_start_up_before_each_burst() -> None:
    # low 100 s, high 100 s, low 100 s; start-up 30 s; prefill 1 -> 4 with no tail, decode
    # 1 -> 6 with a 20 s tail; 300 s in all.
    phases = bursty_phases(1.0, 24.0, 100.0, 1) + [Phase(100.0, 1.0)]
    # prefill: 4 x (30 + 100) + 1 x (300 - 130); decode: 6 x (30 + 100 + 20) + 1 x (300 - 150)
    expected = 4 * 130 + 170 + 6 * 150 + 150
    assert oracle_gpu_seconds(phases, 24.0, (1, 1), (4, 6), (0.0, 20.0), 30.0, 300.0) == pytest.approx(expected)
    # a start-up longer than the lull before the burst: the peak from time 0
    assert oracle_gpu_seconds(phases, 24.0, (1,), (4,), (0.0,), 150.0, 300.0) == pytest.approx(4 * 200 + 100)
