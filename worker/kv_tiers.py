"""KV tiers below the device: where evicted prefix blocks go, and how they come back.

    device pool ──evicted (offload)──> host tier ──pushed out──> disk tier (optional)
         ^                                 │                        │
         └──────── load (TierLoad) ────────┴──── background read ───┘

The engine calls the manager at fixed points of every step:
  offload     after scheduling, before the step executes: the cached blocks that this
              schedule handed out again (the block pool records them) are copied from
              the device into the host tier while their KV is still there; blocks the
              host tier pushes out are written to disk by a background thread
  start_loads after offload: the plan's tier loads (worker/scheduler.py's TierLoad). A
              load's leading host-held blocks are copied into its device blocks now; the
              rest is read from disk in the background
  poll        at the start of a step: finished disk reads are copied into their device
              blocks; returns each finished load with the count of blocks it filled,
              for Scheduler.finish_load
A load stops at the first block that no tier can serve (evicted meanwhile, or a disk
entry that failed its checks): the sequence computes the rest. Copies go through the
runner's export_kv / import_kv (the same calls disaggregation uses).
"""
from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kv.disk_tier import DiskTier
from kv.host_tier import HostTier
from kv.kv_cache import KVCacheSpec
from worker.config import CacheConfig
from worker.runner_protocols import KVTransferRunner
from worker.scheduler import TierLoad
from worker.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


def model_id_of(path: str | Path | None) -> str:
    """A stable name for a checkpoint: its config and the names and sizes of its weight
    files (replicas reading one model from different paths agree)."""
    if path is None:
        return "unknown"
    path = Path(path)
    digest = hashlib.blake2b(digest_size=8)
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file())
    for p in files:
        if p.name == "config.json":
            digest.update(p.read_bytes())
        elif p.suffix in (".safetensors", ".gguf", ".bin"):
            digest.update(f"{p.name}:{p.stat().st_size}".encode())
    return digest.hexdigest()


@dataclass
class _PendingLoad:
    load: TierLoad
    num_done: int  # blocks copied from the host tier already
    future: Future[list[torch.Tensor]]  # the disk blocks after them, read in the background


class TierManager:
    def __init__(self, runner: KVTransferRunner, spec: KVCacheSpec, host: HostTier,
                 disk: DiskTier | None = None) -> None:
        self.runner = runner
        self.spec = spec
        self.host = host
        self.disk = disk
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-io") if disk is not None else None
        self._pending: list[_PendingLoad] = []
        self.num_offloaded_blocks = 0
        self.num_loaded_blocks = 0  # from the host tier and disk together
        self.num_disk_loaded_blocks = 0

    @classmethod
    def from_config(cls, cache: CacheConfig, runner: KVTransferRunner, model_path: str | Path | None,
                    pin_memory: bool) -> TierManager:
        if not isinstance(runner, KVTransferRunner):
            raise ValueError(f"KV tiers need a runner that copies KV blocks out and in; "
                             f"{type(runner).__name__} does not (set host_kv_cache_bytes: 0)")
        spec = runner.kv_spec
        host = HostTier.for_budget(spec, cache.host_kv_cache_bytes, pin_memory)
        disk = None
        if cache.disk_kv_cache_dir is not None:
            disk = DiskTier(cache.disk_kv_cache_dir, cache.disk_kv_cache_bytes, spec, model_id_of(model_path))
        logger.info("KV tiers: host %d blocks%s", host.num_slots,
                    f", disk {cache.disk_kv_cache_dir} ({cache.disk_kv_cache_bytes} bytes)" if disk else "")
        return cls(runner, spec, host, disk)

    # -- the scheduler's view (torch-free in what it touches) ----------------------------------
    def num_available(self, block_hashes: list[int]) -> int:
        host, disk = self.host, self.disk
        n = 0
        for block_hash in block_hashes:
            if block_hash not in host and (disk is None or block_hash not in disk):
                break
            n += 1
        return n

    # -- the step --------------------------------------------------------------------------------
    def offload(self, evicted: list[tuple[int, int]]) -> None:
        """Copy blocks the pool just handed out again into the host tier (before the step
        that overwrites them runs); clears `evicted`."""
        if not evicted:
            return
        fresh = [(h, b) for h, b in evicted if h not in self.host]
        evicted.clear()
        if not fresh:
            return
        kv = self.runner.export_kv([b for _, b in fresh])
        pushed = self.host.put([h for h, _ in fresh], kv)
        self.num_offloaded_blocks += len(fresh)
        if self.disk is not None and self._io is not None:
            for block_hash, block_kv in pushed:
                self._io.submit(self.disk.put, block_hash, block_kv)

    def start_loads(self, loads: list[TierLoad]) -> list[tuple[Sequence, int]]:
        """Begin the plan's loads; returns those already complete (host-held throughout),
        each with the number of blocks it filled."""
        done = []
        for load in loads:
            num_host = 0
            for block_hash in load.block_hashes:
                if block_hash not in self.host:
                    break
                num_host += 1
            if num_host:
                self._copy_in(load.block_ids[:num_host], self.host.get(load.block_hashes[:num_host]))
            rest = load.block_hashes[num_host:]
            if not rest or self._io is None:
                done.append((load.seq, num_host))
                continue
            self._pending.append(_PendingLoad(load, num_host, self._io.submit(self._read_disk, rest)))
        return done

    def poll(self, wait: bool = False) -> list[tuple[Sequence, int]]:
        """Finish the loads whose disk reads are done (all of them with `wait`)."""
        if not self._pending:
            return []
        done, still = [], []
        for pending in self._pending:
            if not (wait or pending.future.done()):
                still.append(pending)
                continue
            blocks = pending.future.result()
            seq, n = pending.load.seq, pending.num_done
            if blocks and seq.status is SequenceStatus.LOADING:  # not aborted meanwhile
                ids = pending.load.block_ids[n : n + len(blocks)]
                self._copy_in(ids, self._join(blocks))
                self.num_disk_loaded_blocks += len(blocks)
            done.append((seq, n + len(blocks)))
        self._pending = still
        return done

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def pending_futures(self) -> list[Future[list[torch.Tensor]]]:
        return [p.future for p in self._pending]

    def flush(self) -> None:
        """Wait until every queued disk write has landed (tests, benchmarks, shutdown)."""
        if self._io is not None:
            self._io.submit(lambda: None).result()

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)

    # -- internals ---------------------------------------------------------------------------------
    def _read_disk(self, block_hashes: list[int]) -> list[torch.Tensor]:
        """Background thread: the disk blocks, from the first, up to the first miss."""
        assert self.disk is not None
        blocks = []
        for block_hash in block_hashes:
            kv = self.disk.get(block_hash)
            if kv is None:
                break
            blocks.append(kv)
        return blocks

    def _copy_in(self, block_ids: list[int], kv: torch.Tensor) -> None:
        self.runner.import_kv(block_ids, kv)
        self.num_loaded_blocks += len(block_ids)

    @staticmethod
    def _join(blocks: list[torch.Tensor]) -> torch.Tensor:
        """[(layers, 2, bs, H, D)] -> (layers, 2, n * bs, H, D)."""
        return torch.cat(blocks, dim=2)
