"""benchmarks/planner_serve.py without Ray: the case's Serve config (the planner on the
modelled clock, the model load as the workers' set-up), the real run's attainment in
modelled time, and replica start-ups read from polled replica states."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.planner_serve import ModelLoad, ServeCase, misses, served_attainment, start_ups
from cluster.app import autoscaling_config
from cluster.config import KVServeConfig
from cluster.slo_config import PLANNER_POLICY


def test_the_case_runs_the_planner_on_the_modelled_clock_with_serves_delays_dilated() -> None:
    case = ServeCase(dilation=3.0, downscale_delay_s=10.0)
    config = KVServeConfig.from_dict(case.kvserve_config())
    a = config.workers.autoscaling
    assert a is not None
    policy = autoscaling_config(a, config)
    assert policy.policy is not None and policy.policy.policy_function == PLANNER_POLICY
    kwargs = policy.policy.policy_kwargs
    assert kwargs["time_dilation"] == 3.0 and kwargs["settings"]["startup_s"] == case.startup_s
    assert policy.downscale_delay_s == 30.0 and policy.upscale_delay_s == 0.0  # real seconds
    sim = case.sim_config(replica_startup_s=6.5)
    assert sim.planner is not None and sim.planner.replica_startup_s == 6.5
    assert sim.planner.settings == case.settings() and sim.max_step_time_s == case.max_step_time_s
    assert sim.stats_period_s == pytest.approx(1.0 / 3.0)
    ModelLoad(0.0)()  # the set-up hook: a plain callable


def test_served_attainment_divides_real_times_by_the_dilation() -> None:
    def result(ttft: float, e2e: float, n: int = 11, ok: bool = True) -> SimpleNamespace:
        return SimpleNamespace(success=ok, ttft_s=ttft, e2e_s=e2e, output_tokens=n)

    # dilation 2: TTFT 6 s real is 3 s modelled (within 3 s); 10 gaps over 0.6 s real are 30 ms
    # modelled, over 0.8 s 40 ms
    results = [result(6.0, 6.6), result(6.2, 6.8), result(1.0, 1.8), result(1.0, 2.0, ok=False)]
    # met; TTFT 3.1 s missed; ITL 40 ms missed; failed
    assert served_attainment(results, 2.0, 3.0, 0.035) == pytest.approx(0.25)


def test_start_ups_match_ready_replicas_to_the_oldest_asked_for() -> None:
    # (time, starting, running): one replica up from the start; two asked at 10, one more at
    # 12; ready at 30, 31 and 40; one asked at 50 comes and is ready between two polls (60).
    timeline = [(0.0, 0, 1), (10.0, 2, 1), (12.0, 3, 1), (30.0, 2, 2), (31.0, 1, 3), (40.0, 0, 4),
                (50.0, 1, 4), (55.0, 0, 4), (60.0, 0, 5)]
    # the rise to 1 starting at 50 and the running rise at 60 both count: 50 -> 60, and the
    # running rise's own ask at 60 is not matched
    assert start_ups(timeline)[:3] == [20.0, 21.0, 28.0]
    assert start_ups(timeline[:6]) == [20.0, 21.0, 28.0]


def test_misses_count_each_target() -> None:
    pairs = [(1.0, 0.02), (4.0, 0.02), (2.0, 0.05), (None, None)]
    text = misses(pairs, 3.0, 0.035)
    # TTFT: 4.0 late and one never answered; ITL: 0.05 slow
    assert "2 over the TTFT target" in text and "1 over the ITL target" in text
