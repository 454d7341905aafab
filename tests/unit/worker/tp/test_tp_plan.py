"""The tensor-parallel plan encoding (rank 0 -> other ranks) and the TP config wiring."""
from __future__ import annotations

from kv.cache_manager import KVCacheManager
from worker.config import SchedulerConfig
from worker.api import SamplingParams
from worker.scheduling.scheduler import Scheduler
from worker.sequence import Sequence
from worker.tp.plan_codec import PlanDecoder, PlanEncoder, stop_message


def test_plans_round_trip_as_diffs_through_preemption_and_finish() -> None:
    """Drive a real scheduler (tiny pool: preemption; small budget: chunks; a shared
    prefix: cache hits); every decoded plan equals the original, running requests cost a
    few ints, and finished requests are forgotten on both sides."""
    kv = KVCacheManager(10, 4, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64), kv)
    prefix = list(range(3, 11))
    for i, n in enumerate([9, 5, 3, 6]):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        scheduler.add(Sequence(str(i), prefix + [20 + i] * n, params))
    encoder, decoder = PlanEncoder(), PlanDecoder()
    num_preempted = step = 0
    sizes = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        num_preempted += len(plan.preempted)
        if plan.is_empty:
            continue
        payload = encoder.encode(plan)
        sizes.append(payload.numel())
        got = decoder.decode(payload)
        assert got is not None and got.num_new_tokens == plan.num_new_tokens
        for mirror, seq, block_ids, got_blocks in zip(got.seqs, plan.seqs, plan.block_ids, got.block_ids):
            assert mirror.token_ids == seq.token_ids
            assert mirror.num_computed_tokens == seq.num_computed_tokens
            assert got_blocks == block_ids
        scheduler.update(plan, [100 + step if plan.samples(i) else None for i in range(len(plan.seqs))])
        step += 1
    assert num_preempted > 0
    decoder.decode(encoder.encode(scheduler.schedule()))  # the empty plan drops the last ones
    assert encoder.num_known == 0 and decoder.mirror == {}
    assert min(sizes) <= 4 + 2 * (8 + 2)  # decode-only steps: a few ints per request
    assert decoder.decode(stop_message()) is None


def test_lora_slots_and_loads_round_trip() -> None:
    """Each row's adapter slot travels with it, and the slot writes with the adapter's
    name (any UTF-8), so every rank applies the same adapter to the same rows."""
    from worker.lora.slots import LoRASlots

    kv = KVCacheManager(16, 4, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    scheduler.lora_slots = LoRASlots(2)
    for i, name in enumerate(["sql", None, "maths-\u00e9\u6f22", "sql"]):
        seq = Sequence(str(i), [5 + i] * 6, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        seq.lora_name = name
        scheduler.add(seq)
    encoder, decoder = PlanEncoder(), PlanDecoder()
    plan = scheduler.schedule()
    got = decoder.decode(encoder.encode(plan))
    assert plan.lora_loads == [(0, "sql"), (1, "maths-\u00e9\u6f22")] and got.lora_loads == plan.lora_loads
    assert [m.lora_slot for m in got.seqs] == [s.lora_slot for s in plan.seqs] == [0, -1, 1, 0]
    scheduler.update(plan, [100] * len(plan.seqs))
    plan = scheduler.schedule()  # decodes: the slots stay, nothing to write
    got = decoder.decode(encoder.encode(plan))
    assert got.lora_loads == [] and [m.lora_slot for m in got.seqs] == [0, -1, 1, 0]


def test_worker_options_place_tp_ranks_together() -> None:
    from cluster.app import worker_options
    from cluster.config import KVServeConfig

    config = KVServeConfig.from_dict(
        {"model": {"path": "/models/x"}, "engine": {"device": "cpu"}, "workers": {"tensor_parallel_size": 2}}
    )
    assert config.engine_config().model.tensor_parallel_size == 2
    options = worker_options(config)
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    gpu = KVServeConfig.from_dict(
        {"model": {"path": "/models/x"}, "engine": {"device": "cuda"}, "workers": {"tensor_parallel_size": 4}}
    )
    assert worker_options(gpu)["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 4
