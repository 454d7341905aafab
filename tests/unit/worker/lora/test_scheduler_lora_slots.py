"""The scheduler and LoRA device slots: a request whose adapter finds every slot serving
running sequences waits without holding up those that need no new slot, and gets the
first slot that frees."""
from __future__ import annotations

from kv.cache_manager import KVCacheManager
from worker.api import SamplingParams
from worker.config import SchedulerConfig
from worker.lora.slots import LoRASlots
from worker.scheduling.scheduler import Scheduler
from worker.sequence import Sequence


def _seq(request_id: str, lora_name: str | None, max_tokens: int) -> Sequence:
    seq = Sequence(request_id, [7] * 4, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    seq.lora_name = lora_name
    return seq


def _step(scheduler: Scheduler) -> list[str]:
    plan = scheduler.schedule()
    scheduler.update(plan, [100] * len(plan.seqs))
    return [s.request_id for s in plan.seqs]


def test_a_request_waiting_for_a_slot_is_passed_only_by_those_needing_none() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          KVCacheManager(32, 4, True))
    scheduler.lora_slots = LoRASlots(1)
    scheduler.add(_seq("a1", "a", max_tokens=3))  # holds the one slot for 3 steps
    assert _step(scheduler) == ["a1"]
    for seq in (_seq("b1", "b", 2), _seq("base", None, 1), _seq("a2", "a", 1), _seq("c1", "c", 1)):
        scheduler.add(seq)
    # b1 and c1 wait for the slot; the base model and adapter a (resident) pass them.
    assert _step(scheduler) == ["a1", "base", "a2"]
    assert [s.request_id for s in scheduler.waiting] == ["b1", "c1"]
    assert _step(scheduler) == ["a1"]  # a1's last token: the slot is still held this step
    # The slot freed: it goes to b1, first in order; c1 waits on.
    assert _step(scheduler) == ["b1"]
    assert scheduler.lora_slots.active == ["b"] and [s.request_id for s in scheduler.waiting] == ["c1"]
    assert _step(scheduler) == ["b1"]
    assert _step(scheduler) == ["c1"]
