"""What the engine needs from a model runner, as explicit capabilities.

    Runner            every runner: a block count and `execute(plan)` (ModelRunner,
                      TPModelRunner, the simulated and fake runners of tests/benchmarks)
    KVTransferRunner  a runner whose KV blocks can be copied out and in (disaggregation);
                      the engine's KV connector is built on one (worker/kvcache/connector.py)
    HealthCheckedRunner a runner that can break for good (a tensor-parallel group with a
                      dead rank): the replica's health check asks it

Torch-free at import: the types below are only named for type checkers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from kv.kv_cache import KVCacheSpec
    from worker.api import RunnerOutput
    from worker.scheduling.scheduler import SchedulerOutput


@runtime_checkable
class Runner(Protocol):
    num_blocks: int  # the KV blocks the block pool may hand out (block ids 0..num_blocks-1)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the plan's tokens through the model; sample where a sequence reaches the end
        of its tokens (`RunnerOutput.token_ids` aligned with `plan.seqs`, None elsewhere)."""
        ...


@runtime_checkable
class KVTransferRunner(Runner, Protocol):
    @property
    def kv_spec(self) -> KVCacheSpec:
        """The layout of an export: all of the model's KV heads (under TP too)."""
        ...

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks, (layers, 2, len(block_ids) * block_size, Hkv, D)."""
        ...

    def import_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """The inverse of `export_kv`, into this runner's own blocks."""
        ...


@runtime_checkable
class HealthCheckedRunner(Protocol):
    def check_health(self) -> None:
        """Raise when the runner can no longer execute (the replica must be replaced)."""
        ...
