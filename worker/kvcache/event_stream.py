"""A replica's KV events as the router reads them: numbered batches, a window of recent
ones in every routing-stats report, and the snapshot a router rebuilds from.

    engine thread, every step:  drain the engine's KVEventLog -> one KVEventBatch, seq + 1
                                (no batch when nothing happened); every snapshot period,
                                right after a drain, the cached hashes per tier, stamped
                                with the seq they are exact at (`KVSnapshot`)
    report (Serve's thread):    epoch, the latest seq, the snapshot, and every batch after
                                min(snapshot seq, seq of the report `retain_reports` ago)

Invariants:
  * `epoch` names one engine instance: a replica whose engine restarts is a new stream,
    and a router drops what it knew of the old one;
  * seq numbers are dense (1, 2, 3, ...) within an epoch: a router that holds seq n and
    reads a report whose first batch is not n + 1 has missed batches (a gap) and rebuilds
    the replica from the report's snapshot, then applies the batches after it;
  * every batch after the latest snapshot stays in the window (only older ones are
    trimmed, beyond `max_hashes`), so a rebuild from any report is exact up to the
    snapshot's size limit. A report reads the batches before the snapshot: a snapshot
    taken in between is newer than those batches, never older, so the batches it needs
    are there.

Reports are what the router polls (the controller calls `record_routing_stats` every stats
period and broadcasts the dict to every router copy), so events cost no Ray call of their
own; the window reaching back `retain_reports` reports lets a router that missed a report
catch up without a rebuild.
"""
from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kv.kv_events import KVEventBatch, KVEventLog

# Batches older than the latest snapshot are kept while all retained batches hold at most
# this many block hashes (the window a lagging router catches up from).
DEFAULT_MAX_HASHES = 1 << 16
DEFAULT_RETAIN_REPORTS = 4


@dataclass(frozen=True)
class KVSnapshot:
    """The replica's cached block hashes per tier, most recent first (each list capped by
    the caller), exact as of batch `seq`."""

    seq: int = 0
    device: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)


class KVEventStream:
    def __init__(self, log: KVEventLog, max_hashes: int = DEFAULT_MAX_HASHES,
                 retain_reports: int = DEFAULT_RETAIN_REPORTS, clock: Callable[[], float] = time.time) -> None:
        self.log = log
        self.epoch = uuid.uuid4().hex[:16]
        self.seq = 0
        # The clock the replica's reports are stamped with (the simulator's is virtual).
        self._clock = clock
        # clock() at the epoch's start or its latest cache clear: what a router learned
        # of this replica's cache before it (its prefix hints) no longer holds.
        self.since = clock()
        self.max_hashes = max_hashes
        self.snapshot = KVSnapshot()
        self._batches: deque[KVEventBatch] = deque()
        self._num_hashes = 0  # over the retained batches
        self._report_seqs: deque[int] = deque([0], maxlen=retain_reports)

    # -- engine thread ---------------------------------------------------------------------
    def drain(self) -> KVEventBatch | None:
        """The events recorded since the last drain, as the next batch (None: nothing)."""
        if not len(self.log):
            return None
        events = tuple(self.log.drain())
        self.seq += 1
        batch = KVEventBatch(self.seq, events)
        self._batches.append(batch)
        self._num_hashes += _num_hashes(batch)
        self._trim()
        return batch

    def cleared(self) -> None:
        """The engine just reset its prefix cache (its `cleared` event is in the log)."""
        self.since = self._clock()

    def take_snapshot(self, device: list[int], host: list[int], disk: list[int]) -> None:
        """Right after a drain, on the same thread: the hashes are exact at `self.seq`."""
        self.snapshot = KVSnapshot(self.seq, device, host, disk)
        self._trim()

    def _trim(self) -> None:
        batches, keep_after = self._batches, self.snapshot.seq
        while batches and self._num_hashes > self.max_hashes and batches[0].seq <= keep_after:
            self._num_hashes -= _num_hashes(batches.popleft())

    # -- the report (any thread) -------------------------------------------------------------
    def report(self) -> dict[str, object]:
        """The routing-stats fields (worker.api.RoutingStats): kv_epoch, kv_seq,
        kv_events (the window), and the snapshot as kv_snapshot_seq and the hash lists."""
        batches = list(self._batches)  # first: see the module docstring
        snapshot = self.snapshot
        since = min(snapshot.seq, self._report_seqs[0])
        window = [b for b in batches if b.seq > since]
        latest = max(batches[-1].seq if batches else 0, snapshot.seq)
        self._report_seqs.append(latest)
        return {
            "kv_epoch": self.epoch,
            "kv_since": self.since,
            "kv_seq": latest,
            "kv_events": window,
            "kv_snapshot_seq": snapshot.seq,
            "prefix_hashes": snapshot.device,
            "host_prefix_hashes": snapshot.host,
            "disk_prefix_hashes": snapshot.disk,
        }


def _num_hashes(batch: KVEventBatch) -> int:
    return sum(len(e.block_hashes) for e in batch.events) or 1
