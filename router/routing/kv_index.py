"""The router's exact index of what each replica's KV cache holds, per tier, kept from the
replicas' KV events (kv/kv_events.py) as their routing reports carry them
(worker/kvcache/event_stream.py draws the replica's side).

Per replica: (epoch, seq) and a set of chained block hashes per tier (device, host, disk).
For each report, `apply` does exactly one of:

    first report, or a new epoch  -> drop everything known of the replica and rebuild from
                                     the report's snapshot (exact at kv_snapshot_seq), then
                                     apply the report's batches after it
    the next batch is there       -> apply the batches after seq, in order
    a gap (seq + 1 missing)       -> rebuild as above (the snapshot holds what was missed)
    nothing new                   -> nothing

Applying: stored adds to the tier's set, removed discards, moved discards from one and
adds to the other, cleared empties every tier. A block may be in several tiers at once
(loaded back to the device, it stays in the host tier). A hash removed that the index
does not hold (a rebuild from a capped snapshot left it out) is ignored: the index may miss
a block the replica holds, never the other way round.

Every router copy (one per ingress replica) receives the same reports from Serve's
controller and applies them the same way, so all of them hold the same index, without
a shared store. Replicas without events (kv_epoch "") are not indexed: their report's
hash lists are used as they are. Single-threaded: the router's event loop.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kv.kv_events import CLEARED, DEVICE, DISK, HOST, MOVED, REMOVED, STORED, KVEventBatch
from router.routing.reservations import ReplicaKey
from router.routing.types import ReplicaReport

APPLIED, REBUILT, DROPPED = "applied", "rebuilt", "dropped"  # what a report did (counters)


@dataclass
class ReplicaKV:
    """What one replica holds, as of its batch `seq` of `epoch`."""

    epoch: str
    seq: int = 0
    tiers: dict[str, set[int]] = field(default_factory=lambda: {DEVICE: set(), HOST: set(), DISK: set()})

    @property
    def device(self) -> set[int]:
        return self.tiers[DEVICE]

    @property
    def host(self) -> set[int]:
        return self.tiers[HOST]

    @property
    def disk(self) -> set[int]:
        return self.tiers[DISK]

    def apply(self, batch: KVEventBatch) -> None:
        tiers = self.tiers
        for event in batch.events:
            if event.kind == STORED:
                tiers[event.tier].update(event.block_hashes)
            elif event.kind == REMOVED:
                tiers[event.tier].difference_update(event.block_hashes)
            elif event.kind == MOVED:
                tiers[event.tier].difference_update(event.block_hashes)
                tiers[event.to_tier].update(event.block_hashes)
            elif event.kind == CLEARED:
                for held in tiers.values():
                    held.clear()
        self.seq = batch.seq

    def rebuild(self, snapshot_seq: int, device: Iterable[int], host: Iterable[int], disk: Iterable[int]) -> None:
        self.tiers = {DEVICE: set(device), HOST: set(host), DISK: set(disk)}
        self.seq = snapshot_seq


class KVIndex:
    def __init__(self) -> None:
        self._replicas: dict[ReplicaKey, ReplicaKV] = {}
        # Reports by what they did (APPLIED, REBUILT, DROPPED), and gaps among the rebuilds.
        self.num_reports: dict[str, int] = {APPLIED: 0, REBUILT: 0, DROPPED: 0}
        self.num_gaps = 0

    def __contains__(self, replica: ReplicaKey) -> bool:
        return replica in self._replicas

    def get(self, replica: ReplicaKey) -> ReplicaKV | None:
        return self._replicas.get(replica)

    def apply(self, replica: ReplicaKey, stats: Mapping[str, object]) -> ReplicaKV | None:
        """Bring the replica's entry up to its report; None when the report has no events
        (or malformed ones: the caller then goes by the report's hash lists)."""
        parsed = _parse(stats)
        if parsed is None:
            self._replicas.pop(replica, None)
            return None
        epoch, latest, batches, snapshot_seq = parsed
        state = self._replicas.get(replica)
        if state is None or state.epoch != epoch:
            outcome = DROPPED if state is not None else REBUILT
            state = self._replicas[replica] = ReplicaKV(epoch)
            self._rebuild(state, stats, snapshot_seq, batches)
        elif state.seq >= latest:
            return state
        elif batches and batches[0].seq <= state.seq + 1:
            outcome = APPLIED
            for batch in batches:
                if batch.seq == state.seq + 1:
                    state.apply(batch)
        else:
            outcome = REBUILT
            self.num_gaps += 1
            self._rebuild(state, stats, snapshot_seq, batches)
        self.num_reports[outcome] += 1
        return state

    def indexed(self, replica: ReplicaKey, stats: Mapping[str, object], report: ReplicaReport) -> ReplicaReport:
        """`report` (parsed from `stats`) with the index's hash sets, brought up to `stats`,
        in place of its capped snapshot (kv_exact); as it is when the replica sends no
        events. The sets are the index's own, live: the next report updates them."""
        held = self.apply(replica, stats)
        if held is None:
            return report
        return replace(report, prefix_hashes=held.device, host_prefix_hashes=held.host,
                       disk_prefix_hashes=held.disk, kv_exact=True)

    def forget(self, live: set[ReplicaKey]) -> None:
        """Drop the replicas that left the deployment."""
        for replica in [r for r in self._replicas if r not in live]:
            del self._replicas[replica]

    @staticmethod
    def _rebuild(state: ReplicaKV, stats: Mapping[str, object], snapshot_seq: int,
                 batches: Sequence[KVEventBatch]) -> None:
        state.rebuild(snapshot_seq, _hashes(stats, "prefix_hashes"), _hashes(stats, "host_prefix_hashes"),
                      _hashes(stats, "disk_prefix_hashes"))
        for batch in batches:
            if batch.seq == state.seq + 1:
                state.apply(batch)


def _parse(stats: Mapping[str, object]) -> tuple[str, int, list[KVEventBatch], int] | None:
    epoch = stats.get("kv_epoch")
    if not isinstance(epoch, str) or not epoch:
        return None
    batches = stats.get("kv_events") or []
    try:
        latest, snapshot_seq = int(stats.get("kv_seq") or 0), int(stats.get("kv_snapshot_seq") or 0)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None
    if not isinstance(batches, list) or not all(isinstance(b, KVEventBatch) for b in batches):
        return None
    return epoch, latest, sorted(batches, key=lambda b: b.seq), snapshot_seq


def _hashes(stats: Mapping[str, object], key: str) -> list[int]:
    value = stats.get(key) or []
    return list(value) if isinstance(value, (list, tuple)) else []  # type: ignore[arg-type]
