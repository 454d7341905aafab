"""The router's reservation ledger: work promised to each replica since that replica's last
stats report (counted at dispatch time, since reports are seconds old): KV blocks, requests,
uncached prefill tokens and the decode blocks those requests will still grow into. The
headroom policy (router/routing/scoring.py) adds them to what the report shows."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from router.routing.types import ReplicaKey

# A per-request figure that may depend on the replica (uncached prefill tokens do: prefix hits).
PerReplica = int | Mapping[ReplicaKey, int]


@dataclass(frozen=True)
class Unreflected:
    """Work promised to one replica and not yet shown by its report."""

    blocks: int = 0
    requests: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens still to prefill
    decode_blocks: int = 0  # blocks the requests' decodes will still grow into


NOTHING = Unreflected()


def _on(value: PerReplica, replica: ReplicaKey, default: int = 0) -> int:
    return value if isinstance(value, int) else value.get(replica, default)


@dataclass
class _Reservation:
    replica: ReplicaKey
    blocks: int
    dispatched_at: float
    need_by_replica: Mapping[ReplicaKey, int]
    prefill: PerReplica = 0
    decode_blocks: int = 0
    confirmed: bool = False  # Serve reported the request as sent (on_request_routed)
    reflected: bool = False  # a report taken after dispatch already shows it

    @property
    def prefill_tokens(self) -> int:
        return _on(self.prefill, self.replica)


class _ReplicaLedger:
    __slots__ = ("unreflected", "blocks", "prefill_tokens", "decode_blocks", "outstanding", "cutoff")

    def __init__(self) -> None:
        self.unreflected: dict[str, None] = {}  # request ids, insertion (≈ dispatch) order
        # Sums over `unreflected` (invariant kept by _add/_remove).
        self.blocks = 0
        self.prefill_tokens = 0
        self.decode_blocks = 0
        self.outstanding = 0
        self.cutoff = -math.inf  # dispatches at or before this are reflected

    def add(self, request_id: str, entry: _Reservation) -> None:
        self.unreflected[request_id] = None
        self._count(entry, 1)

    def remove(self, request_id: str, entry: _Reservation) -> None:
        del self.unreflected[request_id]
        self._count(entry, -1)

    def _count(self, entry: _Reservation, sign: int) -> None:
        self.blocks += sign * entry.blocks
        self.prefill_tokens += sign * entry.prefill_tokens
        self.decode_blocks += sign * entry.decode_blocks

    def snapshot(self) -> Unreflected:
        return Unreflected(self.blocks, len(self.unreflected), self.prefill_tokens, self.decode_blocks)


class ReservationLedger:
    """Blocks and requests this router promised to each replica since its last report.

    O(1) per dispatch/completion; a new report costs one pass over that replica's
    unreflected requests. Not thread-safe: Serve calls the router from one event loop.
    """

    def __init__(self, report_lag_s: float = 0.05) -> None:
        self.report_lag_s = report_lag_s
        self._entries: dict[str, _Reservation] = {}
        self._replicas: dict[ReplicaKey, _ReplicaLedger] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def replica_of(self, request_id: str) -> ReplicaKey | None:
        entry = self._entries.get(request_id)
        return entry.replica if entry is not None else None

    def _ledger(self, replica: ReplicaKey) -> _ReplicaLedger:
        led = self._replicas.get(replica)
        if led is None:
            led = self._replicas[replica] = _ReplicaLedger()
        return led

    def _attach(self, request_id: str, entry: _Reservation) -> None:
        led = self._ledger(entry.replica)
        led.outstanding += 1
        entry.reflected = entry.dispatched_at <= led.cutoff
        if not entry.reflected:
            led.add(request_id, entry)

    def _detach(self, request_id: str, entry: _Reservation) -> None:
        led = self._replicas.get(entry.replica)
        if led is None:
            return
        led.outstanding -= 1
        if not entry.reflected:
            led.remove(request_id, entry)

    def reserve(
        self,
        request_id: str,
        replica: ReplicaKey,
        need_by_replica: Mapping[ReplicaKey, int],
        now: float,
        prefill_tokens: PerReplica = 0,
        decode_blocks: int = 0,
    ) -> None:
        """Reserve at choice time on the top-ranked replica (replaces an earlier choice of
        the same request: Serve re-runs the choice after a rejection or a backoff).
        `prefill_tokens` (uncached prompt tokens) may be given per replica, so that a move
        to another replica (`routed`) counts that replica's figure."""
        old = self._entries.pop(request_id, None)
        if old is not None:
            self._detach(request_id, old)
        entry = _Reservation(
            replica, need_by_replica.get(replica, 0), now, need_by_replica, prefill_tokens, decode_blocks
        )
        self._entries[request_id] = entry
        self._attach(request_id, entry)

    def routed(self, request_id: str, replica: ReplicaKey) -> None:
        """Serve sent the request to `replica` (maybe not the top-ranked one)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return  # already completed (a fast request) or never reserved
        if entry.replica != replica:
            self._detach(request_id, entry)
            entry.replica = replica
            entry.blocks = entry.need_by_replica.get(replica, entry.blocks)
            self._attach(request_id, entry)
        entry.confirmed = True

    def complete(self, request_id: str, replica: ReplicaKey | None = None) -> None:
        """The request finished (or was rejected/cancelled) on `replica`."""
        entry = self._entries.get(request_id)
        if entry is None or (replica is not None and entry.replica != replica):
            return  # a late completion of an earlier attempt elsewhere: keep the new one
        del self._entries[request_id]
        self._detach(request_id, entry)

    def observe_report(self, replica: ReplicaKey, report_timestamp: float) -> None:
        """A report taken at `report_timestamp` reflects dispatches older than it by report_lag_s."""
        led = self._ledger(replica)
        cutoff = report_timestamp - self.report_lag_s
        if cutoff <= led.cutoff:
            return
        led.cutoff = cutoff
        for request_id in list(led.unreflected):
            entry = self._entries[request_id]
            if entry.dispatched_at <= cutoff:
                entry.reflected = True
                led.remove(request_id, entry)

    def unreflected(self, replica: ReplicaKey) -> Unreflected:
        """Work promised to `replica` and not yet shown by a report."""
        led = self._replicas.get(replica)
        return led.snapshot() if led is not None else NOTHING

    def report_cutoff(self, replica: ReplicaKey) -> float:
        """Dispatches to `replica` at or before this time are shown by a report seen here."""
        led = self._replicas.get(replica)
        return led.cutoff if led is not None else -math.inf

    def newest_unreflected(self, replica: ReplicaKey) -> float:
        """The latest dispatch time among `replica`'s unreflected reservations (-inf: none)."""
        led = self._replicas.get(replica)
        if led is None or not led.unreflected:
            return -math.inf
        return max(self._entries[request_id].dispatched_at for request_id in led.unreflected)

    def outstanding(self, replica: ReplicaKey) -> int:
        """Requests this router has on `replica` that have not completed."""
        led = self._replicas.get(replica)
        return led.outstanding if led is not None else 0

    def prune(
        self,
        now: float,
        live_replicas: set[ReplicaKey] | None,
        unconfirmed_ttl_s: float,
        ttl_s: float,
    ) -> int:
        """Drop reservations on replicas that are gone, unconfirmed ones older than
        unconfirmed_ttl_s (the caller gave up before Serve sent them) and any older than
        ttl_s. Returns how many were dropped."""
        dropped = 0
        for request_id, entry in list(self._entries.items()):
            age = now - entry.dispatched_at
            gone = live_replicas is not None and entry.replica not in live_replicas
            if gone or age > ttl_s or (not entry.confirmed and age > unconfirmed_ttl_s):
                del self._entries[request_id]
                self._detach(request_id, entry)
                dropped += 1
        if live_replicas is not None:
            for replica in list(self._replicas):
                if replica not in live_replicas:
                    del self._replicas[replica]
        return dropped
