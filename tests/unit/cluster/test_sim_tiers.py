"""KV tiers in the discrete-event simulator (cluster/sim/tiers.py): exact copy times from
bytes and bandwidths, demotion down the tiers, capacity eviction, the shared store across
replicas, and a run past the device KV where tiers beat the device alone."""
from __future__ import annotations

import statistics

import pytest

from cluster.sim.run import Simulation, simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.sim.tiers import SimTierManager, SimTierOptions
from cluster.workload.sim_kinds import SimRequest, make_workload
from worker.api import SamplingParams
from worker.scheduling.scheduler import TierLoad
from worker.sequence import Sequence, SequenceStatus
from worker.costs.cost_model import SeqWork, StepCostModel
from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape

PROFILE = load_profile("h200")
COST = StepCostModel(load_shape("llama-3-8b"), PROFILE)
BLOCK_BYTES = load_shape("llama-3-8b").kv_bytes_per_token() * 16
HOST_BW = PROFILE.effective_host_link_bandwidth
DISK_BW = PROFILE.effective_disk_read_bandwidth


def _tiers(host: int, disk: int = 0, shared: int = 0, shared_bw: float = 0.0,
           num_replicas: int = 1) -> tuple[Simulation, list[SimTierManager]]:
    """Replicas of a simulation with tiers of `host` / `disk` / `shared` blocks."""
    options = SimTierOptions(host * BLOCK_BYTES, disk * BLOCK_BYTES, shared * BLOCK_BYTES, shared_bw)
    sim = Simulation(SimConfig(num_replicas=num_replicas, num_blocks=64, tiers=options),
                     SimDevice.from_config(SimConfig(num_blocks=64)))
    return sim, [sim.new_replica("mixed").tiers for _ in range(num_replicas)]  # type: ignore[misc]


def _loading_seq() -> Sequence:
    seq = Sequence("load", list(range(1, 100)), SamplingParams(max_tokens=1))
    seq.status = SequenceStatus.LOADING
    return seq


def test_profiles_carry_the_h200_links() -> None:
    assert PROFILE.host_link_bandwidth == pytest.approx(32e9 * 16 * 128 / 130 / 8)  # PCIe Gen5 x16
    assert PROFILE.disk_read_bandwidth == 6.9e9
    assert HOST_BW == pytest.approx(0.8 * PROFILE.host_link_bandwidth)


def test_evicted_blocks_move_down_host_then_disk_least_recent_first() -> None:
    _, (tiers,) = _tiers(host=2, disk=2)
    evicted = [(11, 0), (12, 1)]
    tiers.offload(evicted)
    assert evicted == [] and tiers.host.hashes() == [11, 12] and tiers.disk.hashes() == []
    tiers.offload([(13, 2)])  # the host tier is full: its least recent block goes to disk
    assert tiers.host.hashes() == [12, 13] and tiers.disk.hashes() == [11]
    tiers.offload([(12, 3), (14, 4), (15, 5)])  # 12 is held: not copied again
    assert tiers.host.hashes() == [14, 15]
    assert tiers.disk.hashes() == [12, 13]  # disk full: 11, the oldest, dropped
    assert tiers.num_offloaded_blocks == 5
    # Copies device -> host: 5 blocks over the host link, carried by the planning step.
    assert tiers.take_copy_s() == pytest.approx(5 * BLOCK_BYTES / HOST_BW, rel=1e-12)
    assert tiers.take_copy_s() == 0.0
    assert tiers.num_available([14, 15, 13, 12, 11]) == 4  # 11 is nowhere: the chain ends
    assert tiers.routing_hashes(8) == ([15, 14], [13, 12])


def test_a_load_takes_bytes_over_bandwidth_on_each_queue_beside_the_steps() -> None:
    sim, (tiers,) = _tiers(host=4, disk=8)
    tiers.offload([(h, h) for h in range(1, 9)])  # 1-4 pushed to disk, 5-8 on the host
    tiers.take_copy_s()
    seq = _loading_seq()
    tiers.start_loads([TierLoad(seq, [5, 6, 1, 2, 3], [10, 11, 12, 13, 14])])
    # All 5 cross the host link; the 3 disk blocks also take the disk's read: the later ends it.
    done = max(5 * BLOCK_BYTES / HOST_BW, 3 * BLOCK_BYTES / DISK_BW)
    assert tiers.next_load_done_s == pytest.approx(done, rel=1e-12)
    assert tiers.poll() == []  # nothing is done before its time
    second = _loading_seq()
    tiers.start_loads([TierLoad(second, [7], [15])])  # queued behind the first on the host link
    host_free = 6 * BLOCK_BYTES / HOST_BW
    assert host_free < done and tiers.next_load_done_s == pytest.approx(host_free, rel=1e-12)
    sim.clock.at(host_free, lambda: None)
    sim.clock.run()
    assert tiers.poll() == [(second, 1)]  # the host-only load ends first
    sim.clock.at(done, lambda: None)
    sim.clock.run()
    assert tiers.poll() == [(seq, 5)] and not tiers.has_pending
    assert tiers.disk.hashes() == [4, 1, 2, 3]  # the disk reads refreshed 1-3  # type: ignore[union-attr]
    assert (tiers.num_loaded_blocks, tiers.num_disk_loaded_blocks) == (6, 3)


def test_another_replica_loads_what_one_published_once_the_write_has_landed() -> None:
    store_bw = 2e9
    sim, (a, b) = _tiers(host=4, shared=16, shared_bw=store_bw, num_replicas=2)
    a.publish([(21, 0), (22, 1), (23, 2)])
    written = 3 * BLOCK_BYTES / store_bw
    assert a.take_copy_s() == pytest.approx(3 * BLOCK_BYTES / HOST_BW, rel=1e-12)
    assert b.num_available([21, 22, 23]) == 0  # the write is in flight
    sim.clock.at(written, lambda: None)
    sim.clock.run()
    assert b.num_available([21, 22, 23, 24]) == 3
    seq = _loading_seq()
    b.start_loads([TierLoad(seq, [21, 22], [0, 1])])
    assert b.next_load_done_s == pytest.approx(written + 2 * BLOCK_BYTES / store_bw, rel=1e-12)
    assert b.num_shared_loaded_blocks == 2 and a.num_published_blocks == 3


def test_tier_options_are_checked() -> None:
    with pytest.raises(ValueError, match="needs a host tier"):
        SimTierOptions(disk_bytes=1)
    with pytest.raises(ValueError, match="bandwidth"):
        SimTierOptions(host_bytes=1, shared_bytes=1)
    with pytest.raises(ValueError, match="disk"):  # the profile models no disk
        Simulation(SimConfig(profile="cpu-calibrated", num_blocks=64,
                             tiers=SimTierOptions(host_bytes=BLOCK_BYTES, disk_bytes=BLOCK_BYTES)),
                   SimDevice.from_config(SimConfig(profile="cpu-calibrated", num_blocks=64)))


def test_a_reload_waits_for_its_copy_then_computes_only_the_rest() -> None:
    """One replica, 28 device blocks. r0 caches 12 blocks; fillers f1, f2 (20 blocks each)
    push them to the host tier; r2 repeats r0's 12 blocks: it loads them (12 blocks over
    the host link, beside the copy of the 12 fillers' blocks its own allocation evicted),
    then prefills 50 tokens, evicting 4 more (copied before that step)."""
    p0 = tuple(range(1, 193))
    requests = [SimRequest("r0", 0.0, p0, 1), SimRequest("f1", 1.0, tuple(range(1000, 1320)), 1),
                SimRequest("f2", 1.5, tuple(range(2000, 2320)), 1),
                SimRequest("r2", 2.0, p0 + tuple(range(5000, 5050)), 1)]
    config = SimConfig(num_replicas=1, num_blocks=28, tiers=SimTierOptions(host_bytes=64 * BLOCK_BYTES))
    result = simulate(config, requests)
    rec = {r.request_id: r for r in result.records}["r2"]
    copy = BLOCK_BYTES / HOST_BW
    assert rec.num_cached_tokens == 192
    assert rec.ttft_s == pytest.approx(12 * copy + COST.step_time_s([SeqWork(50, 192)]) + 4 * copy, rel=1e-9)
    tiers = result.replicas[0].tiers
    assert tiers is not None and tiers.num_loaded_blocks == 12
    assert tiers.num_offloaded_blocks == 4 + (8 + 12) + 12 + 4  # f1, f2, r2 loading, r2 running


def test_tiers_beat_the_device_alone_past_its_kv() -> None:
    """12 groups of 512-token prefixes (384 blocks) on a 160-block device: alone it
    recomputes most prefixes; with a host tier it reloads them."""
    requests = make_workload("b2b", 160, 12.0, seed=3, num_groups=12, prefix_len=512, question_len=64,
                             output_len=16)
    base = SimConfig(num_replicas=1, num_blocks=160, max_num_batched_tokens=512)
    alone = simulate(base, requests).summary()
    tiered = simulate(SimConfig(num_replicas=1, num_blocks=160, max_num_batched_tokens=512,
                                tiers=SimTierOptions(host_bytes=512 * BLOCK_BYTES)), requests)
    summary = tiered.summary()
    assert summary["num_finished"] == alone["num_finished"] == 160
    assert summary["prefix_cache_hit_rate"] > alone["prefix_cache_hit_rate"] + 0.3
    assert summary["ttft_s"]["p50"] < 0.6 * alone["ttft_s"]["p50"]
    assert tiered.replicas[0].tiers.num_loaded_blocks > 0  # type: ignore[union-attr]
    assert statistics.mean(r.busy_s for r in tiered.replicas) < alone["replicas"][0]["busy_s"]


def test_a_replica_reports_its_tiers_up_to_the_report_cap() -> None:
    options = SimTierOptions(host_bytes=8 * BLOCK_BYTES)
    for cap, expected in ((None, [33, 32, 31]), (2, [33, 32])):
        sim = Simulation(SimConfig(num_replicas=1, num_blocks=64, tiers=options, max_report_hashes=cap),
                         SimDevice.from_config(SimConfig(num_blocks=64)))
        replica = sim.new_replica("mixed")
        replica.tiers.offload([(31, 0), (32, 1), (33, 2)])  # type: ignore[union-attr]
        stats = replica.routing_stats()
        assert stats["host_prefix_hashes"] == expected and stats["disk_prefix_hashes"] == []
