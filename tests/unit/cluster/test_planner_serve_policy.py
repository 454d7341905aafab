"""The SLO planner as Serve's autoscaling policy (cluster/planner/serve_policy.py): it reads
the workers' totals from Serve's AutoscalingContext, differences them per replica, and sizes
the pool with the same planner the simulator runs; the GPU budget binds across pools."""
from __future__ import annotations

import inspect
from typing import Any

import pytest

from ray.serve import config as serve_config
from ray.serve._private.common import TimeStampedValue

from cluster.config import KVServeConfig
from cluster.app import autoscaling_config
from cluster.planner import serve_policy
from cluster.planner.serve_policy import ServeFleet, SLOPlannerPolicy
from cluster.slo_config import PLANNER_POLICY


def _context(now: float, totals: dict[str, tuple[float, float, float]], waiting: float = 0.0,
             queued: float = 0.0) -> serve_config.AutoscalingContext:
    """A real AutoscalingContext whose replicas report (arrived, prompt tokens, generated) totals."""
    names = ("num_arrived", "num_arrived_prompt_tokens", "num_generated_tokens")
    raw: dict[str, dict[Any, list[TimeStampedValue]]] = {
        name: {r: [TimeStampedValue(now, v[i])] for r, v in totals.items()} for i, name in enumerate(names)}
    raw["num_waiting"] = {r: [TimeStampedValue(now, waiting / max(len(totals), 1))] for r in totals}
    raw["num_running"] = {r: [TimeStampedValue(now, 0.0)] for r in totals}
    params = set(inspect.signature(serve_config.AutoscalingContext.__init__).parameters)
    kwargs: dict[str, Any] = dict(
        deployment_id=None, deployment_name="worker", app_name="kvserve", current_num_replicas=len(totals),
        target_num_replicas=len(totals), running_replicas=list(totals), total_num_requests=0.0,
        total_queued_requests=queued, aggregated_metrics={}, raw_metrics=raw, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=16, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=None)
    return serve_config.AutoscalingContext(**{k: v for k, v in kwargs.items() if k in params})


def _policy(role: str = "decode", budget: float | None = None, model: str = "m",
            time_dilation: float = 1.0) -> SLOPlannerPolicy:
    config = KVServeConfig.from_dict({
        "model": {"served_model_name": model},
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "max_num_seqs": 256,
                   "time_dilation": time_dilation},
        "workers": {"autoscaling": {"role": role, "max_replicas": 16, "slo": {
            "ttft_ms": 3000, "itl_ms": 35, "gpu_budget": budget, "startup_s": 60}}},
    })
    policy = autoscaling_config(config.workers.autoscaling, config).policy
    assert policy is not None and policy.policy_function == PLANNER_POLICY
    return SLOPlannerPolicy(**policy.policy_kwargs)


def test_the_policy_sizes_a_decode_pool_from_the_reported_totals(monkeypatch: Any) -> None:
    monkeypatch.setattr(serve_policy, "FLEET", ServeFleet())
    policy = _policy()
    assert policy(_context(0.0, {"a": (0, 0, 0)}))[0] == 1  # nothing seen yet: the floor
    # 10 s later: 240 requests of 8000 prompt tokens arrived, 1024 tokens each generated per
    # request on average: 24 req/s of the bursty case's mix.
    replicas, _ = policy(_context(10.0, {"a": (240, 240 * 8000, 240 * 1024)}))
    load = policy.planner.last_load
    assert load is not None and load.prompt_tokens == 8000 and load.output_tokens == 1024
    assert replicas == policy.planner.sizer.decode_replicas(load) > 1
    # a tick within the interval repeats the decision (Serve calls every control-loop turn)
    assert policy(_context(12.0, {"a": (240, 240 * 8000, 240 * 1024)}))[0] == replicas


def test_a_restarted_replica_counts_from_zero_and_the_budget_binds(monkeypatch: Any) -> None:
    monkeypatch.setattr(serve_policy, "FLEET", ServeFleet())
    policy = _policy(budget=3)
    policy(_context(0.0, {"a": (1000, 1000 * 8000, 1000 * 1024)}))
    # replica a went away, b is new: its totals are all new arrivals
    replicas, _ = policy(_context(10.0, {"b": (240, 240 * 8000, 240 * 1024)}))
    assert replicas == 3  # wanted more, the budget grants 3 GPUs
    assert policy.planner.forecaster.level > 0


def test_slo_targets_without_a_step_cost_model_are_refused() -> None:
    import pytest

    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match="step_time_profile"):
        KVServeConfig.from_dict({"engine": {"device": "cpu"},
                                 "workers": {"autoscaling": {"slo": {"ttft_ms": 1000, "itl_ms": 50}}}})
    # without targets the queue-depth policy stays the default
    plain = KVServeConfig.from_dict({"workers": {"autoscaling": {"max_replicas": 2}}})
    policy = autoscaling_config(plain.workers.autoscaling, plain).policy
    assert policy is not None and policy.policy_function == "cluster.autoscaling:QueueDepthPolicy"


def test_a_decode_pool_plans_from_its_models_prefill_arrivals(monkeypatch: Any) -> None:
    monkeypatch.setattr(serve_policy, "FLEET", ServeFleet())
    prefill, decode = _policy("prefill"), _policy("decode")
    for policy in (prefill, decode):
        policy(_context(0.0, {"a": (0, 0, 0)}))
    # 240 requests reached the prefill pool; only 24 have reached the decode pool yet, and
    # answered 1024 tokens each
    prefill(_context(10.0, {"p": (240, 240 * 8000, 240)}))
    decode(_context(10.0, {"d": (24, 24 * 8000, 24 * 1024)}))
    assert decode.planner.forecaster.level == prefill.planner.forecaster.level == 24.0
    # the answers' length is per request that reached decode (not 24 x 1024 / 240)
    assert decode.planner.forecaster.now().output_tokens == 1024


def test_on_a_dilated_device_the_policy_runs_on_the_modelled_clock(monkeypatch: Any) -> None:
    monkeypatch.setattr(serve_policy, "FLEET", ServeFleet())
    policy = _policy(time_dilation=4.0)
    assert policy.time_dilation == 4.0
    policy(_context(0.0, {"a": (0, 0, 0)}))
    # 40 real seconds are 10 modelled ones: 240 requests in them are 24 req/s, as undilated
    replicas, _ = policy(_context(40.0, {"a": (240, 240 * 8000, 240 * 1024)}))
    assert policy.planner.forecaster.level == pytest.approx(24.0)
    # 20 real seconds later is 5 modelled: within the 10 s tick, the decision stands
    assert policy(_context(60.0, {"a": (480, 480 * 8000, 480 * 1024)}))[0] == replicas
    assert policy.planner.forecaster.level == pytest.approx(24.0)
