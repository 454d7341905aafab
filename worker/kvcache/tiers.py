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

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kv.disk_tier import DiskTier, fingerprint_key, layout_fingerprint
from kv.host_tier import HostTier
from kv.tier_report import TierReport
from kv.kv_events import HOST, KVEventLog
from kv.kv_cache import KVCacheSpec
from kv.tier_store import claim_store
from worker.config import CacheConfig
from worker.kvcache.weights_digest import model_id_of
from worker.runner.protocols import KVTransferRunner
from worker.scheduling.scheduler import TierLoad
from worker.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

__all__ = ["TierManager", "model_id_of"]

# A shared store's view learns other replicas' entries this often (a rescan on the I/O thread).
SHARED_REFRESH_S = 2.0


@dataclass
class _PendingLoad:
    load: TierLoad
    num_done: int  # blocks copied from the host tier already
    future: Future[list[torch.Tensor]]  # the disk blocks after them, read in the background
    started: float = field(default_factory=time.monotonic)


class TierManager(TierReport):
    def __init__(self, runner: KVTransferRunner, spec: KVCacheSpec, host: HostTier,
                 disk: DiskTier | None = None, shared: DiskTier | None = None, io_timeout_s: float = 30.0) -> None:
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
        # A store that hangs must not hang the engine: no file-system call runs on the
        # engine thread, a load waits at most io_timeout_s, and while the I/O thread has
        # been inside one call longer than that the disk tiers count as absent (no loads
        # admitted from them, no writes queued) and check_health fails.
        self.io_timeout_s = io_timeout_s
        self._busy_since: float | None = None  # when the I/O thread's current call began
        self._refresh_due = 0.0
        self._refresh_queued = False
        self.num_timed_out_loads = 0

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
            self._submit(self.disk.clear)

    @classmethod
    def from_config(cls, cache: CacheConfig, runner: KVTransferRunner, model_path: str | Path | None,
                    pin_memory: bool) -> TierManager:
        if not isinstance(runner, KVTransferRunner):
            raise ValueError(f"KV tiers need a runner that copies KV blocks out and in; "
                             f"{type(runner).__name__} does not (set host_kv_cache_bytes: 0)")
        spec = runner.kv_spec
        host = HostTier.for_budget(spec, cache.host_kv_cache_bytes, pin_memory)
        mac_key = os.environ.get(cache.kv_store_key_env, "").encode()
        if cache.shared_kv_store_dir is not None and not mac_key:
            raise ValueError(f"shared_kv_store_dir needs a key: set the environment variable {cache.kv_store_key_env} "
                             f"(kv_store_key_env; the Helm chart fills it from kvTiers.sharedStore.keySecret), "
                             "so that only holders of the key can write KV the replicas will serve")
        roots = [Path(d) for d in (cache.shared_kv_store_dir, cache.disk_kv_cache_dir) if d is not None]
        model_id = model_id_of(model_path, roots, mac_key) if roots else "unknown"
        # One subdirectory per model and layout: a volume can hold several models' stores.
        key = fingerprint_key(layout_fingerprint(spec, model_id))
        source = None if model_path is None else str(model_path)
        disk = shared = None
        if cache.disk_kv_cache_dir is not None:
            disk = DiskTier(Path(cache.disk_kv_cache_dir) / key, cache.disk_kv_cache_bytes, spec, model_id, key=mac_key)
            _claim(disk, source, model_id, key)
        if cache.shared_kv_store_dir is not None:
            shared = DiskTier(Path(cache.shared_kv_store_dir) / key, cache.shared_kv_store_bytes, spec, model_id,
                              shared=True, key=mac_key)
            _claim(shared, source, model_id, key)
        logger.info("KV tiers: host %d blocks, disk %s, shared store %s", host.num_slots,
                    disk.directory if disk else None, shared.directory if shared else None)
        return cls(runner, spec, host, disk, shared, cache.tier_io_timeout_s)

    # -- the scheduler's view (torch-free in what it touches) ----------------------------------
    def num_available(self, block_hashes: list[int]) -> int:
        host, disk, shared = self.host, self.disk, self.shared
        if self.stalled_s() > self.io_timeout_s:  # a hung store: only the host tier serves
            disk = shared = None
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
            self.keep_retained()
            return
        kv = self.runner.export_kv([b for _, b in fresh])
        pushed = self.host.put([h for h, _ in fresh], kv)
        self.num_offloaded_blocks += len(fresh)
        if events is not None:
            for block_hash, _ in pushed:
                events.removed(block_hash, HOST)
        if self.disk is not None and self._io is not None and not self._stalled:
            for block_hash, block_kv in pushed:
                self._submit(self.disk.put, block_hash, block_kv)
        self.keep_retained()

    def publish(self, stored: list[tuple[int, int]] | None) -> None:
        """Write blocks newly cached on the device (their KV computed) to the shared
        store in the background; clears `stored`. Every step: it also keeps the shared
        store's view fresh (what other replicas wrote)."""
        self._refresh_shared()
        if not stored:
            return
        shared = self.shared
        fresh = [(h, b) for h, b in stored if shared is not None and not shared.knows(h)]
        stored.clear()
        if not fresh or not shared.accepts_writes or self._io is None or self._stalled:
            return
        kv = self.runner.export_kv([b for _, b in fresh])
        blocks = kv.split(self.spec.block_size, dim=2)  # views of one copy, (layers, 2, bs, H, D) each
        for (block_hash, _), block_kv in zip(fresh, blocks):
            self._submit(shared.put, block_hash, block_kv)
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
            self._pending.append(_PendingLoad(load, num_host, self._submit(self._read_disk, rest)))
        return done

    def poll(self, wait: bool = False) -> list[tuple[Sequence, int]]:
        """Finish the loads whose disk reads are done (all of them with `wait`)."""
        if not self._pending:
            return []
        done, still = [], []
        now = time.monotonic()
        for pending in self._pending:
            left = self.io_timeout_s - (now - pending.started)
            if not (wait or pending.future.done()) and left >= 0:
                still.append(pending)
                continue
            try:
                blocks = pending.future.result(timeout=max(left, 0.0))
            except FutureTimeout:  # the store hangs: the sequence computes what it did not give
                self.num_timed_out_loads += 1
                logger.warning("KV tier read timed out after %.0f s; the prefix is recomputed", self.io_timeout_s)
                blocks = []
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
        if self._io is not None:  # a hung store is left behind, not waited for
            stalled = self._stalled
            self._io.shutdown(wait=not stalled, cancel_futures=stalled)

    def stalled_s(self) -> float:
        """How long the I/O thread has been inside its current call (0: idle)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def _stalled(self) -> bool:
        return self.stalled_s() > self.io_timeout_s

    def check_health(self) -> None:
        """Raises while a disk tier's store hangs (one call on it past io_timeout_s)."""
        stalled = self.stalled_s()
        if stalled > self.io_timeout_s:
            raise RuntimeError(f"KV tier store stalled: one file-system call has run {stalled:.0f} s "
                               f"(tier_io_timeout_s {self.io_timeout_s:g})")

    # -- internals ---------------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `fn` on the I/O thread, timing it for stalled_s."""
        assert self._io is not None

        def timed() -> Any:
            self._busy_since = time.monotonic()
            try:
                return fn(*args)
            finally:
                self._busy_since = None

        return self._io.submit(timed)

    def _refresh_shared(self) -> None:
        """Engine thread: every SHARED_REFRESH_S, queue a rescan of the shared store (what
        other replicas wrote) on the I/O thread."""
        shared = self.shared
        now = time.monotonic()
        if shared is None or self._io is None or self._refresh_queued or now < self._refresh_due or self._stalled:
            return
        self._refresh_queued = True
        self._refresh_due = now + SHARED_REFRESH_S

        def refresh() -> None:
            try:
                shared.refresh()
            finally:
                self._refresh_queued = False

        self._submit(refresh)

    def _read_disk(self, block_hashes: list[int]) -> list[torch.Tensor]:
        """Background thread: the blocks from the local disk or else the shared store,
        from the first, up to the first that neither serves."""
        blocks = []
        for block_hash in block_hashes:
            kv = None
            try:  # never an exception into the engine loop: a failure is a miss
                if self.disk is not None and self.disk.knows(block_hash):
                    kv = self.disk.get(block_hash)
                if kv is None and self.shared is not None:
                    kv = self.shared.get(block_hash)
            except Exception as e:
                logger.warning("KV tier read of block %016x failed (%s); the rest is recomputed", block_hash, e)
                kv = None
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


def _claim(tier: DiskTier, model_path: str | None, model_id: str, key: str) -> None:
    """Record the store's owner and delete stale siblings (kv/tier_store.py); a store that
    cannot be claimed still serves."""
    try:
        claim_store(tier.directory, model_path, model_id, key)
    except OSError as e:
        logger.warning("KV tier %s: housekeeping failed (%s)", tier.directory, e)
