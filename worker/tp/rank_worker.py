"""A tensor-parallel rank other than 0, as a Ray actor: it holds its model shard and KV
cache and executes every plan rank 0 broadcasts; it never schedules or samples."""
from __future__ import annotations

import logging
from pathlib import Path

import ray
import torch

from kv.kv_cache import allocate_kv_cache
from worker.config import EngineConfig
from worker.model_config import load_hf_config
from worker.runner.kv_group_binding import table_length, unflat_table
from worker.runner.model_runner import ModelRunner, resolve_device
from worker.tp.group import agree_num_blocks, init_tp_group, leave_tp_group, recv_plan
from worker.tp.kv_exchange import gather_to_rank0, local_shape, scatter_from_rank0
from worker.tp.plan_codec import OP_EXPORT_KV, KVOp, PlanDecoder
from worker.tp.rank_lora import RankLoRAStore

logger = logging.getLogger(__name__)


# `run` blocks in its loop; `ping` must still answer, and `load_lora` reads an adapter
# beside the loop.
@ray.remote(max_concurrency=3)
class TPRankWorker:
    def __init__(self, config: EngineConfig, max_model_len: int, rank: int, size: int, host: str, port: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.rank, self.size, self.host, self.port = rank, size, host, port
        self.runner = None
        self.plan_group = None
        self.lora = None  # worker/tp/rank_lora.py's store, when the config enables LoRA

    def setup(self) -> int:
        """Join the group, load this rank's shard, allocate its KV cache (the block count all
        ranks agree on, which this returns)."""
        device = resolve_device(self.config.model.device)
        if device.type == "cuda":
            device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to this rank's GPU
        tp, self.plan_group = init_tp_group(self.rank, self.size, self.host, self.port, device)
        hf_config = load_hf_config(Path(self.config.model.model), self.config.model.trust_remote_code)
        self.runner = ModelRunner(self.config, hf_config, self.max_model_len, tp)
        if self.runner.lora is not None:
            self.lora = RankLoRAStore(self.runner.lora_loader, self.config.lora.host_capacity)
            self.runner.lora_adapters = self.lora.get
        num_blocks = agree_num_blocks(self.runner.num_blocks, self.plan_group)  # collective
        _shrink_kv(self.runner, num_blocks)
        return num_blocks

    def load_lora(self, name: str, path: str) -> None:
        """Read an adapter into this rank's host memory (rank 0's loader thread calls it
        before the adapter's first request is admitted)."""
        if self.lora is None:
            raise RuntimeError("this tensor-parallel rank was started without LoRA")
        self.lora.load(name, path)

    def load_stats(self) -> dict[str, int]:
        stats = self.runner.model.load_stats
        return {"num_tensors": stats.num_tensors, "num_bytes": stats.num_bytes}

    def run(self) -> int:
        """Execute broadcast plans until rank 0 says stop; returns the steps executed."""
        decoder = PlanDecoder(self.runner.kv_layout.num_groups)
        num_steps = 0
        try:
            while True:
                plan = decoder.decode(recv_plan(self.plan_group))
                if plan is None:
                    return num_steps
                if isinstance(plan, KVOp):
                    self._exchange_kv(plan)
                    continue
                self.runner.execute(plan)
                num_steps += 1
        finally:
            leave_tp_group()

    def _exchange_kv(self, op: object) -> None:
        """This rank's side of rank 0's export_kv / import_kv (worker/tp/kv_exchange.py)."""
        runner = self.runner
        table = unflat_table(op.block_ids, runner.kv_layout.num_groups)  # sent position-major
        if op.op == OP_EXPORT_KV:
            gather_to_rank0(runner.export_kv(table), self.rank, self.size, self.plan_group)
        else:
            shape = local_shape(runner.kv_spec, table_length(table))
            local = scatter_from_rank0(None, shape, runner.spec.dtype, self.rank, self.plan_group)
            runner.import_kv(table, local)

    def ping(self) -> bool:
        return True


def _shrink_kv(runner: object, num_blocks: int) -> None:
    """Re-allocate a rank's KV cache with the group's common (smaller) block count."""
    if num_blocks < runner.num_blocks:
        device = runner.kv_caches.device
        runner.kv_caches = None  # free first: the budget was sized for one cache
        runner.num_blocks = num_blocks
        runner.kv_caches = allocate_kv_cache(runner.spec, num_blocks, device)
