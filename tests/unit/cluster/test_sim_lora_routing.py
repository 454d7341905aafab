"""Headroom routing of a LoRA fleet on the simulator (real engines, adapter slots and
router): a hot adapter stays on one replica while that replica keeps up, spreads over the
fleet as its load grows, and is not swapped in and out of slots on every request."""
from __future__ import annotations

from collections import Counter

from cluster.sim.lora import SimLoRA
from cluster.sim.run import simulate
from cluster.sim.setup import SimConfig
from cluster.workload.sim_kinds import lora_adapter_name, make_workload
from worker.config import LoRAConfig

LORA = SimLoRA(LoRAConfig(enable=True, max_loras=2, max_cpu_loras=4))
HOT = lora_adapter_name(0)


def _run(router: str, n: int, rate: float) -> tuple[Counter[int], int]:
    """(hot adapter's requests per replica, slot loads) of one run: 6 adapters, Zipf 2
    (the hottest ~70% of the requests), 4 replicas of 2 slots each."""
    reqs = make_workload("lora", n, rate, 0, num_adapters=6, zipf_s=2.0, input_mean=100, output_mean=50)
    hot_ids = {r.request_id for r in reqs if r.lora_name == HOT}
    result = simulate(SimConfig(num_replicas=4, router=router, lora=LORA), reqs)
    assert all(r.error is None and r.finish_s is not None for r in result.records)
    hot = Counter(r.replica_keys[0] for r in result.records if r.request_id in hot_ids)
    return hot, result.summary()["lora_slot_loads"]


def test_a_hot_adapter_stays_put_while_one_replica_keeps_up() -> None:
    hot, _ = _run("headroom", 150, 2.0)
    assert len(hot) == 1


def test_a_hot_adapter_spreads_as_its_load_grows_without_thrashing_slots() -> None:
    hot, loads = _run("headroom", 300, 60.0)
    assert len(hot) == 4 and max(hot.values()) < 0.5 * sum(hot.values())
    _, rr_loads = _run("round_robin", 300, 60.0)
    assert loads < 0.5 * rr_loads  # round robin brings every adapter to every replica
    assert loads < 0.2 * 300
