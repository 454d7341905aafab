"""The policy's decision metrics (cluster/autoscaling_metrics.py), through the real
QueueDepthPolicy called as Serve calls it, with a recording metrics backend in place of
ray.util.metrics (the export path itself: tests/integration/test_autoscaling_pools.py)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from cluster.autoscaling import PoolTargets, QueueDepthPolicy, ReplicaLoad, demand
from cluster.autoscaling_metrics import PolicyMetrics


class Recorded:
    """ray.util.metrics' Gauge/Counter interface, keeping the latest value per tag set."""

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> None:
        self.name, self.tag_keys = name, tag_keys
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def _key(self, tags: dict[str, str]) -> tuple[tuple[str, str], ...]:
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        return tuple(sorted(tags.items()))

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.values[self._key(tags)] = float(value)

    def inc(self, value: float, tags: dict[str, str]) -> None:
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0.0) + value

    def get(self, **tags: str) -> float | None:
        for key, value in self.values.items():
            if tags.items() <= dict(key).items():
                return value
        return None


def ctx(target: int, waiting: float = 0.0, tokens: float = 0.0, kv: float = 0.0) -> Any:
    metrics = {"num_waiting": {"r1": waiting}, "num_waiting_prompt_tokens": {"r1": tokens},
               "num_running": {"r1": 1.0}, "kv_usage": {"r1": kv}}
    return SimpleNamespace(app_name="app", deployment_name="prefill", capacity_adjusted_min_replicas=1,
                           capacity_adjusted_max_replicas=4, total_queued_requests=0.0, current_time=0.0,
                           target_num_replicas=target, aggregated_metrics=metrics, policy_state={})


def policy_with_recorder(**targets: Any) -> tuple[QueueDepthPolicy, PolicyMetrics]:
    policy = QueueDepthPolicy(**targets)
    policy._metrics = PolicyMetrics("app", "prefill", policy.targets.role, backend=(Recorded, Recorded))
    return policy, policy._metrics


def test_each_tick_exports_signals_demand_and_target() -> None:
    policy, m = policy_with_recorder(role="prefill", target_waiting_prompt_tokens_per_replica=1000)
    replicas, _ = policy(ctx(target=1, tokens=2500, kv=0.3))
    assert replicas == 3
    assert m.target.get(deployment="prefill") == 1 and m.desired.get(deployment="prefill") == 3
    assert m.signal.get(signal="num_waiting_prompt_tokens") == 2500
    assert m.wanted.get(signal="num_waiting_prompt_tokens") == 3 and m.wanted.get(signal="kv_usage") == 1
    assert m.binding.get(signal="num_waiting_prompt_tokens") == 1 and m.binding.get(signal="kv_usage") == 0
    assert m.wanted.get(signal="num_waiting") is None  # a prefill pool sizes on prompt tokens


def test_decisions_count_the_changes_serve_applied() -> None:
    policy, m = policy_with_recorder(role="decode", target_waiting_per_replica=4)
    for target in (1, 1, 3, 3, 2, 1, 1):  # Serve's target as it moves
        policy(ctx(target=target, waiting=4 * target))
    assert m.decisions.get(direction="up") == 1
    assert m.decisions.get(direction="down") == 2


def test_binding_signal_is_kv_usage_when_the_cache_is_full() -> None:
    d = demand([ReplicaLoad(num_waiting=1, kv_usage=0.95), ReplicaLoad(kv_usage=0.9)], PoolTargets(kv_usage_ceiling=0.8))
    assert d.wanted == {"num_waiting": 1, "kv_usage": 3, "floor": 1}
    assert (d.replicas, d.signal) == (3, "kv_usage")


def test_metrics_failure_never_stops_scaling() -> None:
    policy = QueueDepthPolicy()

    class Broken:
        def record(self, *args: Any) -> None:
            raise RuntimeError("no metrics agent")

    policy._metrics = Broken()
    assert policy(ctx(target=1, waiting=8))[0] == 2
