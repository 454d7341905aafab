"""Autoscaling in the simulator: the real policy (cluster/autoscaling.py: `decide`, i.e.
demand from the replicas' autoscaling stats -> bounds -> up/down delays), evaluated every
`interval_s` on the simulated replicas' stats, per pool.

  * scale up: new replicas are created at once and join the pool (routers see them, they
    start reporting) only `startup_delay_s` later (a model load); they count toward the
    pool's size from the decision on, as Serve counts starting replicas;
  * scale down: replicas still starting are cancelled first, then the newest live ones
    drain: routers stop choosing them at once, and each is removed when its last request
    finishes (never a running request dropped).
Requests waiting in the routers' queues for that pool count as waiting demand
(`queued_elsewhere`, as Serve's handle queues do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.autoscaling import Bounds, PoolTargets, ReplicaLoad, decide
from cluster.sim.ingress import Pool
from cluster.sim.replica import SimReplica

if TYPE_CHECKING:
    from cluster.sim.run import Simulation

_TARGETS = PoolTargets()


@dataclass(frozen=True)
class AutoscaleOptions:
    min_replicas: int = 1
    max_replicas: int = 16
    interval_s: float = 10.0  # Serve's metrics push/look-back cadence is seconds, not sub-second
    startup_delay_s: float = 60.0  # a model load on a fresh replica
    upscale_delay_s: float = 30.0  # Serve's defaults
    downscale_delay_s: float = 600.0
    target_waiting_per_replica: float = _TARGETS.target_waiting_per_replica
    target_waiting_prompt_tokens_per_replica: float = _TARGETS.target_waiting_prompt_tokens_per_replica
    kv_usage_ceiling: float = _TARGETS.kv_usage_ceiling

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("autoscaling needs 1 <= min_replicas <= max_replicas")
        if self.interval_s <= 0 or self.startup_delay_s < 0:
            raise ValueError("interval_s must be > 0 and startup_delay_s >= 0")

    def bounds(self) -> Bounds:
        return Bounds(self.min_replicas, self.max_replicas, self.upscale_delay_s, self.downscale_delay_s)

    def targets(self, role: str) -> PoolTargets:
        return PoolTargets(role, self.target_waiting_per_replica,  # type: ignore[arg-type]
                           self.target_waiting_prompt_tokens_per_replica, self.kv_usage_ceiling)


def replica_load(replica: SimReplica) -> ReplicaLoad:
    """WorkerReplica.record_autoscaling_stats of a simulated replica."""
    stats = replica.engine.stats()
    return ReplicaLoad(num_waiting=float(stats.num_waiting),
                       num_waiting_prompt_tokens=float(stats.num_waiting_prompt_tokens),
                       num_running=float(stats.num_running), kv_usage=stats.kv.usage)


class PoolResizer:
    """Grows or shrinks one simulated pool to a size: new replicas join after the start-up
    delay, shrinking cancels starting ones first, then drains the newest live ones. A pool
    shrinks to zero replicas only with `allow_zero` (scale-to-zero: requests then wait in the
    routers' queues for the next replica)."""

    def __init__(self, sim: Simulation, pool: Pool, startup_delay_s: float, allow_zero: bool = False) -> None:
        self.sim = sim
        self.pool = pool
        self.startup_delay_s = startup_delay_s
        self.allow_zero = allow_zero
        self.starting: list[SimReplica] = []  # created, not yet ready
        self.decisions: list[tuple[float, int]] = []  # (time, target size) on each change

    @property
    def current(self) -> int:
        return len(self.pool.live()) + len(self.starting)

    def resize(self, desired: int) -> None:
        current = self.current
        if desired != current:
            self.decisions.append((self.sim.clock.now, desired))
        for _ in range(desired - current):
            replica = self.sim.new_replica(self.pool.role)
            self.starting.append(replica)
            self.sim.clock.after(self.startup_delay_s, self._ready, replica)
        for _ in range(current - desired):
            self._shrink_one()

    def _ready(self, replica: SimReplica) -> None:
        if replica not in self.starting:
            return  # cancelled while starting
        self.starting.remove(replica)
        self.sim.bring_up(replica)

    def _shrink_one(self) -> None:
        if self.starting:
            replica = self.starting.pop()  # never ready: it served nothing
            replica.removed_at = self.sim.clock.now
            return
        live = self.pool.live()
        if len(live) <= (0 if self.allow_zero else 1):
            return
        victim = live[-1]  # the newest
        victim.draining = True
        self.sim.count_live()
        if victim.num_ongoing == 0:
            self.sim.remove(victim)


class SimAutoscaler(PoolResizer):
    def __init__(self, sim: Simulation, pool: Pool, options: AutoscaleOptions) -> None:
        super().__init__(sim, pool, options.startup_delay_s)
        self.options = options
        self.bounds = options.bounds()
        self.targets = options.targets(pool.role)
        self.state: dict[str, Any] = {}
        sim.clock.after(options.interval_s, self._tick)

    def _tick(self) -> None:
        sim = self.sim
        live = self.pool.live()
        queued = float(sum(len(r.queues[self.pool.role]) for r in sim.routers))
        loads = [replica_load(r) for r in live] or None
        desired, self.state = decide(loads, self.current, sim.clock.now, self.state, self.bounds, self.targets,
                                     queued_elsewhere=queued)
        self.resize(desired)
        sim.clock.after(self.options.interval_s, self._tick)
