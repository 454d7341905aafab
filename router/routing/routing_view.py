"""What a router knows beyond the replicas' last reports: the work promised to each replica
since its report (router/routing/reservations.py's ledger) and which replica holds which prompt
prefix as routers learned it from their own dispatches (hints).

A private view (LocalRoutingView) knows only its own router's dispatches: N ingress
replicas with private views each see 1/N of the load promised since the last report and
herd onto the replica that looked emptiest, and each sees 1/N of the prefix ownership.
A shared view (router/routing/redis_view.py's RedisRoutingView) adds every other router's
unreflected work and hints, kept in Redis.

Hints use the replicas' own chained block hashes (kv.block_hash through
RequestProfile.block_hashes at the replica's block size): block i's hash names the whole
prefix up to the end of block i, so a replica's hint depth is the leading run of the
prompt's hashes it was last seen to receive. A hint expires after `hint_ttl_s` (the replica's
cache may have evicted it; its report says what it really holds).
"""
from __future__ import annotations

import math

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from router.routing.reservations import PerReplica, ReplicaKey, ReservationLedger, Unreflected

# How long a learned hint counts, and how many block hashes one view remembers per replica
# (LRU beyond): prefix_affinity's max tree size, more blocks than one replica's KV holds.
DEFAULT_HINT_TTL_S = 300.0
DEFAULT_MAX_HINTS = 1 << 18


@runtime_checkable
class RoutingView(Protocol):
    """The ledger's methods plus prefix hints. Synchronous: a policy calls it inside rank()."""

    def __len__(self) -> int: ...

    def __contains__(self, request_id: str) -> bool: ...

    def replica_of(self, request_id: str) -> ReplicaKey | None: ...

    def reserve(
        self,
        request_id: str,
        replica: ReplicaKey,
        need_by_replica: Mapping[ReplicaKey, int],
        now: float,
        prefill_tokens: PerReplica = 0,
        decode_blocks: int = 0,
    ) -> None: ...

    def routed(self, request_id: str, replica: ReplicaKey) -> None: ...

    def complete(self, request_id: str, replica: ReplicaKey | None = None) -> None: ...

    def observe_report(self, replica: ReplicaKey, report_timestamp: float) -> None: ...

    def unreflected(self, replica: ReplicaKey) -> Unreflected: ...

    def outstanding(self, replica: ReplicaKey) -> int: ...

    def prune(self, now: float, live_replicas: set[ReplicaKey] | None, unconfirmed_ttl_s: float, ttl_s: float) -> int: ...

    def prefix_owner_hints(self, block_hashes: Sequence[int],
                           not_before: Mapping[ReplicaKey, float] | None = None) -> dict[ReplicaKey, int]: ...

    def learn_prefix(self, replica: ReplicaKey, block_hashes: Sequence[int], now: float) -> None: ...


class HintTable:
    """block hash -> {replica: when last learned}; aged, and bounded per replica (LRU over
    each replica's hashes, like prefix_affinity's index): one global bound lets a busy
    cluster's newest prompts push out every replica's older prefixes while the replicas still
    cache them, and the router forgets where a conversation's history lives."""

    def __init__(self, ttl_s: float = DEFAULT_HINT_TTL_S, max_hashes: int = DEFAULT_MAX_HINTS) -> None:
        if ttl_s <= 0 or max_hashes <= 0:
            raise ValueError("hint ttl_s and max_hashes must be > 0")
        self.ttl_s = ttl_s
        self.max_hashes = max_hashes  # per replica
        self._owners: dict[int, dict[ReplicaKey, float]] = {}
        # Per replica its hashes, least recently learned first. Invariant: h in _lru[r]
        # exactly when r in _owners[h].
        self._lru: dict[ReplicaKey, OrderedDict[int, None]] = {}
        self._now = 0.0  # the latest `now` seen: hints older than now - ttl_s are dead

    def __len__(self) -> int:
        return len(self._owners)

    def learn(self, replica: ReplicaKey, block_hashes: Sequence[int], now: float) -> None:
        self._now = max(self._now, now)
        lru = self._lru.setdefault(replica, OrderedDict())
        for h in reversed(block_hashes):  # leaf first, root last: roots are evicted last
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = {}
            owners[replica] = now
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.max_hashes:
            old, _ = lru.popitem(last=False)
            self._drop(old, replica)

    def _drop(self, h: int, replica: ReplicaKey) -> None:
        owners = self._owners[h]
        del owners[replica]
        if not owners:
            del self._owners[h]

    def match(self, block_hashes: Sequence[int], not_before: Mapping[ReplicaKey, float] | None = None
              ) -> dict[ReplicaKey, int]:
        """Leading blocks of `block_hashes` each replica was last seen to receive. A hint
        learned before the replica's `not_before` time (its cache cleared or its engine
        restarted since: ReplicaReport.kv_since) does not count."""
        horizon = self._now - self.ttl_s
        if not_before:
            return self._match(block_hashes, lambda r: max(horizon, not_before.get(r, horizon)))
        return self._match(block_hashes, lambda r: horizon)

    def _match(self, block_hashes: Sequence[int], horizon_of: Callable[[ReplicaKey], float]) -> dict[ReplicaKey, int]:
        get = self._owners.get
        depth: dict[ReplicaKey, int] = {}
        live: list[ReplicaKey] | None = None  # owners of every block so far
        num = 0  # blocks matched so far
        for h in block_hashes:
            owners = get(h)
            if not owners:
                break
            if live is None:
                live = [r for r, t in owners.items() if t >= horizon_of(r)]
            else:
                still = [r for r in live if owners.get(r, -math.inf) >= horizon_of(r)]
                if len(still) < len(live):
                    for r in live:
                        if r not in still:
                            depth[r] = num
                    live = still
            if not live:
                break
            num += 1
        for r in live or ():
            depth[r] = num
        return depth

    def forget(self, replicas: Iterable[ReplicaKey]) -> None:
        for r in set(replicas):
            for h in self._lru.pop(r, ()):
                self._drop(h, r)


class LocalRoutingView(ReservationLedger):
    """A private view: this router's own ledger and the hints it learned itself."""

    def __init__(
        self,
        report_lag_s: float = 0.05,
        hint_ttl_s: float = DEFAULT_HINT_TTL_S,
        max_hints: int = DEFAULT_MAX_HINTS,
    ) -> None:
        super().__init__(report_lag_s)
        self.hints = HintTable(hint_ttl_s, max_hints)

    def prefix_owner_hints(self, block_hashes: Sequence[int],
                           not_before: Mapping[ReplicaKey, float] | None = None) -> dict[ReplicaKey, int]:
        return self.hints.match(block_hashes, not_before)

    def learn_prefix(self, replica: ReplicaKey, block_hashes: Sequence[int], now: float) -> None:
        if block_hashes:
            self.hints.learn(replica, block_hashes, now)

    def prune(
        self,
        now: float,
        live_replicas: set[ReplicaKey] | None,
        unconfirmed_ttl_s: float,
        ttl_s: float,
    ) -> int:
        if live_replicas is not None:
            self.hints.forget(k for k in self.known_replicas() if k not in live_replicas)
        return super().prune(now, live_replicas, unconfirmed_ttl_s, ttl_s)

    def known_replicas(self) -> list[ReplicaKey]:
        return list(self._replicas)
