"""LoRA adapters on a simulated device: the engine's own multi-LoRA bookkeeping (registry,
host LRU, device slots, per-adapter prefix-cache roots: worker/lora/) over a device that
holds no weights, so the only things to model are time:

- an adapter is read as its adapter_config.json (checked as a real replica checks it:
  rank within max_lora_rank, no unsupported setting); its size follows from its rank,
  its targets and the model shape (worker/lora/cost.py `adapter_num_bytes`);
- a step that writes adapters into device slots (the plan's `lora_loads`) takes their
  copy over the profile's host link on top of its own time (`load_seconds`), as the real
  runner writes the slots before the step runs;
- a step with adapter rows takes the masked shrink/expand pair over all its tokens for
  every slot in use (`step_work`), one roofline component of its own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from worker.lora.cost import config_num_bytes, config_targets, load_seconds, step_work, target_shapes
from worker.costs.profiles import DeviceProfile
from worker.costs.shapes import ModelShape
from worker.api import LoRAAdapterError

if TYPE_CHECKING:
    from worker.scheduling.scheduler import SchedulerOutput


@dataclass(frozen=True)
class SimAdapter:
    """What a simulated replica holds of an adapter in host memory: its size."""

    name: str
    path: str
    rank: int
    num_bytes: int


def shape_target_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    return target_shapes(shape.hidden_size, shape.intermediate_size, shape.q_size, shape.kv_size)


def read_sim_adapter(name: str, path: str, shape: ModelShape, max_rank: int) -> SimAdapter:
    """The registry's loader on a simulated device (LoRAAdapterError when the adapter
    would be refused by a real replica's config check, or names no target)."""
    from worker.lora.adapter import read_config  # torch: adapter.py loads it; the simulator must not

    config = read_config(Path(path), max_rank)
    targets = config_targets(config)
    if not targets:
        raise LoRAAdapterError(f"{path}: target_modules {config.get('target_modules')!r} names none of the "
                               f"supported targets")
    num_bytes = config_num_bytes(config, shape_target_shapes(shape), shape.num_layers, shape.dtype_bytes)
    return SimAdapter(name, str(path), config["r"], num_bytes)


class SimLoRA:
    """The adapter part of a simulated step's time."""

    def __init__(self, shape: ModelShape, profile: DeviceProfile, max_rank: int) -> None:
        self.shape, self.profile, self.max_rank = shape, profile, max_rank
        self._shapes = shape_target_shapes(shape)
        self.loader = partial(read_sim_adapter, shape=shape, max_rank=max_rank)

    def step_seconds(self, plan: SchedulerOutput, num_tokens: int, adapters: Callable[[str], SimAdapter]) -> float:
        """Slot writes over the host link, then the rows' shrink/expand roofline.
        `adapters`: name -> the adapter in host memory (the engine's registry)."""
        seconds = 0.0
        for _, name in plan.lora_loads:
            seconds += load_seconds(adapters(name).num_bytes, self.profile.host_link_bandwidth)
        num_active = max((seq.lora_slot for seq in plan.seqs), default=-1) + 1
        if num_active:
            work = step_work(num_tokens, num_active, self.max_rank, self._shapes, self.shape.num_layers,
                             self.shape.dtype_bytes)
            seconds += max(work.flops / self.profile.effective_flops, work.bytes / self.profile.effective_bandwidth)
        return seconds
