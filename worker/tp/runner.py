"""Rank 0 of a tensor-parallel group: the runner the Engine drives (the same capabilities
as ModelRunner, worker/runner/protocols.py: Runner, KVTransferRunner, plus
HealthCheckedRunner), so the engine, scheduler and sampler do not
know about tensor parallelism.

    replica process (rank 0)                       TPRankWorker actors (ranks 1..N-1)
    Engine -> scheduler -> plan                    (same placement group, STRICT_PACK)
      TPModelRunner.execute(plan)
        encode plan (diff) --broadcast (gloo)--->  decode, ModelRunner.execute (no sampling)
        ModelRunner.execute   <-- all_reduce / all_gather inside every layer -->
        sample on rank 0

A dead rank: the next step raises a clear error (the engine fails that step's requests)
and `check_health` fails from then on, so Serve replaces the replica.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import ray
import torch
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from worker.api import LoRAAdapterError
from worker.config import EngineConfig
from worker.model.registry import arch_for
from worker.runner.kv_group_binding import flat_table, table_length
from worker.runner.model_runner import ModelRunner, RunnerOutput, resolve_device
from worker.scheduling.scheduler import SchedulerOutput
from worker.tp.group import agree_num_blocks, free_port, init_tp_group, leave_tp_group, send_plan
from worker.tp.kv_exchange import (
    assemble_heads,
    gather_to_rank0,
    head_ranges,
    local_shape,
    scatter_from_rank0,
    split_heads,
)
from worker.tp.plan_codec import OP_EXPORT_KV, OP_IMPORT_KV, PlanEncoder, kv_message, stop_message
from worker.tp.rank_worker import TPRankWorker, _shrink_kv

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died or a collective failed)."""


def rank_bundles(size: int, device_type: str, num_cpus: float = 1.0) -> list[dict[str, float]]:
    """Placement-group bundles of a TP group: one per rank (bundle 0 = rank 0, the replica)."""
    bundle: dict[str, float] = {"CPU": num_cpus}
    if device_type == "cuda":
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(size)]


def rank_actor_name(rank: int) -> str:
    """`kvserve-tp-rank<r>-<actor id of rank 0>`: ranks are findable (`ray list actors`,
    fault tests) and tied to their replica by name; unique per group."""
    owner = ray.get_runtime_context().get_actor_id() or ray.get_runtime_context().get_job_id()
    return f"kvserve-tp-rank{rank}-{owner}"


class TPModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: object,
        max_model_len: int,
        tensor_parallel_size: int,
        rank_num_cpus: float = 1.0,
    ) -> None:
        size = tensor_parallel_size
        arch = arch_for(hf_config)
        arch.validate_tp(size)  # fail before spawning
        device = resolve_device(config.model.device)
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        # Inside a Serve replica with placement_group_bundles the replica holds bundle 0 and
        # its children land in the same group; standalone, make a group for ranks 1..N-1.
        pg = ray.util.get_current_placement_group()
        first_bundle = 1
        self._own_pg = None
        if pg is None:
            pg = self._own_pg = placement_group(
                rank_bundles(size - 1, device.type, rank_num_cpus), strategy="STRICT_PACK"
            )
            ray.get(pg.ready())
            first_bundle = 0
        specs = pg.bundle_specs  # a rank takes its whole bundle
        self.workers = [
            TPRankWorker.options(
                name=rank_actor_name(rank),
                num_cpus=specs[first_bundle + rank - 1].get("CPU", 0),
                num_gpus=specs[first_bundle + rank - 1].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=first_bundle + rank - 1
                ),
            ).remote(config, max_model_len, rank, size, host, port)
            for rank in range(1, size)
        ]
        setup_refs = [w.setup.remote() for w in self.workers]
        self.tp, self.plan_group = init_tp_group(0, size, host, port, device)
        self.runner = ModelRunner(config, hf_config, max_model_len, self.tp)
        num_blocks = agree_num_blocks(self.runner.num_blocks, self.plan_group)  # collective
        _shrink_kv(self.runner, num_blocks)
        if ray.get(setup_refs) != [num_blocks] * (size - 1):
            raise TensorParallelError("tensor-parallel ranks disagree on the KV block count")
        self.num_blocks = num_blocks
        self.kv_layout = self.runner.kv_layout
        # An export carries all of the model's KV heads (any decode pool can import it).
        self.kv_spec = replace(self.runner.kv_spec, num_kv_heads=arch.num_kv_heads)
        self._head_ranges = head_ranges(arch.num_heads, arch.num_kv_heads, size)
        self._encoder = PlanEncoder()
        # Multi-LoRA: rank 0's slots are the model's; every rank reads each adapter itself.
        self.lora = self.runner.lora
        self._loop_refs = [w.run.remote() for w in self.workers]
        self._broken: str | None = None
        logger.info("tensor-parallel group of %d ranks ready (%d KV blocks)", size, num_blocks)

    @property
    def sampler(self) -> object:
        return self.runner.sampler

    # -- multi-LoRA (worker/lora/, worker/tp/rank_lora.py) ----------------------------------------
    @property
    def lora_adapters(self) -> Callable[[str], Any] | None:
        return self.runner.lora_adapters

    @lora_adapters.setter
    def lora_adapters(self, get: Callable[[str], Any] | None) -> None:
        """The engine's registry lookup: rank 0's slot writes read from it."""
        self.runner.lora_adapters = get

    def lora_loader(self, name: str, path: str) -> Any:
        """The registry's loader (its own thread, never the step's): read the adapter here
        (a bad one fails here, with its LoRAAdapterError), then on every other rank, so
        that a plan writing it into a slot finds it on all of them."""
        adapter = self.runner.lora_loader(name, path)
        try:
            ray.get([w.load_lora.remote(name, path) for w in self.workers])
        except ray.exceptions.RayError as e:
            raise LoRAAdapterError(f"a tensor-parallel rank could not read the adapter {name!r}: {e}") from None
        return adapter

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        def step() -> RunnerOutput:
            send_plan(self._encoder.encode(plan), self.plan_group)
            return self.runner.execute(plan)

        return self._collective("step", step)

    # -- disaggregation (worker/tp/kv_exchange.py) --------------------------------------------
    def export_kv(self, block_ids: list[int] | list[list[int]]) -> torch.Tensor:
        """All ranks' heads of these blocks (a table: one id list, or one per KV group), as
        one (layers, 2, T, Hkv, D) CPU tensor in model layer order."""
        def export() -> torch.Tensor:
            send_plan(kv_message(OP_EXPORT_KV, flat_table(block_ids)), self.plan_group)
            local = self.runner.export_kv(block_ids)
            parts = gather_to_rank0(local, 0, self.tp.size, self.plan_group)
            return assemble_heads(parts, self._head_ranges, self.kv_spec.num_kv_heads)

        return self._collective("KV export", export)

    def import_kv(self, block_ids: list[int] | list[list[int]], kv: torch.Tensor) -> None:
        def import_() -> None:
            send_plan(kv_message(OP_IMPORT_KV, flat_table(block_ids)), self.plan_group)
            parts = split_heads(kv.to("cpu", self.kv_spec.dtype), self._head_ranges)
            shape = local_shape(self.runner.kv_spec, table_length(block_ids))
            local = scatter_from_rank0(parts, shape, self.runner.spec.dtype, 0, self.plan_group)
            self.runner.import_kv(block_ids, local)

        self._collective("KV import", import_)

    def _collective(self, what: str, fn: Callable[[], T]) -> T:
        """Run a group-wide operation; any failure breaks the group for good (a rank may be
        mid-collective), and the error names a dead rank when that is the cause."""
        self._check_ranks()
        try:
            return fn()
        except Exception as e:
            self._broken = f"tensor-parallel {what} failed: {type(e).__name__}: {e}"
            self._check_ranks()  # prefer "rank i died" when that is the cause
            raise TensorParallelError(self._broken) from e

    def _check_ranks(self) -> None:
        """Raise when a rank's loop has ended (it died, or failed); cheap (no round trip)."""
        done, _ = ray.wait(self._loop_refs, num_returns=len(self._loop_refs), timeout=0)
        for ref in done:
            rank = self._loop_refs.index(ref) + 1
            try:
                ray.get(ref)
                why = "exited"
            except Exception as e:  # RayActorError when the process died
                why = f"died ({type(e).__name__})"
            self._broken = f"tensor-parallel rank {rank} of {self.tp.size} {why}; this replica must be replaced"
            raise TensorParallelError(self._broken)
        if self._broken is not None:
            raise TensorParallelError(self._broken)

    def check_health(self) -> None:
        self._check_ranks()

    def load_stats(self) -> list[dict[str, int]]:
        """Bytes and tensors each rank read from the checkpoint (rank 0 first)."""
        stats = self.runner.model.load_stats
        own = {"num_tensors": stats.num_tensors, "num_bytes": stats.num_bytes}
        return [own, *ray.get([w.load_stats.remote() for w in self.workers])]

    def shutdown(self) -> None:
        if self._broken is None:
            try:
                send_plan(stop_message(), self.plan_group)
                ray.get(self._loop_refs, timeout=30)
            except Exception:
                logger.exception("tensor-parallel shutdown")
        leave_tp_group()
        for w in self.workers:
            ray.kill(w)
        if self._own_pg is not None:
            ray.util.remove_placement_group(self._own_pg)
