"""The SLO planner in the simulator: the same per-pool decision as under Serve
(cluster/planner/planner.py: observe -> forecast -> size with the step-cost model -> GPU
budget -> delays), every `interval_s`, on the simulated replicas.

What a pool observes is what its workers report under Serve (record_autoscaling_stats):
the engines' arrival and generated-token totals, differenced per replica between ticks
(a replica's first report counts from zero), their waiting and running requests, plus the
requests queued in the routers for the pool (Serve's handle queues). A decode pool plans
from the model's arrivals, as its prefill pool saw them (planner.py decode_arrivals). Resizing is
cluster/sim/autoscale.py's PoolResizer: replicas join after the start-up delay, shrinking
drains; with scale_to_zero a pool may drop to none, and requests then wait in the routers'
queues until a replica is up (admission holds them, nothing fails).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from cluster.planner.budget import share_budget
from cluster.planner.forecast import Arrivals, Forecaster
from cluster.planner.planner import PoolBounds, PoolObservation, PoolPlanner, decode_arrivals
from cluster.planner.sizing import EngineLimits, PoolSizer
from cluster.planner.targets import PlannerSettings, SLOTargets
from cluster.sim.autoscale import PoolResizer

if TYPE_CHECKING:
    from cluster.sim.run import Simulation


@dataclass(frozen=True)
class SimPlannerOptions:
    slo: SLOTargets = field(default_factory=SLOTargets)
    settings: PlannerSettings = field(default_factory=PlannerSettings)
    min_replicas: int = 1
    max_replicas: int = 16
    scale_to_zero: bool = False
    gpu_budget: float | None = None  # GPUs all pools of the simulation (or fleet) share (None: no limit)
    model: str = "model"  # the model's name in a fleet's budget (cluster/sim/fleet.py)
    prompt_tokens_prior: float = 1024.0  # the token mix assumed until requests are seen
    output_tokens_prior: float = 256.0
    # How long a new replica really takes to start (None: the planner's settings.startup_s,
    # what it plans with); a measured start-up, where a run mirrors a real cluster's.
    replica_startup_s: float | None = None

    def bounds(self) -> PoolBounds:
        return PoolBounds(self.min_replicas, self.max_replicas, self.scale_to_zero)


@dataclass
class PlanRecord:
    time_s: float
    role: str
    wanted: int
    granted: int
    replicas: int
    rate: float  # the forecast peak the decision sized for, requests/s


class SimPlanner:
    def __init__(self, sim: Simulation, options: SimPlannerOptions) -> None:
        from worker.costs.cost_model import StepCostModel
        from worker.costs.profiles import load_profile
        from worker.costs.shapes import load_shape

        self.sim = sim
        self.options = options
        config = sim.config
        cost = StepCostModel(load_shape(config.shape), load_profile(config.profile))
        limits = EngineLimits(config.max_num_seqs, config.max_num_batched_tokens,
                              sim.device.num_blocks * config.block_size)
        settings = options.settings
        self.planners = {
            role: PoolPlanner(options.model, role, PoolSizer(cost, limits, options.slo, settings),
                              Forecaster(settings, options.prompt_tokens_prior, options.output_tokens_prior),
                              options.bounds(), options.slo.priority)
            for role in sim.pools
        }
        startup = settings.startup_s if options.replica_startup_s is None else options.replica_startup_s
        self.resizers = {role: PoolResizer(sim, pool, startup, options.scale_to_zero)
                         for role, pool in sim.pools.items()}
        self._totals: dict[int, tuple[int, int, int]] = {}  # replica key -> its engine's last totals
        self._last_tick = sim.clock.now
        self.records: list[PlanRecord] = []
        sim.clock.after(settings.interval_s, self._tick)

    def _observe(self, role: str, dt: float) -> PoolObservation:
        arrived = prompt = generated = 0
        backlog = running = 0.0
        for replica in self.sim.replicas:
            if replica.role != role or replica.ready_at is None:
                continue
            if replica.removed_at is not None and replica.key not in self._totals:
                continue
            stats = replica.engine.stats()
            totals = (stats.num_arrived, stats.num_arrived_prompt_tokens, stats.num_generated_tokens)
            before = self._totals.get(replica.key, (0, 0, 0))
            arrived, prompt, generated = (arrived + totals[0] - before[0], prompt + totals[1] - before[1],
                                          generated + totals[2] - before[2])
            if replica.removed_at is not None:
                self._totals.pop(replica.key, None)  # its last counts are in; it reports no more
                continue
            self._totals[replica.key] = totals
            backlog += stats.num_waiting
            running += stats.num_running
        backlog += sum(len(r.queues[role]) for r in self.sim.routers)
        return PoolObservation(Arrivals(dt, arrived, prompt, generated), backlog, running)

    def _tick(self) -> None:
        now = self.sim.clock.now
        dt, self._last_tick = now - self._last_tick, now
        wanted: dict[str, int] = {}
        observations = {role: self._observe(role, dt) for role in self.planners}
        if "prefill" in observations:
            decode = observations["decode"]
            observations["decode"] = replace(decode, arrivals=decode_arrivals(observations["prefill"].arrivals,
                                                                              decode.arrivals))
        for role, planner in self.planners.items():
            planner.observe(observations[role])
            wanted[role] = planner.wanted(observations[role])
        demands = [p.demand(wanted[role]) for role, p in self.planners.items()]
        if self.sim.fleet is not None:  # several models' planners share one budget
            granted = {d.key: self.sim.fleet.grant(d, self.options.gpu_budget) for d in demands}
        else:
            granted = share_budget(demands, self.options.gpu_budget)
        for role, planner in self.planners.items():
            resizer = self.resizers[role]
            replicas = planner.delayed(granted[(planner.model, role)], resizer.current, now)
            resizer.resize(replicas)
            rate = planner.last_load.rate if planner.last_load is not None else 0.0
            self.records.append(PlanRecord(now, role, wanted[role], granted[(planner.model, role)], replicas, rate))
        self.sim.clock.after(self.options.settings.interval_s, self._tick)
