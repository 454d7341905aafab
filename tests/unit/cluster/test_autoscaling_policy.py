"""cluster/autoscaling.py: the queue-depth / KV-usage policy, without Ray (exact numbers)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cluster.autoscaling import (
    Bounds,
    PoolTargets,
    QueueDepthPolicy,
    ReplicaLoad,
    apply_delays,
    decide,
    desired_replicas,
    loads_from_metrics,
    queue_depth_policy,
)

MIXED = PoolTargets(role="mixed", target_waiting_per_replica=4, kv_usage_ceiling=0.8)
DECODE = PoolTargets(role="decode", target_waiting_per_replica=4, kv_usage_ceiling=0.8)
PREFILL = PoolTargets(role="prefill", target_waiting_prompt_tokens_per_replica=1000, kv_usage_ceiling=0.8)
BOUNDS = Bounds(min_replicas=1, max_replicas=10, upscale_delay_s=10, downscale_delay_s=60)
NO_DELAY = Bounds(min_replicas=1, max_replicas=10)


def load(waiting: float = 0, tokens: float = 0, running: float = 0, kv: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(num_waiting=waiting, num_waiting_prompt_tokens=tokens, num_running=running, kv_usage=kv)


# ----------------------------------------------------------------------------- demand

@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([load(waiting=8), load(waiting=8)], 4),  # 16 waiting / 4 per replica
        ([load(waiting=8), load(waiting=0)], 2),  # exactly at target: no extra replica
        ([load(waiting=9), load(waiting=0)], 3),  # one over: one more
        ([load(running=50, kv=0.3), load(running=50, kv=0.3)], 1),  # 0.6 KV fits one replica under 0.8
        ([load(kv=0.95), load(kv=0.95)], 3),  # 1.9 / 0.8 -> 3
        ([load(waiting=2, kv=0.9), load(waiting=2, kv=0.9), load(waiting=2, kv=0.9)], 4),  # KV dominates
        ([load(waiting=40, kv=0.1)], 10),  # queue dominates
        ([], 1),  # idle, no scale-to-zero: one replica
        ([load(), load(), load()], 1),  # idle pool shrinks to one
    ],
)
def test_desired_replicas_decode(loads: list[ReplicaLoad], expected: int) -> None:
    assert desired_replicas(loads, DECODE) == expected
    assert desired_replicas(loads, MIXED) == expected  # mixed pools use the decode signals


def test_kv_usage_alone_would_hide_a_long_queue() -> None:
    # Admission-limited replicas sit below the KV ceiling while requests pile up.
    loads = [load(waiting=30, running=8, kv=0.7), load(waiting=30, running=8, kv=0.7)]
    assert desired_replicas(loads, DECODE) == 15  # 60 waiting / 4, although KV says 2


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([load(tokens=3000), load(tokens=1000)], 4),  # 4000 prompt tokens / 1000
        ([load(waiting=100, tokens=500)], 1),  # many short prompts: tokens, not requests, count
        ([load(waiting=1, tokens=30_000)], 30),  # one huge prompt is a lot of prefill work
        ([load(tokens=0, kv=0.9), load(tokens=0, kv=0.9)], 3),  # in-flight prefills hold KV
    ],
)
def test_desired_replicas_prefill(loads: list[ReplicaLoad], expected: int) -> None:
    assert desired_replicas(loads, PREFILL) == expected


def test_scale_to_zero_only_when_enabled_and_idle() -> None:
    to_zero = PoolTargets(role="decode", scale_to_zero=True)
    assert desired_replicas([load()], to_zero) == 0
    assert desired_replicas([load(running=1)], to_zero) == 1
    assert desired_replicas([], to_zero, queued_elsewhere=1) == 1
    assert desired_replicas([load()], PoolTargets(role="decode")) == 1  # the default keeps one


def test_queued_at_handles_counts_as_waiting() -> None:
    assert desired_replicas([load(waiting=4)], DECODE, queued_elsewhere=8) == 3


# ----------------------------------------------------------------------------- delays

def test_scale_up_waits_for_the_upscale_delay() -> None:
    replicas, state = apply_delays(4, 2, now=100.0, state={}, bounds=BOUNDS)
    assert (replicas, state) == (2, {"direction": "up", "since": 100.0})
    replicas, state = apply_delays(5, 2, now=109.9, state=state, bounds=BOUNDS)
    assert (replicas, state) == (2, {"direction": "up", "since": 100.0})
    replicas, state = apply_delays(5, 2, now=110.0, state=state, bounds=BOUNDS)
    assert (replicas, state) == (5, {})  # the latest wish, once the delay has passed


def test_a_dip_resets_the_pending_scale_up() -> None:
    _, state = apply_delays(4, 2, now=100.0, state={}, bounds=BOUNDS)
    replicas, state = apply_delays(2, 2, now=105.0, state=state, bounds=BOUNDS)
    assert (replicas, state) == (2, {})
    replicas, state = apply_delays(4, 2, now=112.0, state=state, bounds=BOUNDS)
    assert (replicas, state) == (2, {"direction": "up", "since": 112.0})


def test_direction_change_restarts_the_clock() -> None:
    _, state = apply_delays(1, 3, now=0.0, state={}, bounds=BOUNDS)
    assert state == {"direction": "down", "since": 0.0}
    replicas, state = apply_delays(5, 3, now=30.0, state=state, bounds=BOUNDS)
    assert (replicas, state) == (3, {"direction": "up", "since": 30.0})


def test_scale_down_waits_for_the_downscale_delay() -> None:
    state: dict[str, Any] = {}
    for t in (0.0, 30.0, 59.0):
        replicas, state = apply_delays(1, 3, now=t, state=state, bounds=BOUNDS)
        assert replicas == 3
    assert apply_delays(1, 3, now=60.0, state=state, bounds=BOUNDS) == (1, {})


def test_scale_up_from_zero_is_immediate() -> None:
    assert apply_delays(1, 0, now=5.0, state={}, bounds=BOUNDS) == (1, {})


# ----------------------------------------------------------------------------- decide

def test_decide_clamps_to_bounds() -> None:
    loads = [load(waiting=400)]
    assert decide(loads, 10, 0.0, {}, NO_DELAY, DECODE) == (10, {})  # wants 100, max 10
    idle = [load(), load(), load()]
    assert decide(idle, 3, 0.0, {}, Bounds(min_replicas=2, max_replicas=10), DECODE) == (2, {})


def test_decide_min_zero_still_keeps_one_replica_without_scale_to_zero() -> None:
    bounds = Bounds(min_replicas=0, max_replicas=4)
    assert decide([load()], 2, 0.0, {}, bounds, DECODE) == (1, {})
    to_zero = PoolTargets(role="decode", scale_to_zero=True)
    assert decide([load()], 2, 0.0, {}, bounds, to_zero) == (0, {})


def test_decide_without_metrics_holds_the_current_size() -> None:
    assert decide(None, 3, 0.0, {"direction": "up", "since": 1.0}, BOUNDS, DECODE) == (
        3, {"direction": "up", "since": 1.0})
    assert decide(None, 12, 0.0, {}, BOUNDS, DECODE) == (10, {})  # but within bounds


def test_decide_sequence_over_time() -> None:
    """Burst -> wait upscale delay -> scale up; lull -> wait downscale delay -> down."""
    state: dict[str, Any] = {}
    current = 1
    busy = [load(waiting=12, kv=0.5)]  # 12 / 4 = 3 replicas
    timeline = []
    for t in (0, 5, 10, 15):
        current, state = decide(busy, current, float(t), state, BOUNDS, DECODE)
        timeline.append(current)
    assert timeline == [1, 1, 3, 3]
    idle = [load(), load(), load()]
    timeline = []
    for t in (20, 50, 79, 80):
        current, state = decide(idle, current, float(t), state, BOUNDS, DECODE)
        timeline.append(current)
    assert timeline == [3, 3, 3, 1]


def test_targets_are_validated() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        PoolTargets(role="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_usage_ceiling"):
        PoolTargets(kv_usage_ceiling=1.5)
    with pytest.raises(ValueError, match="target_waiting_per_replica"):
        PoolTargets(target_waiting_per_replica=0)


# ----------------------------------------------------------------------------- Serve adapter

def test_loads_from_metrics() -> None:
    metrics = {
        "num_waiting": {"r1": 3.0, "r2": 1.0},
        "num_waiting_prompt_tokens": {"r1": 300.0},
        "num_running": {"r1": 8.0, "r2": 2.0},
        "kv_usage": {"r1": 0.5, "r2": float("nan")},
    }
    assert loads_from_metrics(metrics) == [
        ReplicaLoad(num_waiting=3.0, num_waiting_prompt_tokens=300.0, num_running=8.0, kv_usage=0.5),
        ReplicaLoad(num_waiting=1.0, num_waiting_prompt_tokens=0.0, num_running=2.0, kv_usage=0.0),
    ]
    assert loads_from_metrics({}) is None
    assert loads_from_metrics(None) is None
    assert loads_from_metrics({"other": {"r1": 1.0}}) is None


def context(metrics: dict[str, dict[str, float]] | None, target: int, now: float,
            state: dict[str, Any] | None = None, queued: float = 0.0) -> SimpleNamespace:
    """The AutoscalingContext attributes the policy reads (names as in Ray 2.60)."""
    return SimpleNamespace(
        aggregated_metrics=metrics,
        target_num_replicas=target,
        current_num_replicas=target,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state=state or {},
        current_time=now,
        total_queued_requests=queued,
        config=SimpleNamespace(upscale_delay_s=10.0, downscale_delay_s=60.0),
    )


def test_policy_adapter_reads_the_context() -> None:
    metrics = {"num_waiting": {"a": 10.0, "b": 10.0}, "kv_usage": {"a": 0.5, "b": 0.5},
               "num_running": {"a": 4.0, "b": 4.0}, "num_waiting_prompt_tokens": {"a": 0.0, "b": 0.0}}
    # Undelayed demand: Serve applies the delays to what the adapter returns.
    assert queue_depth_policy(context(metrics, 2, now=100.0)) == (5, {})  # 20 waiting / 4 per replica
    assert queue_depth_policy(context(metrics, 5, now=100.1)) == (5, {})


def test_policy_class_takes_kwargs() -> None:
    policy = QueueDepthPolicy(role="prefill", target_waiting_prompt_tokens_per_replica=2048)
    metrics = {"num_waiting_prompt_tokens": {"a": 10_000.0}, "num_waiting": {"a": 3.0}}
    assert policy(context(metrics, 1, now=0.0)) == (5, {})


def test_policy_under_serves_own_delay_wrapper() -> None:
    """Serve 2.60 wraps every custom policy in `_apply_autoscaling_config` (delays, factors,
    bounds). Composed with it, a sustained queue scales up exactly after upscale_delay_s and
    a lull scales down after downscale_delay_s (a second timer inside the adapter made the
    two reset each other: the pool never moved)."""
    from ray.serve import autoscaling_policy
    from unittest import mock

    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(min_replicas=1, max_replicas=8, upscale_delay_s=2.0, downscale_delay_s=4.0,
                               look_back_period_s=30.0)
    wrapped = autoscaling_policy._apply_autoscaling_config(QueueDepthPolicy(target_waiting_per_replica=4))
    clock = [1000.0]
    busy = {"num_waiting": {"a": 20.0}, "num_running": {"a": 2.0}, "kv_usage": {"a": 0.1}}
    idle = {"num_waiting": {"a": 0.0}, "num_running": {"a": 0.0}, "kv_usage": {"a": 0.0}}
    target, state, changes = 1, {}, []
    with mock.patch.object(autoscaling_policy.time, "time", lambda: clock[0]):
        for tick in range(200):  # 0.1 s control-loop ticks
            ctx = SimpleNamespace(**{**vars(context(busy if tick < 100 else idle, target, clock[0], state)),
                                     "config": config, "total_num_requests": 1.0,
                                     "capacity_adjusted_max_replicas": 8})
            new, state = wrapped(ctx)
            if new != target:
                changes.append((round(clock[0] - 1000.0, 1), target, new))
                target = new
            clock[0] += 0.1
    assert changes == [(2.0, 1, 5), (14.0, 5, 1)]


def test_policy_function_is_importable_by_serve_path() -> None:
    import importlib

    module, name = "cluster.autoscaling:queue_depth_policy".split(":")
    assert getattr(importlib.import_module(module), name) is queue_depth_policy


def test_context_attribute_names_match_installed_ray() -> None:
    """The adapter reads these AutoscalingContext attributes; fail loudly if Ray renames one."""
    from ray.serve import config
    import inspect

    params = set(inspect.signature(config.AutoscalingContext.__init__).parameters)
    assert {"target_num_replicas", "capacity_adjusted_min_replicas", "capacity_adjusted_max_replicas",
            "policy_state", "current_time", "config", "aggregated_metrics",
            "total_queued_requests"} <= params
    fields = config.AutoscalingConfig.model_fields
    assert {"upscale_delay_s", "downscale_delay_s", "policy"} <= set(fields)
