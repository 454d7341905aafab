"""Scaling decisions as metrics: what each pool's policy saw and decided, every tick.

The policy (cluster/autoscaling.py:QueueDepthPolicy) runs inside the Serve controller, so
its metrics go out the way Serve's own autoscaling metrics do (`serve_autoscaling_*`):
`ray.util.metrics`, exported by the Ray metrics agent of the controller's node (the head;
Prometheus adds `ray_` to every name). The chart scrapes that port on the head (its
ServiceMonitor's second endpoint).

    kvserve_autoscaling_target_replicas{application,deployment,role}
        the target Serve runs now (after its delays and bounds)
    kvserve_autoscaling_desired_replicas{...}
        what the policy asks for this tick (bounded; Serve applies it once wanted for the delay)
    kvserve_autoscaling_signal{...,signal}
        the pool's summed load: num_waiting, num_waiting_prompt_tokens, num_running, kv_usage
    kvserve_autoscaling_wanted_replicas{...,signal}
        replicas each sizing signal asks for (num_waiting or num_waiting_prompt_tokens by
        role, kv_usage, floor)
    kvserve_autoscaling_binding_signal{...,signal}
        1 for the signal that set the demand, 0 for the others
    kvserve_autoscaling_decisions{...,direction}   (counter; `_total` when exported)
        changes of the target Serve applied, up or down

Signals are absent while no replica reported (the policy then holds the pool's size).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.autoscaling import Demand

POOL_TAGS = ("application", "deployment", "role")


def _ray_metrics() -> tuple[Any, Any]:
    from ray.util import metrics

    return metrics.Gauge, metrics.Counter


class PolicyMetrics:
    """One pool's decision metrics. `backend`: (Gauge, Counter) classes with
    ray.util.metrics' interface (`set`/`inc` with `tags=`); Ray's by default."""

    def __init__(self, application: str, deployment: str, role: str, backend: tuple[Any, Any] | None = None) -> None:
        gauge, counter = backend or _ray_metrics()
        self.tags = {"application": application, "deployment": deployment, "role": role}
        signal_tags = (*POOL_TAGS, "signal")
        self.target = gauge("kvserve_autoscaling_target_replicas", "Replicas Serve targets for the pool now.", tag_keys=POOL_TAGS)
        self.desired = gauge("kvserve_autoscaling_desired_replicas",
                             "Replicas the pool's policy asks for (Serve applies its delays to it).", tag_keys=POOL_TAGS)
        self.signal = gauge("kvserve_autoscaling_signal", "The pool's summed load signal, as the policy saw it.",
                            tag_keys=signal_tags)
        self.wanted = gauge("kvserve_autoscaling_wanted_replicas", "Replicas one signal asks for.", tag_keys=signal_tags)
        self.binding = gauge("kvserve_autoscaling_binding_signal", "1 for the signal that set the pool's demand.",
                             tag_keys=signal_tags)
        self.decisions = counter("kvserve_autoscaling_decisions", "Changes of the pool's target Serve applied.",
                                 tag_keys=(*POOL_TAGS, "direction"))
        self._last_target: int | None = None

    def record(self, target: int, desired: int, demand: Demand | None) -> None:
        """One tick: Serve's current target, the policy's answer, and the demand behind it
        (None: no replica reported)."""
        if self._last_target is not None and target != self._last_target:
            direction = "up" if target > self._last_target else "down"
            self.decisions.inc(1, tags={**self.tags, "direction": direction})
        self._last_target = target
        self.target.set(target, tags=self.tags)
        self.desired.set(desired, tags=self.tags)
        if demand is None:
            return
        for name, value in demand.signals.items():
            self.signal.set(value, tags={**self.tags, "signal": name})
        binding = demand.signal
        for name, replicas in demand.wanted.items():
            self.wanted.set(replicas, tags={**self.tags, "signal": name})
            self.binding.set(1.0 if name == binding else 0.0, tags={**self.tags, "signal": name})
