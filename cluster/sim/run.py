"""One simulation, from a frozen SimConfig and a workload, on the virtual clock.

    arrival ──> ingress router k (round robin, or by session) ──policy rank──> replica
                  │ every replica at max_ongoing_requests: FIFO queue, retried when a slot frees
    replica: the real Engine stepped by the cost model (cluster/sim/replica.py)
    reports: every stats_period_s each replica's routing stats, to every router after report_lag_s;
             they carry the replica's KV events, which keep the routers' exact KV index
    disaggregated: prefill pool (max_tokens=1, KV exported) ─transfer─> decode pool (KV imported)
    autoscaling: the real policy (cluster/autoscaling.py) every interval, start-up delay, drain

Everything is seeded (workload, report phases, policies' own randomness); ties on the
clock run in scheduling order; so the same config and requests give the same result.
"""
from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kv.host_tier import HostTier
from cluster.planner.budget import FleetBudget
from cluster.sim.autoscale import SimAutoscaler
from cluster.sim.planner import SimPlanner
from cluster.sim.clock import EventQueue
from cluster.sim.flow import Flight, Orchestrator
from cluster.sim.follow_ups import FollowUps
from cluster.sim.ingress import Pool, SimRouter
from cluster.sim.lora import SimLoRA, enable_sim_lora
from cluster.sim.shared_view import pool_views
from cluster.sim.metrics import SimResult, Tracker, late_requests_proving_p99_miss
from cluster.sim.replica import SimReplica, VirtualDevice
from cluster.sim.setup import SimConfig, SimDevice
from cluster.sim.tiers import BlockLRU, SharedStore, SimTierManager
from cluster.workload.sim_kinds import SimRequest
from router.routing.kv_index import KVIndex
from router.routing.types import RoutingParams, ReplicaReport
from router.routing.policies.base import check_options
from router.routing.routing_view import RoutingView
from worker.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from worker.sim.build import use_sim_drafts
from worker.engine.core import Engine

# Virtual seconds without any token or dispatch, with requests unfinished, that end a run
# as stalled (far longer than any step, transfer or replica start-up).
STALL_TIMEOUT_S = 3600.0


class Simulation:
    def __init__(self, config: SimConfig, device: SimDevice, clock: EventQueue | None = None,
                 fleet: FleetBudget | None = None) -> None:
        """`clock` and `fleet`: shared with other simulations (cluster/sim/fleet.py: several
        models on one cluster, their planners sharing one GPU budget)."""
        self.config = config
        self.device = device
        self.clock = clock if clock is not None else EventQueue()  # an empty queue is falsy
        self.fleet = fleet
        self.rng = random.Random(config.seed)
        self.tracker = Tracker(config.keep_token_times, config.slo_ttft_ms / 1000.0)
        self.follow_ups = FollowUps(self.clock, self._arrive)  # closed-loop turns
        self.tracker.on_finish = self.follow_ups.finished
        max_model_len = config.max_model_len or device.max_model_len
        self.scheduler_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                                                config.max_step_time_s)
        self.cache_config = CacheConfig(block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                        session_kv_ttl_s=config.session_kv_ttl_s,
                                        session_kv_max_share=config.session_kv_max_share)
        self.replicas: list[SimReplica] = []  # every replica ever created, in creation order
        self.replica_count: list[tuple[float, int]] = []
        roles = ("prefill", "decode") if config.disagg.enabled else ("mixed",)
        self.pools = {role: Pool(role) for role in roles}
        params = config.routing_params()
        # Private views are the policies' own (make_policy); shared ones are built here.
        views = {role: pool_views(config.num_ingress, config.shared_view_rtt_s, params.report_lag_s, self.clock)
                 if config.shared_view else [None] * config.num_ingress for role in roles}
        self.routers = [
            SimRouter(k, {role: _make_policy(config, params, config.seed * 1009 + k * 31 + i, views[role][k])
                          for i, role in enumerate(roles)}, self.pools, self.clock, config.max_ongoing_requests)
            for k in range(config.num_ingress)
        ]
        for pool in self.pools.values():
            pool.routers = self.routers
        self.orchestrator = Orchestrator(self, config.disagg, device.kv_bytes_per_token)
        self.autoscalers: list[SimAutoscaler] = []
        self.planner: SimPlanner | None = None
        # The routers' exact index of every replica's KV cache, from the KV events the
        # reports carry (router/routing/kv_index.py, as PolicyRouter keeps it). One for all
        # routers: each real router copy applies the same reports, delivered to every
        # router at once here, so every copy's index would be this one.
        self.kv_index = KVIndex()
        self.shared_store = self._shared_store()
        if config.tiers.enabled and (device.host_link_bandwidth <= 0
                                     or (config.tiers.disk_bytes and device.disk_read_bandwidth <= 0)):
            raise ValueError(f"KV tiers need the device profile's host link (and disk) bandwidth; "
                             f"profile {config.profile!r} has none")
        self._next_key = 0
        self._num_requests = 0
        self._late_limit: float = math.inf  # late first tokens that prove the TTFT p99 misses
        self.last_progress_s = 0.0  # virtual time of the latest token or dispatch (stall detection)

    # -- replicas --------------------------------------------------------------------------------
    def new_replica(self, role: str) -> SimReplica:
        dev = VirtualDevice(self.device.make_runner(self.device.num_blocks), self.config.block_size)
        speculative = (SpeculativeConfig(method="ngram", num_tokens=self.config.spec_num_tokens)
                       if self.config.spec_num_tokens else None)
        engine = Engine(self.scheduler_config, self.cache_config, dev, self.device.vocab_size,  # dev.kv_layout: its groups
                        speculative=speculative)
        use_sim_drafts(engine)  # speculation: drafts accepted at the workload's rate (worker/sim/spec.py)
        # The engine times out unacknowledged KV exports on the WALL clock; here every export
        # is released explicitly when its transfer completes, so a timeout could only make
        # the run depend on how fast this machine is.
        engine.connector.pin_timeout_s = float("inf")
        if self.config.tiers.enabled:  # refused for a shape with sliding-window layers (Engine.use_tiers)
            engine.use_tiers(self._tiers(dev))  # type: ignore[arg-type]
        replica = SimReplica(self._next_key, role, engine, dev, self.clock, self.orchestrator.on_output)
        lora = self.config.lora
        if lora is not None:
            shape, link = self.device.shape, self.device.host_to_device_bytes_per_s
            if shape is None or link is None:
                raise ValueError("simulating LoRA adapters needs the device's model shape and host link")
            dev.lora_swap_s = lora.swap_s(shape, link)
            enable_sim_lora(engine, lora, self.clock, lora.cold_load_s(shape), replica.wake)
        if self.config.max_report_hashes is not None:
            replica.max_report_hashes = self.config.max_report_hashes
        self._next_key += 1
        self.replicas.append(replica)
        return replica

    @property
    def block_bytes(self) -> int:
        return self.device.kv_bytes_per_token * self.config.block_size

    def _shared_store(self) -> SharedStore | None:
        tiers = self.config.tiers
        if not tiers.shared_bytes:
            return None
        return SharedStore(tiers.shared_bytes // self.block_bytes, tiers.shared_bandwidth, self.block_bytes)

    def _tiers(self, dev: VirtualDevice) -> SimTierManager:
        """One replica's tiers: the real host tier (its LRU over stand-in blocks: the
        VirtualDevice's KV is bookkeeping only), a disk, the simulation's shared store."""
        options, device, block_bytes = self.config.tiers, self.device, self.block_bytes
        host = HostTier(dev.kv_spec, options.host_bytes // block_bytes)
        disk = BlockLRU(options.disk_bytes // block_bytes) if options.disk_bytes else None
        return SimTierManager(dev, self.clock, host, block_bytes, device.host_link_bandwidth, disk,
                              device.disk_read_bandwidth, self.shared_store)

    def bring_up(self, replica: SimReplica) -> None:
        """The replica is ready: routers may choose it, and it starts reporting (each
        replica on its own seeded phase within the period, as independent timers are)."""
        replica.ready_at = self.clock.now
        self.pools[replica.role].replicas[replica.key] = replica
        self.count_live()
        self.clock.after(self.rng.uniform(0.0, self.config.stats_period_s), self._report, replica)
        self.pools[replica.role].slot_freed()

    def remove(self, replica: SimReplica) -> None:
        replica.removed_at = self.clock.now
        self.pools[replica.role].replicas.pop(replica.key, None)
        for router in self.routers:
            router.forget(replica.key)
        self.kv_index.forget({key for pool in self.pools.values() for key in pool.replicas})
        self.count_live()

    def count_live(self) -> None:
        entry = (self.clock.now, sum(len(p.live()) for p in self.pools.values()))
        if self.replica_count and self.replica_count[-1][0] == entry[0]:
            self.replica_count[-1] = entry  # several changes at one instant: keep the last
        else:
            self.replica_count.append(entry)

    def _report(self, replica: SimReplica) -> None:
        if replica.removed_at is not None:
            return
        self._check_stall()
        replica.sample_timeline()
        stats = replica.routing_stats()
        self.clock.after(self.config.report_lag_s, self._deliver_report, replica, stats)
        self.clock.after(self.config.stats_period_s, self._report, replica)

    def _check_stall(self) -> None:
        """Reports are periodic, so the clock never runs dry: a run where nothing can move
        any more (requests queued at routers whose policy offers no replica) would spin
        forever. Fail loudly instead."""
        # Only requests that have arrived count: a trace may be idle for hours between them.
        if self.clock.now - self.last_progress_s > STALL_TIMEOUT_S and self.orchestrator.flights:
            queued = sum(r.num_queued for r in self.routers)
            raise RuntimeError(
                f"the simulation stalled: no token and no dispatch for {STALL_TIMEOUT_S:g} virtual seconds at "
                f"t={self.clock.now:.1f} s with {len(self.orchestrator.flights)} arrived requests unfinished "
                f"({queued} queued at routers; does the {self.config.router!r} policy rank no replica?)")

    def _deliver_report(self, replica: SimReplica, stats: dict[str, Any]) -> None:
        if replica.removed_at is not None:
            return
        report = ReplicaReport.from_stats(stats)
        assert report is not None
        report = self.kv_index.indexed(replica.key, stats, report)
        if not self.config.tiers.route_on_tiers:  # a tier-blind router: device-resident blocks only
            report = replace(report, host_prefix_hashes=frozenset(), disk_prefix_hashes=frozenset())
        for router in self.routers:
            router.receive_report(replica.role, replica.key, report)

    # -- requests --------------------------------------------------------------------------------
    def _router_for(self, index: int, request: SimRequest) -> SimRouter:
        k = len(self.routers)
        if self.config.ingress_assignment == "session" and request.session_id is not None:
            return self.routers[zlib.crc32(request.session_id.encode()) % k]
        return self.routers[index % k]

    def _arrive(self, index: int, request: SimRequest) -> None:
        self.orchestrator.start(Flight(request, self._router_for(index, request)))

    def done(self) -> bool:
        return self.tracker.num_done >= self._num_requests

    def missed_slo(self) -> bool:
        return self.tracker.num_late >= self._late_limit

    def _dispatch_latencies(self, n: int) -> list[float]:
        samples = self.config.dispatch_latency_samples
        if not samples:
            return [self.config.dispatch_latency_s] * n
        rng = random.Random(self.config.seed * 7919 + 17)  # its own stream: the policies' draws stay as they were
        return [rng.choice(samples) for _ in range(n)]

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        self.start(requests)
        if requests:
            self.clock.run(stop=lambda: self.done() or self.missed_slo())
        return self.result()

    def start(self, requests: Sequence[SimRequest]) -> None:
        """The replicas, scalers and arrivals on the clock; `run` (or a fleet) runs it."""
        self._num_requests = len(requests)
        num_measured = sum(1 for r in requests if not r.warmup)
        self._late_limit = late_requests_proving_p99_miss(num_measured) if self.config.stop_at_slo_miss else math.inf
        for role, pool in self.pools.items():
            n = self.config.disagg.num_replicas(role) if self.config.disagg.enabled else self.config.num_replicas
            for _ in range(n):
                self.bring_up(self.new_replica(role))
        if self.config.autoscale is not None:
            for pool in self.pools.values():
                self.autoscalers.append(SimAutoscaler(self, pool, self.config.autoscale))
        if self.config.planner is not None:
            self.planner = SimPlanner(self, self.config.planner)
        for i, (request, latency) in enumerate(zip(requests, self._dispatch_latencies(len(requests)))):
            if not self.follow_ups.hold(i, request, latency):
                self.clock.at(request.arrival_s + latency, self._arrive, i, request)

    def result(self) -> SimResult:
        return SimResult(
            config=self.config,
            records=list(self.tracker.records.values()),
            replicas=self.replicas,
            itl=self.tracker.itl,
            num_events=self.clock.num_events,
            router_stats=[r.stats() for r in self.routers],
            replica_count=self.replica_count,
            stopped_at_slo_miss=not self.done() and self.missed_slo(),
        )


def _make_policy(config: SimConfig, params: RoutingParams, seed: int, view: RoutingView | None) -> Any:
    """The router's policy object (router.routing.policies.make_policy); with a shared view, the
    view-reading policy is built on its pool's view instead of a private one."""
    if view is None:
        from router.routing.policies import make_policy

        return make_policy(config.router, params, seed=seed, **dict(config.policy_options))
    from router.routing.policies.headroom import HeadroomPolicy

    check_options(config.router, dict(config.policy_options), ())
    return HeadroomPolicy(params, seed, view=view)


def simulate(config: SimConfig, requests: Sequence[SimRequest], device: SimDevice | None = None) -> SimResult:
    """Run one simulation. `device` defaults to the shape and profile the config names."""
    return Simulation(config, device or SimDevice.from_config(config)).run(requests)
