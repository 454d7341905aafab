"""LoRA adapters in the simulator (cluster/sim/lora.py): the adapter's size, the load
timing on the virtual clock (a cold load on the replica's one loader, the slot copy in the
step that admits it), the engine's own LRU of slots and of host memory, and the residency
the replica reports to the routers."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.sim.clock import EventQueue
from cluster.sim.lora import SimLoRA, VirtualLoader, lora_adapter_bytes
from cluster.sim.run import Simulation, simulate
from cluster.sim.setup import SimConfig, SimDevice
from cluster.workload.sim_kinds import SimRequest
from worker.config import LoRAConfig
from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape

SHAPE = load_shape("llama-3-8b")
H200 = load_profile("h200")
LORA = SimLoRA(LoRAConfig(enable=True, max_loras=2, max_cpu_loras=2))
COLD_S = LORA.cold_load_s(SHAPE)
SWAP_S = LORA.swap_s(SHAPE, H200.host_link_bandwidth)


def _request(i: int, t: float, lora: str | None) -> SimRequest:
    return SimRequest(f"r{i}", t, tuple(range(1 + 1000 * i, 1 + 1000 * i + 64)), 4, lora_name=lora)


def test_a_rank_16_llama_3_8b_adapter_on_all_seven_projections() -> None:
    # Per layer, rank x (in + out) per projection: q, o 4096+4096; k, v 4096+1024;
    # gate, up, down 4096+14336. 32 layers, bf16.
    per_layer = 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)
    assert lora_adapter_bytes(SHAPE, 16) == per_layer * 32 * 2 == 83_886_080
    assert COLD_S == pytest.approx(83_886_080 / LORA.storage_bytes_per_s)
    # The H200's PCIe Gen5 x16, one direction: 32 GT/s x 16 lanes x 128b/130b.
    assert SWAP_S == pytest.approx(83_886_080 / (32e9 * 16 * 128 / 130 / 8))


def test_the_loader_runs_one_load_at_a_time_in_order() -> None:
    clock = EventQueue()
    done: list[float] = []
    loader = VirtualLoader(clock, 0.5, lambda: done.append(clock.now))
    first, second = loader.submit(str, "a"), loader.submit(str, "b")
    clock.at(3.0, lambda: done.append(-1.0))
    clock.at(3.0, lambda: loader.submit(str, "c"))
    clock.run()
    assert done == [0.5, 1.0, -1.0, 3.5]  # queued behind the first; an idle loader starts at once
    assert (first.result(), second.result()) == ("a", "b")


def test_a_cold_adapter_adds_exactly_its_load_and_slot_copy_to_the_ttft() -> None:
    base = simulate(SimConfig(num_replicas=1), [_request(0, 0.0, None)]).records[0].ttft_s
    run = simulate(SimConfig(num_replicas=1, lora=LORA), [_request(0, 0.0, "a")])
    assert run.records[0].ttft_s == pytest.approx(base + COLD_S + SWAP_S, rel=1e-9)
    assert run.summary()["lora_cold_loads"] == run.summary()["lora_slot_loads"] == 1


def test_slots_and_host_memory_evict_the_least_recently_used_adapter() -> None:
    # One at a time, each finished before the next: a, b, a again (resident), c (evicts
    # b: released before a's second request), then b (storage again: host memory held a, c).
    order = ["a", "b", "a", "c", "b"]
    sim = Simulation(SimConfig(num_replicas=1, lora=LORA), SimDevice.from_config(SimConfig()))
    result = sim.run([_request(i, 10.0 * i, name) for i, name in enumerate(order)])
    base = simulate(SimConfig(num_replicas=1), [_request(0, 0.0, None)]).records[0].ttft_s
    extra = [round(r.ttft_s - base, 9) for r in sorted(result.records, key=lambda r: r.arrival_s)]
    cold = round(COLD_S + SWAP_S, 9)
    assert extra == [cold, cold, 0.0, cold, cold]
    lora = sim.replicas[0].engine.lora
    assert lora.slots.resident == ["b", "c"]  # b took a's slot 0; c took b's slot 1
    assert lora.registry.host_resident == ["c", "b"]
    assert (lora.slots.num_loads, lora.registry.num_host_loads) == (4, 4)


def test_a_request_waits_for_a_slot_while_the_others_keep_stepping() -> None:
    # Two slots, both held by long requests: a third adapter waits until one finishes,
    # and the loads of the first two overlap nothing but each other.
    long = [replace(_request(i, 0.0, name), max_tokens=50) for i, name in enumerate("ab")]
    third = _request(2, 0.0, "c")
    result = simulate(SimConfig(num_replicas=1, lora=LORA), long + [third])
    recs = {r.request_id: r for r in result.records}
    assert recs["r2"].first_token_s >= min(recs["r0"].finish_s, recs["r1"].finish_s)
    assert recs["r0"].first_token_s < recs["r1"].first_token_s < recs["r0"].finish_s


def test_the_replica_reports_its_adapters_as_a_real_worker_does() -> None:
    sim = Simulation(SimConfig(num_replicas=1, lora=LORA), SimDevice.from_config(SimConfig()))
    sim.run([replace(_request(0, 0.0, "a"), max_tokens=200), _request(1, 0.0, "b")])
    stats = sim.replicas[0].routing_stats()
    assert stats["lora_resident"] == ("a", "b") and stats["max_loras"] == 2
    assert stats["lora_active"] == () and set(stats["lora_loaded"]) == {"a", "b"}


def test_lora_with_disaggregated_pools_is_refused() -> None:
    from cluster.sim.disagg import DisaggOptions

    with pytest.raises(ValueError, match="disaggregated"):
        SimConfig(lora=LORA, disagg=DisaggOptions(prefill_replicas=1, decode_replicas=1))


def test_simulate_cli_serves_the_lora_workload_behind_lora_affinity(capsys) -> None:
    import json

    from cluster.cli import main

    assert main(["simulate", "--workload", "lora", "--router", "lora_affinity", "--max-loras", "2",
                 "--max-cpu-loras", "4", "--requests", "20", "--rate", "5", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_finished"] == 20 and 0 < summary["lora_slot_loads"] and 0 < summary["lora_cold_loads"]
    assert main(["simulate", "--workload", "lora", "--max-loras", "2", "--max-cpu-loras", "1"]) == 2
    assert "max_cpu_loras" in capsys.readouterr().err
