"""KV events from simulated replicas (cluster/sim/replica.py, cluster/sim/tiers.py) keep the
router's index (router/routing/kv_index.py) exact per tier, and a tier-aware router behind
several ingress routers beats a tier-blind one in a small simulated run."""
from __future__ import annotations

from dataclasses import replace

from cluster.sim.replica import SimReplica
from cluster.sim.run import Simulation, simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.sim.tiers import SimTierOptions
from cluster.workload.sim_kinds import make_workload
from kv.block_hash import hash_full_blocks
from kv.kv_events import DEVICE, DISK, HOST
from router.routing.kv_index import APPLIED, REBUILT, KVIndex
from router.routing.types import ReplicaReport
from worker.api import SamplingParams
from worker.costs.shapes import load_shape

BLOCK_BYTES = load_shape("llama-3-8b").kv_bytes_per_token() * 16


def _replica(num_blocks: int, host_blocks: int, disk_blocks: int) -> tuple[Simulation, SimReplica]:
    options = SimTierOptions(host_bytes=host_blocks * BLOCK_BYTES, disk_bytes=disk_blocks * BLOCK_BYTES)
    config = SimConfig(num_replicas=1, num_blocks=num_blocks, tiers=options)
    sim = Simulation(config, SimDevice.from_config(config))
    replica = sim.new_replica("mixed")
    # An empty snapshot: a rebuild would lose every block, so exactness below is the events'.
    replica.max_report_hashes = 0
    return sim, replica


def _run(sim: Simulation, replica: SimReplica, request_id: str, prompt: range) -> None:
    assert replica.submit(request_id, list(prompt), SamplingParams(max_tokens=1, ignore_eos=True)) is None
    sim.clock.run()


def _truth(replica: SimReplica) -> dict[str, set[int]]:
    tiers = replica.tiers
    assert tiers is not None and tiers.disk is not None
    return {DEVICE: set(replica.engine.kv.pool.cached), HOST: set(tiers.host.hashes()), DISK: set(tiers.disk.hashes())}


def test_a_simulated_replicas_events_keep_the_index_exact_per_tier() -> None:
    """28 device blocks, a host tier of 16, a disk of 16. p0 (12 blocks) is cached; two
    fillers push it to the host tier and the host's oldest on to disk; p0 again reloads
    from both; two more fillers make the disk drop its oldest; then a prefix-cache reset
    empties every tier. After each, one report brings the index level with the replica
    through events alone."""
    sim, replica = _replica(num_blocks=28, host_blocks=16, disk_blocks=16)
    tiers = replica.tiers
    assert tiers is not None and tiers.disk is not None
    index = KVIndex()

    def report() -> dict[str, set[int]]:
        held = index.apply(replica.key, replica.routing_stats())
        assert held is not None
        return {DEVICE: set(held.device), HOST: set(held.host), DISK: set(held.disk)}

    def filler(i: int) -> None:  # 20 blocks of fresh tokens
        _run(sim, replica, f"f{i}", range(1000 * (i + 1), 1000 * (i + 1) + 320))
        assert report() == _truth(replica)

    assert report() == {DEVICE: set(), HOST: set(), DISK: set()}  # the first report: a rebuild
    p0 = range(1, 193)
    _run(sim, replica, "r0", p0)
    p0_hashes = set(hash_full_blocks(list(p0), 16))
    assert report() == _truth(replica) and _truth(replica)[DEVICE] == p0_hashes
    filler(0)
    filler(1)
    truth = _truth(replica)
    assert not p0_hashes & truth[DEVICE] and p0_hashes & truth[HOST] and p0_hashes & truth[DISK]
    _run(sim, replica, "r1", range(1, 193 + 40))  # p0 again, 40 more tokens: loaded
    assert tiers.num_disk_loaded_blocks > 0
    assert report() == _truth(replica) and p0_hashes & _truth(replica)[DEVICE]
    on_disk = set(tiers.disk.hashes())
    filler(2)
    filler(3)
    assert len(tiers.disk) == 16 and on_disk - set(tiers.disk.hashes())  # it dropped some
    replica.engine.reset_prefix_cache()
    assert report() == _truth(replica) == {DEVICE: set(), HOST: set(), DISK: set()}
    assert index.num_reports[REBUILT] == 1 and index.num_reports[APPLIED] == 7 and index.num_gaps == 0


def test_delivered_reports_carry_the_exact_index_to_the_routers() -> None:
    """The simulation applies each delivered report to its index and hands the routers the
    index's sets (kv_exact); a tier-blind router's report drops the tiers' sets."""
    config = SimConfig(num_replicas=1, num_blocks=28, tiers=SimTierOptions(host_bytes=16 * BLOCK_BYTES))
    for route_on_tiers in (True, False):
        config = replace(config, tiers=replace(config.tiers, route_on_tiers=route_on_tiers))
        sim = Simulation(config, SimDevice.from_config(config))
        replica = sim.new_replica("mixed")
        sim.bring_up(replica)
        assert replica.submit("r0", list(range(1, 193)), SamplingParams(max_tokens=1, ignore_eos=True)) is None
        assert replica.submit("f0", list(range(1000, 1320)), SamplingParams(max_tokens=1, ignore_eos=True)) is None
        sim.clock.run(until=3 * config.stats_period_s)
        report = sim.routers[0].reports[replica.key]
        assert isinstance(report, ReplicaReport) and report.kv_exact
        held = sim.kv_index.get(replica.key)
        assert held is not None and held.host  # the filler pushed r0's blocks down
        assert report.prefix_hashes == held.device
        assert report.host_prefix_hashes == (held.host if route_on_tiers else frozenset())


def test_tier_aware_routing_beats_tier_blind_behind_several_routers() -> None:
    """2 replicas of 128 device blocks, 64 groups whose 512-token prefixes fill 8x the
    cluster's device KV, host tiers that hold them all; 4 ingress routers, each knowing
    only its own dispatches. A tier-blind router sends a group whose prefix left the device
    to either replica (unless it sent that group itself); a tier-aware one to the replica
    whose host tier holds it, which loads it instead of prefilling it again."""
    kw = {"num_groups": 64, "prefix_len": 512, "question_len": 64, "output_len": 16, "sessions": False,
          "warmup_s": 4.0, "warmup_max_tokens": 1}
    requests = make_workload("b2b", 320, 16.0, seed=1, **kw)
    base = SimConfig(num_replicas=2, router="headroom", num_ingress=4, num_blocks=128,
                     tiers=SimTierOptions(host_bytes=64 * 32 * BLOCK_BYTES))
    device = SimDevice.from_config(base)
    aware = simulate(base, requests, device)
    blind = simulate(replace(base, tiers=replace(base.tiers, route_on_tiers=False)), requests, device)
    a, b = aware.summary(), blind.summary()
    assert a["num_finished"] == b["num_finished"] == 320
    assert a["prefix_cache_hit_rate"] > b["prefix_cache_hit_rate"] + 0.1
    assert a["num_tier_loaded_blocks"] > b["num_tier_loaded_blocks"]
    assert sum(r.busy_s for r in aware.replicas) < sum(r.busy_s for r in blind.replicas)  # less prefill
