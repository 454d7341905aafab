"""KV tiers below the device: where evicted prefix blocks go, and how they come back.

    device pool ──evicted (offload)──> host tier ──pushed out──> disk tier (optional)
         │   ^                             │                        │
         │   └──── load (TierLoad) ────────┴──── background read ───┤
         └──computed (publish)──> shared store (optional, a directory all replicas mount)

The engine calls the manager at fixed points of every step:
  offload     after scheduling, before the step executes: the cached blocks that this
              schedule handed out again (the block pool records them) are copied from
              the device into the host tier while their KV is still there; blocks the
              host tier pushes out are written to disk by a background thread
  start_loads after offload: the plan's tier loads (worker/scheduling/scheduler.py's TierLoad). A
              load's leading host-held blocks are copied into its device blocks now; the
              rest is read from disk in the background
  poll        at the start of a step: finished disk reads are copied into their device
              blocks; returns each finished load with the count of blocks it filled,
              for Scheduler.finish_load
  publish     after a step's update, with a shared store: the blocks it newly cached
              (their KV computed now) are copied out and written to the store in the
              background, so that other replicas can load them
A block is read back from the host tier first, then the local disk, then the shared store.
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

from kv.disk_tier import DiskTier, fingerprint_key, layout_fingerprint
from kv.host_tier import HostTier
from kv.tier_report import TierReport
from kv.kv_events import HOST, KVEventLog
from kv.kv_cache import KVCacheSpec
from worker.config import CacheConfig
from worker.runner.protocols import KVTransferRunner
from worker.scheduling.scheduler import TierLoad
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


class TierManager(TierReport):
    def __init__(self, runner: KVTransferRunner, spec: KVCacheSpec, host: HostTier,
                 disk: DiskTier | None = None, shared: DiskTier | None = None) -> None:
        self.runner = runner
        self.spec = spec
        self.host = host
        self.disk = disk
        self.shared = shared
        below = disk is not None or shared is not None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-io") if below else None
        self._pending: list[_PendingLoad] = []
        self.num_offloaded_blocks = 0
        self.num_loaded_blocks = 0  # from every tier
        self.num_disk_loaded_blocks = 0  # from the local disk or the shared store
        self.num_published_blocks = 0
        self.events: KVEventLog | None = None  # set by use_events

    def use_events(self, events: KVEventLog) -> None:
        """Record what the host tier and the local disk gain and lose (kv/kv_events.py):
        an evicted device block copied down is `moved` device -> host, one the host holds
        already is `removed` from the device; a block the host pushes out is `removed`
        from the host, and `stored` on disk once its write lands (the disk tier records
        that, on its writer thread). The shared store is not reported."""
        self.events = events
        if self.disk is not None:
            self.disk.events = events

    def clear(self) -> None:
        """A prefix-cache reset: the host tier now, the local disk on the I/O thread (after
        the writes queued before it). The shared store is every replica's: kept."""
        self.host.clear()
        if self.disk is not None and self._io is not None:
            self._io.submit(self.disk.clear)

    @classmethod
    def from_config(cls, cache: CacheConfig, runner: KVTransferRunner, model_path: str | Path | None,
                    pin_memory: bool) -> TierManager:
        if not isinstance(runner, KVTransferRunner):
            raise ValueError(f"KV tiers need a runner that copies KV blocks out and in; "
                             f"{type(runner).__name__} does not (set host_kv_cache_bytes: 0)")
        spec = runner.kv_spec
        host = HostTier.for_budget(spec, cache.host_kv_cache_bytes, pin_memory)
        model_id = model_id_of(model_path)
        # One subdirectory per model and layout: a volume can hold several models' stores.
        key = fingerprint_key(layout_fingerprint(spec, model_id))
        disk = shared = None
        if cache.disk_kv_cache_dir is not None:
            disk = DiskTier(Path(cache.disk_kv_cache_dir) / key, cache.disk_kv_cache_bytes, spec, model_id)
        if cache.shared_kv_store_dir is not None:
            shared = DiskTier(Path(cache.shared_kv_store_dir) / key, cache.shared_kv_store_bytes, spec, model_id,
                              shared=True)
        logger.info("KV tiers: host %d blocks, disk %s, shared store %s", host.num_slots,
                    disk.directory if disk else None, shared.directory if shared else None)
        return cls(runner, spec, host, disk, shared)

    # -- the scheduler's view (torch-free in what it touches) ----------------------------------
    def num_available(self, block_hashes: list[int]) -> int:
        host, disk, shared = self.host, self.disk, self.shared
        n = 0
        for block_hash in block_hashes:
            if (block_hash not in host and (disk is None or block_hash not in disk)
                    and (shared is None or block_hash not in shared)):
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
        events = self.events
        if events is not None:
            events.evicted_to_host(evicted, self.host)
        evicted.clear()
        if not fresh:
            return
        kv = self.runner.export_kv([b for _, b in fresh])
        pushed = self.host.put([h for h, _ in fresh], kv)
        self.num_offloaded_blocks += len(fresh)
        if events is not None:
            for block_hash, _ in pushed:
                events.removed(block_hash, HOST)
        if self.disk is not None and self._io is not None:
            for block_hash, block_kv in pushed:
                self._io.submit(self.disk.put, block_hash, block_kv)

    def publish(self, stored: list[tuple[int, int]] | None) -> None:
        """Write blocks newly cached on the device (their KV computed) to the shared
        store in the background; clears `stored`."""
        if not stored:
            return
        shared = self.shared
        fresh = [(h, b) for h, b in stored if shared is not None and not shared.knows(h)]
        stored.clear()
        if not fresh or not shared.writable or self._io is None:
            return
        kv = self.runner.export_kv([b for _, b in fresh])
        blocks = kv.split(self.spec.block_size, dim=2)  # views of one copy, (layers, 2, bs, H, D) each
        for (block_hash, _), block_kv in zip(fresh, blocks):
            self._io.submit(shared.put, block_hash, block_kv)
        self.num_published_blocks += len(fresh)

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
        """Background thread: the blocks from the local disk or else the shared store,
        from the first, up to the first that neither serves."""
        blocks = []
        for block_hash in block_hashes:
            kv = None
            if self.disk is not None and self.disk.knows(block_hash):
                kv = self.disk.get(block_hash)
            if kv is None and self.shared is not None:
                kv = self.shared.get(block_hash)
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
