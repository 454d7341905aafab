"""Queue-depth / KV-usage autoscaling of the worker pools (a Ray Serve custom policy).

Serve's default policy scales on ongoing requests per replica, which says little about a
batching engine: one replica holds hundreds of ongoing requests happily while its KV cache
has room, and is overloaded with far fewer when it has not. This policy sizes a pool on
what the workers report through `record_autoscaling_stats` (worker/serving/replica.py):

    num_waiting                 requests admitted to the engine but not yet running
    num_waiting_prompt_tokens   prompt tokens of those requests that the prefix cache does
                                not hold (the prefill work they queue)
    num_running                 requests in the running batch
    kv_usage                    used KV blocks / all KV blocks, 0..1

Demand is summed over the replicas that reported, and the pool needs the smallest number
of replicas that keeps every per-replica average under its target:

    mixed / decode:  ceil(sum(num_waiting) / target_waiting_per_replica)
                     ceil(sum(kv_usage)    / kv_usage_ceiling)
    prefill:         ceil(sum(num_waiting_prompt_tokens) / target_waiting_prompt_tokens_per_replica)
                     ceil(sum(kv_usage)    / kv_usage_ceiling)

    desired = max(those, 1 while anything runs or waits), clamped to [min, max] replicas

KV usage alone hides a long waiting queue (a replica that refuses admission sits at its
watermark), and the waiting queue alone misses a cache that is full of long decodes, so
decode pools use both. A prefill pool's queue is measured in prompt tokens: one 30k-token
prompt is more prefill work than thirty short ones.

A change is applied only once it has been wanted continuously for `upscale_delay_s`
(up) or `downscale_delay_s` (down): short bursts do not add GPU pods, and a lull does not
tear down replicas that the next burst needs. Under Serve, Serve itself applies those
delays: Ray 2.60 wraps every custom deployment policy in
`ray.serve.autoscaling_policy._apply_autoscaling_config` (cold start, scaling factors,
the delays, then bounds). So the Serve adapter below returns the undelayed demand; delaying
it here as well would not just double the delay, the two timers reset each other and the
pool never moves (each side sees "no change wanted" while the other one waits).
`apply_delays` is the same rule for callers outside Serve (and is unit-tested as such).
Scale-to-zero is off unless asked for: a pool keeps one replica (loading a model takes
minutes).

Use: KVServeConfig `workers.autoscaling` (role, target_waiting_per_replica,
target_waiting_prompt_tokens_per_replica, kv_usage_ceiling, scale_to_zero); cluster/app.py
then deploys `cluster.autoscaling:QueueDepthPolicy`, a class that Serve instantiates once
with those as `policy_kwargs` (ray/serve/_private/autoscaling_state.py). The plain function
`queue_depth_policy` (defaults only: Serve gives a function no kwargs) is for other callers.

The decision itself (`desired_replicas`, `apply_delays`, `decide`) is plain Python and
needs no Ray; `QueueDepthPolicy.__call__` adapts Serve's AutoscalingContext to it.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["mixed", "prefill", "decode"]
ROLES: tuple[str, ...] = ("mixed", "prefill", "decode")

# Names of the metrics worker/serving/replica.py:WorkerReplica.record_autoscaling_stats publishes.
NUM_WAITING = "num_waiting"
NUM_WAITING_PROMPT_TOKENS = "num_waiting_prompt_tokens"
NUM_RUNNING = "num_running"
KV_USAGE = "kv_usage"


@dataclass(frozen=True)
class PoolTargets:
    """What one replica of the pool should carry at most (averaged over the pool)."""

    role: Role = "mixed"
    target_waiting_per_replica: float = 4.0
    target_waiting_prompt_tokens_per_replica: float = 8192.0
    kv_usage_ceiling: float = 0.85
    scale_to_zero: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.target_waiting_per_replica <= 0:
            raise ValueError(f"target_waiting_per_replica must be > 0, got {self.target_waiting_per_replica}")
        if self.target_waiting_prompt_tokens_per_replica <= 0:
            raise ValueError("target_waiting_prompt_tokens_per_replica must be > 0, "
                             f"got {self.target_waiting_prompt_tokens_per_replica}")
        if not 0.0 < self.kv_usage_ceiling <= 1.0:
            raise ValueError(f"kv_usage_ceiling must lie in (0, 1], got {self.kv_usage_ceiling}")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's reported stats (as aggregated by Serve over its look-back window)."""

    num_waiting: float = 0.0
    num_waiting_prompt_tokens: float = 0.0
    num_running: float = 0.0
    kv_usage: float = 0.0


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 0.0


def _ceil_ratio(total: float, per_replica: float) -> int:
    # A tiny tolerance, so that 8 waiting at a target of 4 asks for 2 replicas, not 3,
    # when the mean arrives as 7.999999999 * ... from float aggregation.
    return max(0, math.ceil(total / per_replica - 1e-9))


@dataclass(frozen=True)
class Demand:
    """What a pool's reported load asks for, signal by signal (exported as metrics:
    cluster/autoscaling_metrics.py)."""

    signals: dict[str, float]  # the pool's summed signals: waiting, waiting_prompt_tokens, running, kv_usage
    wanted: dict[str, int]  # replicas each sizing signal asks for, "floor" included
    replicas: int  # max(wanted.values()): before bounds and delays

    @property
    def signal(self) -> str:
        """The signal that set `replicas` (the first of equals: the queue before KV usage)."""
        return max(self.wanted, key=lambda k: self.wanted[k])


def demand(loads: Iterable[ReplicaLoad], targets: PoolTargets, queued_elsewhere: float = 0.0) -> Demand:
    """Replicas this pool needs for the reported load, before bounds and delays, with the
    signals that asked for them.

    `queued_elsewhere`: requests not yet at any replica (queued at handles), which also
    count as waiting requests (they matter most when the pool has no replica at all).
    """
    loads = list(loads)
    waiting = sum(x.num_waiting for x in loads) + max(0.0, queued_elsewhere)
    waiting_tokens = sum(x.num_waiting_prompt_tokens for x in loads)
    running = sum(x.num_running for x in loads)
    kv = sum(min(max(x.kv_usage, 0.0), 1.0) for x in loads)

    wanted: dict[str, int] = {}
    if targets.role == "prefill":
        wanted[NUM_WAITING_PROMPT_TOKENS] = _ceil_ratio(waiting_tokens, targets.target_waiting_prompt_tokens_per_replica)
    else:
        wanted[NUM_WAITING] = _ceil_ratio(waiting, targets.target_waiting_per_replica)
    wanted[KV_USAGE] = _ceil_ratio(kv, targets.kv_usage_ceiling)
    busy = waiting > 0 or waiting_tokens > 0 or running > 0
    wanted["floor"] = 1 if busy or not targets.scale_to_zero else 0
    signals = {NUM_WAITING: waiting, NUM_WAITING_PROMPT_TOKENS: waiting_tokens, NUM_RUNNING: running, KV_USAGE: kv}
    return Demand(signals, wanted, max(wanted.values()))


def desired_replicas(loads: Iterable[ReplicaLoad], targets: PoolTargets, queued_elsewhere: float = 0.0) -> int:
    """Replicas this pool needs for the reported load, before bounds and delays."""
    return demand(loads, targets, queued_elsewhere).replicas


def apply_delays(
    desired: int, current: int, now: float, state: Mapping[str, Any], bounds: Bounds
) -> tuple[int, dict[str, Any]]:
    """Move from `current` to `desired` only after it has been wanted for the delay.

    State: {"direction": "up" | "down", "since": t} while a change is pending. Returns
    (replicas to run now, new state). Scaling up from zero replicas is not delayed (the
    requests that asked for it are waiting for a replica that does not exist).
    """
    if desired == current:
        return current, {}
    direction = "up" if desired > current else "down"
    if direction == "up" and current == 0:
        return desired, {}
    pending = dict(state) if state.get("direction") == direction else {"direction": direction, "since": now}
    delay = bounds.upscale_delay_s if direction == "up" else bounds.downscale_delay_s
    if now - float(pending["since"]) >= delay:
        return desired, {}
    return current, pending


def clamp(replicas: int, bounds: Bounds, targets: PoolTargets) -> int:
    low = bounds.min_replicas if targets.scale_to_zero else max(1, bounds.min_replicas)
    return min(max(replicas, low), max(bounds.max_replicas, low))


def decide(
    loads: Iterable[ReplicaLoad] | None,
    current: int,
    now: float,
    state: Mapping[str, Any],
    bounds: Bounds,
    targets: PoolTargets,
    queued_elsewhere: float = 0.0,
) -> tuple[int, dict[str, Any]]:
    """The whole policy: demand -> bounds -> delays. `loads` None: no stats yet (a new
    deployment, or a metrics gap), so hold the current size (within bounds)."""
    if loads is None:
        return clamp(current, bounds, targets), dict(state)
    desired = clamp(desired_replicas(loads, targets, queued_elsewhere), bounds, targets)
    replicas, new_state = apply_delays(desired, clamp(current, bounds, targets), now, state, bounds)
    return replicas, new_state


# ----------------------------------------------------------------------------- Serve


def loads_from_metrics(aggregated: Mapping[str, Mapping[Any, float]] | None) -> list[ReplicaLoad] | None:
    """`ctx.aggregated_metrics` ({metric: {replica_id: value}}) -> one ReplicaLoad per
    replica that reported anything; None when no replica reported."""
    if not aggregated:
        return None
    replica_ids: dict[Any, None] = {}
    for name in (NUM_WAITING, NUM_WAITING_PROMPT_TOKENS, NUM_RUNNING, KV_USAGE):
        for replica_id in (aggregated.get(name) or {}):
            replica_ids[replica_id] = None
    if not replica_ids:
        return None

    def get(name: str, replica_id: Any) -> float:
        value = (aggregated.get(name) or {}).get(replica_id)
        return float(value) if value is not None and math.isfinite(float(value)) else 0.0

    return [
        ReplicaLoad(
            num_waiting=get(NUM_WAITING, r),
            num_waiting_prompt_tokens=get(NUM_WAITING_PROMPT_TOKENS, r),
            num_running=get(NUM_RUNNING, r),
            kv_usage=get(KV_USAGE, r),
        )
        for r in replica_ids
    ]


class QueueDepthPolicy:
    """Serve custom autoscaling policy (a class: Serve instantiates it once per deployment
    with `AutoscalingPolicy.policy_kwargs`, then calls it on every autoscaling tick).

    Each tick also exports the decision (cluster/autoscaling_metrics.py: the pool's
    signals, the replicas each asks for, the target, and every change Serve applied, by
    direction) through Ray's metrics, from the Serve controller's process."""

    def __init__(self, **targets: Any) -> None:
        # PoolTargets' fields, with its defaults (written there once); a wrong name is a TypeError.
        self.targets = PoolTargets(**targets)
        self._metrics: Any = None  # created on the first tick, in the controller's process

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """ctx: ray.serve.config.AutoscalingContext."""
        # No delays here: Serve applies config.upscale_delay_s / downscale_delay_s to what
        # this returns (see the module docstring; a second timer here deadlocks with it).
        bounds = Bounds(
            min_replicas=int(ctx.capacity_adjusted_min_replicas),
            max_replicas=int(ctx.capacity_adjusted_max_replicas),
        )
        try:
            queued = float(ctx.total_queued_requests or 0.0)
        except Exception:  # not every Serve version tracks handle queues
            queued = 0.0
        now = ctx.current_time if ctx.current_time is not None else 0.0
        loads = loads_from_metrics(ctx.aggregated_metrics)
        replicas, state = decide(
            loads, int(ctx.target_num_replicas), float(now), ctx.policy_state or {}, bounds, self.targets,
            queued_elsewhere=queued,
        )
        self._export(ctx, None if loads is None else demand(loads, self.targets, queued), replicas)
        return replicas, state

    def _export(self, ctx: Any, pool_demand: Demand | None, replicas: int) -> None:
        # Metrics must never take scaling down with them: a failure is logged, once per kind.
        try:
            if self._metrics is None:
                from cluster.autoscaling_metrics import PolicyMetrics

                self._metrics = PolicyMetrics(str(ctx.app_name or ""), str(ctx.deployment_name), self.targets.role)
            self._metrics.record(int(ctx.target_num_replicas), replicas, pool_demand)
        except Exception as e:  # pragma: no cover - reported, not raised
            _log_once(f"autoscaling metrics unavailable: {type(e).__name__}: {e}")


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.getLogger(__name__).warning(message)


_DEFAULT_POLICY = QueueDepthPolicy()


def queue_depth_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """The policy with default targets (a mixed or decode pool), as a plain function."""
    return _DEFAULT_POLICY(ctx)
