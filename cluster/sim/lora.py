"""LoRA adapters on a simulated replica: the engine's own multi-LoRA machinery
(worker/lora/: the host LRU, the device slots, the scheduler's admission rule) with its
two loads priced on the virtual clock.

    request for adapter a arrives at replica r
      a in r's host LRU?  no -> cold load: adapter_bytes / storage_bytes_per_s on r's one
                                loader (as the engine's one loader thread: loads queue FIFO),
                                the request waiting outside the scheduler; the replica's
                                other sequences keep stepping meanwhile
      scheduler admits it when a has a device slot or can get one (an empty slot, or one
      no running sequence uses, least recently released first: worker/lora/slots.py)
      a not in that slot yet -> the step that admits it copies it in first:
                                adapter_bytes / the device profile's host-link bandwidth,
                                added to that step (the real runner writes the slot before
                                the step runs)

What the replica reports (lora_resident, lora_loaded) is built by the real worker's
report builder from the same objects, so the routers see exactly what a real worker shows.
The adapters' compute cost inside a step is not modelled (benchmarks/lora_step.py
measures it on the real CPU engine).
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from cluster.sim.clock import EventQueue
from worker.config import LoRAConfig
from worker.engine.core import Engine
from worker.lora.cost import adapter_num_bytes
from worker.lora.engine_lora import EngineLoRA
from worker.sim.lora import shape_target_shapes
from worker.costs.shapes import ModelShape

# The seven projections of a Llama block a PEFT adapter of kvserve may target (docs/lora.md).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Cold loads read the adapter's safetensors file from storage at this rate: a datacenter
# NVMe drive's sequential read (Gen4 drives list 3-7 GB/s), less a filesystem shared with
# the model's own files. A stated assumption, not a measurement; SimLoRA takes another.
DEFAULT_STORAGE_BYTES_PER_S = 2e9


def lora_adapter_bytes(shape: ModelShape, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Bytes of one adapter of `rank` on `targets` in every layer, in the shape's dtype
    (worker/lora/cost.py, the formula the simulated device prices its copies with)."""
    shapes = shape_target_shapes(shape)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; known: {list(shapes)}")
    return adapter_num_bytes(rank, targets, shapes, shape.num_layers, shape.dtype_bytes)


@dataclass(frozen=True)
class SimLoRA:
    """Adapters on every simulated replica: the engine's LoRA settings (max_loras device
    slots, max_cpu_loras in host memory), the adapters' rank (all on every projection) and
    the storage a cold load reads from."""

    config: LoRAConfig = field(default_factory=lambda: LoRAConfig(enable=True))
    rank: int = LoRAConfig.max_lora_rank
    storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= self.config.max_lora_rank:
            raise ValueError(f"rank must be in [1, max_lora_rank={self.config.max_lora_rank}], got {self.rank}")
        if self.storage_bytes_per_s <= 0:
            raise ValueError("storage_bytes_per_s must be > 0")

    def slot_bytes(self, shape: ModelShape) -> int:
        """What a host-to-device copy moves: the adapter zero-padded to the slots' rank
        (worker/lora/layers.py stacks every slot at max_lora_rank)."""
        return lora_adapter_bytes(shape, self.config.max_lora_rank)

    def cold_load_s(self, shape: ModelShape) -> float:
        return lora_adapter_bytes(shape, self.rank) / self.storage_bytes_per_s

    def swap_s(self, shape: ModelShape, host_to_device_bytes_per_s: float) -> float:
        return self.slot_bytes(shape) / host_to_device_bytes_per_s


def sim_lora_path(name: str) -> str:
    """The path a simulated request names its adapter by (nothing is read from it)."""
    return f"sim-lora://{name}"


class VirtualLoader(Executor):
    """The registry's loader thread on the virtual clock: one load at a time, FIFO, each
    `load_s` long; `on_done` runs when one finishes (the replica steps again)."""

    def __init__(self, clock: EventQueue, load_s: float, on_done: Callable[[], None]) -> None:
        self.clock = clock
        self.load_s = load_s
        self.on_done = on_done
        self.free_at = 0.0  # when the loader finishes the loads queued so far

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.free_at = max(self.clock.now, self.free_at) + self.load_s
        self.clock.at(self.free_at, self._finish, future, fn, args, kwargs)
        return future

    def _finish(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> None:
        future.set_result(fn(*args, **kwargs))
        self.on_done()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None


def _no_weights(name: str, path: str) -> str:
    """The simulated device holds no weights: a 'loaded adapter' is its name."""
    return name


def enable_sim_lora(engine: Engine, lora: SimLoRA, clock: EventQueue, cold_load_s: float,
                    wake: Callable[[], None]) -> EngineLoRA:
    """Give `engine` the real EngineLoRA (slots in its scheduler), its host loads on `clock`."""
    engine_lora = EngineLoRA(lora.config, _no_weights, VirtualLoader(clock, cold_load_s, wake))
    engine.enable_lora(engine_lora)
    return engine_lora
