"""The SLO planner driving the simulator's pools (cluster/sim/planner.py): it sizes ahead of
a ramp from the cost model, and takes an idle pool to zero and back without losing a request."""
from __future__ import annotations

import numpy as np

from cluster.planner.targets import PlannerSettings, SLOTargets
from cluster.sim.disagg import DisaggOptions
from cluster.sim.planner import SimPlannerOptions
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig
from cluster.workload.sim_kinds import SimRequest

SETTINGS = PlannerSettings(startup_s=15.0, interval_s=2.0, downscale_delay_s=4.0)


def _requests(specs: list[tuple[float, int, int]]) -> list[SimRequest]:
    """(arrival, prompt length, max_tokens) -> requests with random prompts (no shared prefix)."""
    rng = np.random.default_rng(0)
    return [SimRequest(f"r{i}", t, tuple(rng.integers(1, 30_000, size=n).tolist()), m)
            for i, (t, n, m) in enumerate(specs)]


def test_the_planner_grows_both_disaggregated_pools_for_a_burst() -> None:
    reqs = _requests([(i * 0.05, 4000, 64) for i in range(400)])  # 20 req/s for 20 s
    options = SimPlannerOptions(SLOTargets(ttft_s=1.0, itl_s=0.03), SETTINGS, 1, 6, prompt_tokens_prior=4000,
                                output_tokens_prior=64)
    cfg = SimConfig(disagg=DisaggOptions(1, 1), max_num_seqs=4, router="headroom", planner=options, seed=0)
    result = simulate(cfg, reqs)
    s = result.summary()
    assert s["num_finished"] == 400 and s["num_rejected"] == 0
    added = result.replicas[2:]
    assert {r.role for r in added} == {"prefill", "decode"}, "both pools should have grown"
    # a replica the planner asked for serves only after the start-up time
    assert all(r.ready_at is None or r.ready_at - r.created_at >= SETTINGS.startup_s for r in added)


def test_an_idle_pool_goes_to_zero_and_a_late_request_is_held_not_lost() -> None:
    early = [(i * 0.5, 200, 16) for i in range(10)]
    late = [(400.0, 200, 16), (400.5, 200, 16)]
    options = SimPlannerOptions(SLOTargets(ttft_s=1.0, itl_s=0.05), SETTINGS, 0, 2, scale_to_zero=True,
                                prompt_tokens_prior=200, output_tokens_prior=16)
    result = simulate(SimConfig(num_replicas=1, planner=options, seed=0), _requests(early + late))
    s = result.summary()
    assert s["num_finished"] == 12 and s["num_rejected"] == 0
    assert any(n == 0 for t, n in result.replica_count if t < 400.0), "the idle pool should reach zero"
    up = next(t for t, n in result.replica_count if t >= 400.0 and n > 0)
    assert up >= 400.0 + SETTINGS.startup_s  # a replica was started for them, not kept
    held = [r for r in result.records if r.arrival_s >= 400.0]
    # held while the replica started (not failed), served once it was up
    assert all(r.first_token_s is not None and r.first_token_s >= up for r in held)


def test_replicas_start_in_their_own_start_up_while_the_planner_plans_with_its_own() -> None:
    # The planner plans with a 15 s start-up; the pool's replicas really take 5 s (a run that
    # mirrors a measured cluster): the replicas it adds serve 5 s after it asked.
    reqs = _requests([(i * 0.05, 4000, 16) for i in range(200)])  # 20 req/s for 10 s
    options = SimPlannerOptions(SLOTargets(ttft_s=1.0, itl_s=0.05), SETTINGS, 1, 4, prompt_tokens_prior=4000,
                                output_tokens_prior=16, replica_startup_s=5.0)
    result = simulate(SimConfig(num_replicas=1, planner=options, seed=0), reqs)
    added = [r for r in result.replicas[1:] if r.ready_at is not None]
    assert added, "the pool should have grown"
    assert all(abs(r.ready_at - r.created_at - 5.0) < 1e-9 for r in added)


def test_two_models_share_a_binding_gpu_budget_by_priority() -> None:
    from dataclasses import replace

    from cluster.sim.fleet import simulate_fleet

    settings = PlannerSettings(startup_s=5.0, interval_s=1.0, downscale_delay_s=2.0)
    slo = SLOTargets(ttft_s=1.0, itl_s=0.03)
    base = SimConfig(num_replicas=1, max_num_seqs=4, seed=0)
    high = replace(base, planner=SimPlannerOptions(replace(slo, priority=1), settings, 1, 3, model="high",
                                                   prompt_tokens_prior=2000, output_tokens_prior=64))
    low = replace(base, planner=SimPlannerOptions(slo, settings, 0, 3, scale_to_zero=True, model="low",
                                                  prompt_tokens_prior=2000, output_tokens_prior=64))
    busy = _requests([(i * 0.05, 2000, 64) for i in range(400)])  # 20 req/s for 20 s: more than 2 replicas
    quiet = [SimRequest(f"q{i}", 30.0 + i, r.prompt_token_ids, 16) for i, r in enumerate(busy[:5])]
    first = [SimRequest(f"w{i}", 0.5 * i, r.prompt_token_ids, 16) for i, r in enumerate(busy[5:10])]
    results = simulate_fleet([(high, busy), (low, first + quiet)], gpu_budget=2)
    assert [r.summary()["num_finished"] for r in results] == [400, 10]  # nothing lost
    # the high-priority model takes the budget while it is busy (its 3 wanted cut to 2, the
    # low model's replica given up), and the low one's later requests are held until the
    # high model's pool shrinks, then served
    assert max(n for _, n in results[0].replica_count) == 2
    events = sorted([(t, 0, n) for t, n in results[0].replica_count] + [(t, 1, n) for t, n in results[1].replica_count])
    live = [0, 0]
    for _, model, n in events:
        live[model] = n
        assert sum(live) <= 2, events
    shrunk = next(t for t, n in results[0].replica_count if t > 20.0 and n == 1)
    held = [r for r in results[1].records if r.request_id.startswith("q")]
    assert all(r.first_token_s is not None and r.first_token_s > shrunk for r in held)
