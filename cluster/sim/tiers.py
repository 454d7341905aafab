"""KV tiers below a simulated device: the engine's tier manager (worker/kvcache/tiers.py's
calls: offload, start_loads, poll, publish, num_available), with copies priced on the
virtual clock instead of made.

    device pool ──evicted──> host tier (kv.host_tier.HostTier, the real LRU) ──pushed out──> disk (LRU)
         │   ^                    │                                              │
         │   └── load: host link ─┴─────────── disk read ────────────────────────┤
         └──computed (publish)──> shared store (one per simulation, LRU, its own bandwidth)

Time, per replica (B = KV bytes of one block; bandwidths from the device profile):
  offload / publish  n blocks copied device -> host: n * B / host_link, added to the step
                     (the copy must finish before the step that overwrites those blocks,
                     as the real engine's copy, ordered before it on the compute stream)
  load               a waiting request whose prefix continues in the tiers is admitted
                     into `loading` (the real scheduler); its blocks come from the host
                     tier first, then the disk, then the shared store. Each source is one
                     queue (the replica's host link, the replica's disk, the cluster's
                     store), served in order at its bandwidth:
                         host part   h + d + s blocks over the host link (every block crosses it)
                         disk part   d blocks at disk_read_bandwidth
                         store part  s blocks at the store's bandwidth
                     The parts stream through host memory together, so the load is done
                     when its last part is: max of the three finish times. The copies run
                     beside the steps (a load's blocks are read by no step before it ends):
                     the request waits, the others step. It joins the batch at the first
                     step after that (Scheduler.finish_load).
  shared writes      each published block is written over the store's queue and becomes
                     readable, to every replica, when its write ends.
Disk writes (blocks the host tier pushes out) run in the background on the disk's write
path and are readable at once: reads and writes of an NVMe drive do not share one queue.

KV events (kv/kv_events.py, `use_events`): the same records as worker/kvcache/tiers.py's, at the
same points: an evicted device block copied down is `moved` device -> host, one the host
holds already `removed` from the device; a block the host pushes out is `removed` from the
host and `stored` on disk (at once: readable at once), and one the disk drops `removed`
from it. The shared store is not reported.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv.host_tier import HostTier
from kv.kv_events import DISK, HOST, KVEventLog
from kv.tier_report import TierReport
from worker.scheduling.scheduler import TierLoad
from worker.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from cluster.sim.clock import EventQueue
    from cluster.sim.replica import VirtualDevice


@dataclass(frozen=True)
class SimTierOptions:
    """The tiers of every simulated replica (bytes of KV each holds), and the shared store's."""

    host_bytes: int = 0  # 0: no tiers
    disk_bytes: int = 0  # 0: no disk tier
    shared_bytes: int = 0  # 0: no shared store
    shared_bandwidth: float = 0.0  # bytes/s, the store's reads and writes together
    # False: the routers drop the reports' tier fields, so they credit device-resident
    # blocks only (a tier-blind router over the same tiers).
    route_on_tiers: bool = True

    def __post_init__(self) -> None:
        if min(self.host_bytes, self.disk_bytes, self.shared_bytes, self.shared_bandwidth) < 0:
            raise ValueError("tier sizes and the shared store's bandwidth must be >= 0")
        if (self.disk_bytes or self.shared_bytes) and not self.host_bytes:
            raise ValueError("a disk tier or a shared store needs a host tier (host_bytes > 0)")
        if self.shared_bytes and not self.shared_bandwidth:
            raise ValueError("a shared store needs its bandwidth (shared_bandwidth > 0)")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0


class Link:
    """One queue served at a fixed bandwidth: a transfer starts when the previous one ends."""

    def __init__(self, bandwidth: float) -> None:
        if bandwidth <= 0:
            raise ValueError(f"a link needs a bandwidth > 0, got {bandwidth}")
        self.bandwidth = bandwidth
        self.free_at = 0.0
        self.num_bytes = 0

    def transfer(self, now: float, num_bytes: int) -> float:
        """Queue `num_bytes`; returns when they have crossed."""
        if num_bytes <= 0:
            return now
        self.free_at = max(now, self.free_at) + num_bytes / self.bandwidth
        self.num_bytes += num_bytes
        return self.free_at


class BlockLRU:
    """Block hashes held up to a capacity, least recently used first out; each entry
    readable from a time on (a write in flight is not yet readable)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a tier needs room for at least one block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._ready: OrderedDict[int, float] = OrderedDict()  # hash -> readable from, LRU first

    def __len__(self) -> int:
        return len(self._ready)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._ready

    def readable(self, block_hash: int, now: float) -> bool:
        ready = self._ready.get(block_hash)
        return ready is not None and ready <= now

    def put(self, block_hash: int, ready_s: float) -> int | None:
        """Hold `block_hash` (refresh it if held); returns the hash it pushed out, if any."""
        if block_hash in self._ready:
            self._ready.move_to_end(block_hash)
            return None
        dropped = None
        if len(self._ready) >= self.capacity_blocks:
            dropped, _ = self._ready.popitem(last=False)
        self._ready[block_hash] = ready_s
        return dropped

    def clear(self) -> None:
        self._ready.clear()

    def touch(self, block_hash: int) -> None:
        self._ready.move_to_end(block_hash)

    def hashes(self) -> list[int]:
        """Held hashes, least recently used first."""
        return list(self._ready)

    def recent_hashes(self, limit: int) -> list[int]:
        out = []
        for block_hash in reversed(self._ready):
            out.append(block_hash)
            if len(out) >= limit:
                break
        return out


class SharedStore:
    """The store every replica of a simulation writes to and reads from."""

    def __init__(self, capacity_blocks: int, bandwidth: float, block_bytes: int) -> None:
        self.blocks = BlockLRU(capacity_blocks)
        self.link = Link(bandwidth)
        self.block_bytes = block_bytes

    def write(self, block_hashes: list[int], now: float) -> None:
        """Blocks not held yet are written in one transfer; readable when it ends."""
        fresh = [h for h in block_hashes if h not in self.blocks]
        if not fresh:
            return
        ready = self.link.transfer(now, len(fresh) * self.block_bytes)
        for block_hash in fresh:
            self.blocks.put(block_hash, ready)


@dataclass
class _PendingLoad:
    seq: Sequence
    num_blocks: int
    done_s: float


class SimTierManager(TierReport):
    """One simulated replica's tiers, behind the engine's TierManager calls."""

    def __init__(self, device: VirtualDevice, clock: EventQueue, host: HostTier, block_bytes: int,
                 host_link_bandwidth: float, disk: BlockLRU | None = None, disk_read_bandwidth: float = 0.0,
                 shared: SharedStore | None = None) -> None:
        self.device = device
        self.clock = clock
        self.host = host
        self.disk = disk
        self.shared = shared
        self.block_bytes = block_bytes
        self.host_link = Link(host_link_bandwidth)
        self.disk_link = Link(disk_read_bandwidth) if disk is not None else None
        self._pending: list[_PendingLoad] = []
        self._copy_s = 0.0  # device -> host copies this step (offload, publish)
        self.num_offloaded_blocks = 0
        self.num_loaded_blocks = 0  # from every tier
        self.num_disk_loaded_blocks = 0
        self.num_shared_loaded_blocks = 0
        self.num_published_blocks = 0
        self.events: KVEventLog | None = None  # set by use_events

    def use_events(self, events: KVEventLog) -> None:
        """Record what the host tier and the disk gain and lose (the module docstring)."""
        self.events = events

    def clear(self) -> None:
        """A prefix-cache reset: the host tier and the disk (the pool's `cleared` event
        covers them); the shared store is every replica's: kept."""
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    # -- the scheduler's view ------------------------------------------------------------------
    def num_available(self, block_hashes: list[int]) -> int:
        n = 0
        for block_hash in block_hashes:
            if self._source(block_hash) is None:
                break
            n += 1
        return n

    # -- the step ------------------------------------------------------------------------------
    def offload(self, evicted: list[tuple[int, int]]) -> None:
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
        pushed = self.host.put([h for h, _ in fresh], self.device.export_kv([b for _, b in fresh]))
        self._copy_s += len(fresh) * self.block_bytes / self.host_link.bandwidth
        self.num_offloaded_blocks += len(fresh)
        for block_hash, _ in pushed:
            if events is not None:
                events.removed(block_hash, HOST)
            if self.disk is not None:
                self._write_disk(block_hash)
        self.keep_retained()

    def _write_disk(self, block_hash: int) -> None:
        assert self.disk is not None
        fresh = block_hash not in self.disk
        dropped = self.disk.put(block_hash, self.clock.now)
        if self.events is not None:
            if dropped is not None:
                self.events.removed(dropped, DISK)
            if fresh:
                self.events.stored(block_hash, DISK)

    def publish(self, stored: list[tuple[int, int]] | None) -> None:
        if not stored:
            return
        hashes = [h for h, _ in stored if self.shared is not None and h not in self.shared.blocks]
        stored.clear()
        if not hashes or self.shared is None:
            return
        self._copy_s += len(hashes) * self.block_bytes / self.host_link.bandwidth
        self.shared.write(hashes, self.clock.now)
        self.num_published_blocks += len(hashes)

    def start_loads(self, loads: list[TierLoad]) -> list[tuple[Sequence, int]]:
        """Price each load on its queues; none is complete at once (poll returns them)."""
        now = self.clock.now
        for load in loads:
            host, disk, shared = [], 0, 0
            for block_hash in load.block_hashes:
                source = self._source(block_hash)
                if source is None:  # gone since the scheduler counted it: the rest is computed
                    break
                if source == "host":
                    host.append(block_hash)
                elif source == "disk":
                    assert self.disk is not None
                    self.disk.touch(block_hash)  # a read refreshes an entry, as on the real disk tier
                    disk += 1
                else:
                    assert self.shared is not None
                    self.shared.blocks.touch(block_hash)
                    shared += 1
            n = len(host) + disk + shared
            if host:
                self.host.get(host)  # refreshes their recency, as a real read does
            done = self.host_link.transfer(now, n * self.block_bytes)
            if disk:
                assert self.disk_link is not None
                done = max(done, self.disk_link.transfer(now, disk * self.block_bytes))
            if shared:
                assert self.shared is not None
                done = max(done, self.shared.link.transfer(now, shared * self.block_bytes))
            self.num_loaded_blocks += n
            self.num_disk_loaded_blocks += disk
            self.num_shared_loaded_blocks += shared
            self._pending.append(_PendingLoad(load.seq, n, done))
        return []

    def poll(self, wait: bool = False) -> list[tuple[Sequence, int]]:
        """The loads whose copies have ended by now (all of them with `wait`)."""
        now = self.clock.now
        done = [p for p in self._pending if wait or p.done_s <= now]
        if not done:
            return []
        self._pending = [p for p in self._pending if not (wait or p.done_s <= now)]
        return [(p.seq, p.num_blocks) for p in done if p.seq.status is SequenceStatus.LOADING]

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def next_load_done_s(self) -> float | None:
        return min((p.done_s for p in self._pending), default=None)

    def pending_futures(self) -> list:
        return []  # nothing runs on a thread: the replica wakes at next_load_done_s

    def take_copy_s(self) -> float:
        """The device -> host copy time the step just planned carries (then reset)."""
        copy_s, self._copy_s = self._copy_s, 0.0
        return copy_s

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    # -- internals -----------------------------------------------------------------------------
    def _source(self, block_hash: int) -> str | None:
        """Where a load would read this block from: the nearest tier that holds it."""
        if block_hash in self.host:
            return "host"
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        if self.shared is not None and self.shared.blocks.readable(block_hash, self.clock.now):
            return "shared"
        return None
