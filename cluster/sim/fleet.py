"""Several models on one simulated cluster: one simulation per model (its own pools,
engine settings and requests) on ONE virtual clock, their SLO planners sharing one GPU
budget (cluster/planner/budget.py FleetBudget, as Serve's controller shares it across
deployments). Each model's planner ticks at the same virtual times; a pool's grant sees
the other pools' latest demands, as under Serve.
"""
from __future__ import annotations

from collections.abc import Sequence

from cluster.planner.budget import FleetBudget
from cluster.sim.clock import EventQueue
from cluster.sim.metrics import SimResult
from cluster.sim.run import Simulation
from cluster.sim.setup import SimConfig, SimDevice
from cluster.workload.sim_kinds import SimRequest


def simulate_fleet(models: Sequence[tuple[SimConfig, Sequence[SimRequest]]],
                   gpu_budget: float | None = None) -> list[SimResult]:
    """Run every model's simulation together; one result per model, in order."""
    names = [config.planner.model for config, _ in models if config.planner is not None]
    if len(set(names)) != len(names):
        raise ValueError(f"each model's planner needs its own name in the fleet, got {names}")
    clock, fleet = EventQueue(), FleetBudget(gpu_budget)
    sims = [Simulation(config, SimDevice.from_config(config), clock, fleet) for config, _ in models]
    for sim, (_, requests) in zip(sims, models):
        sim.start(requests)
    clock.run(stop=lambda: all(sim.done() for sim in sims))
    return [sim.result() for sim in sims]
