"""Admission control at the ingress: hold a request while no worker replica can take it,
in a bounded queue that is fair between API keys; shed with 429 at the bound.

    pipeline: admit (key slot, in-flight share) -> convert -> charge -> ADMISSION -> stream
                                                                          │
       no fresh stats / nothing of ours in flight / some replica fits ───>│ go now
       a better band than work of ours in flight, its bands within the room ─>│ go now (overtakes)
       otherwise: held in FairQueue (round robin between keys; a key's head that does
       not fit lets other keys' heads go; full: the deepest key gives up a place) ─>│ go when one fits
       queue full, its key over its share ──────────────────> 429 + Retry-After (gRPC RESOURCE_EXHAUSTED)
       queue full of better-band work, or held longer than max_wait_s ─> 503 + Retry-After (UNAVAILABLE)
       (one queue per priority band, best band first: router/routing/fair_queue.py BandedQueue)

Why at the ingress: a request pushed into an engine that has no room waits there anyway
(and, with KV pressure, gets preempted and recomputed); held here, it is routed later with
fresher stats, to whichever replica freed up first, and overload is visible to the client
as a 429 with a hint instead of as an ever-longer TTFT. Except for a better band than
work in flight: the engines put it ahead of that work anyway, so holding it here would
only add a completion's wait to its TTFT (`_overtakes`).

Whether some replica can take a request now (`judge`, the pending admissions it counts):
router/routing/admission_judge.py.

Never refuse because stats are stale (the router then ranks by power of two choices): a
request goes at once when any live replica's report is missing or stale, when the router is
not kvserve's (no RoutingParams: Serve's own pow2), or when this ingress has nothing in
flight (holding can only help when there is work ahead of the request; this also means a
request too large for any replica's headroom is never held forever: the engine answers it).
With several ingress replicas, the work every ingress sent meets in the routers' shared view
(router/routing/redis_view.py, through Redis): each ingress judges with all of it, and only its own
admissions the router has not sent yet (admission to the replica's acceptance) count for it
alone. With private views (or a baseline router) each counts only what its own router sent
and its own pending requests, so N ingresses can over-admit up to N-fold until the next
reports make them agree, once per stats period. The view is read between decisions (the
router observes each new report as Serve delivers it: router/routing/serve_router.py's
update_replicas), from the copy its last sync read (another router's work read then stops
counting once a report reflects it): no Redis round trip here.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from router import errors
from router.routing.admission_judge import (  # noqa: F401 -- the reasons are this module's surface too
    REASON_FITS,
    REASON_FULL,
    REASON_IDLE,
    REASON_NO_ROUTER,
    REASON_OFF,
    REASON_OVERTAKES,
    REASON_STALE,
    REASON_TOO_LARGE,
    RoutingSnapshot,
    SnapshotSource,
    Verdict,
    _Pending,
    judge,
)
from router.routing.fair_queue import BandedQueue
from router.routing.types import RequestProfile

Clock = Callable[[], float]

# How often held requests are re-judged while any are held (reports arrive once per stats
# period; a completion at this ingress re-judges at once).
POLL_INTERVAL_S = 0.05
# Weight of the newest queue wait in the moving average that Retry-After is derived from.
_WAIT_EWMA_ALPHA = 0.2

class AdmissionMetrics(Protocol):
    def observe_admitted(self, wait_s: float, reason: str, predicted_cached_tokens: int) -> None: ...

    def observe_shed(self, reason: str) -> None: ...

    def set_queue_length(self, length: int) -> None: ...


class Ticket:
    """An admitted request's place in the controller's counts until its stream closes;
    release() is idempotent."""

    def __init__(self, controller: AdmissionController, num_requests: int, verdict: Verdict, wait_s: float,
                 band: int = 0) -> None:
        self._controller = controller
        self.num_requests = num_requests
        self.band = band
        self.verdict = verdict
        self.wait_s = wait_s
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._controller._release(self)


@dataclass
class _Held:
    key: str
    band: int  # priority band (lower first)
    profiles: list[RequestProfile]
    enqueued_at: float  # time.monotonic()
    future: asyncio.Future[Ticket] = field(repr=False)


class AdmissionController:
    """One per ingress replica. `admit` returns at once (a Ticket) or after holding the
    request; raises APIError 429 (with retry_after_s) when the request is shed."""

    def __init__(
        self,
        source: SnapshotSource | None,
        queue_size: int,
        max_wait_s: float,
        max_waiting_per_replica: int,
        metrics: AdmissionMetrics | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
        clock: Clock = time.time,  # the reports' clock
        key_weights: Mapping[str, int] | None = None,  # each key's share of the hold queue (1 unlisted)
    ) -> None:
        self._source = source
        self.queue = BandedQueue(queue_size, key_weights)
        self.max_wait_s = max_wait_s
        self.max_waiting_per_replica = max_waiting_per_replica
        self._metrics = metrics
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._pending: list[_Pending] = []  # in grant order
        self.num_in_flight = 0  # engine requests admitted here whose streams are open
        self._in_flight_by_band: Counter[int] = Counter()  # ... of them, by priority band
        # Matching the router's sends to grants here (a snapshot with a view): engine
        # requests granted, how many of them the router has sent, and its count at the last
        # judge (None: no view then).
        self._num_granted = 0
        self._num_dispatched = 0
        self._routed_total: int | None = None
        self._wait_ewma_s = 0.0
        self._ticker: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self._source is not None and self.queue.capacity > 0

    @property
    def retry_after_s(self) -> int:
        """What a shed request is told to wait: the recent queue wait, at least 1 s."""
        return max(1, math.ceil(self._wait_ewma_s))

    # ------------------------------------------------------------------ admitting
    async def admit(self, key: str, profiles: list[RequestProfile], priority: int = 0,
                    on_hold: Callable[[], None] | None = None) -> Ticket:
        """`priority`: the request's band (lower first). Sheds: 429 when the key holds more
        than its share of the queue (the tenant's overload), 503 when the cluster has no
        room for its band (the queue is all better or equal-share work, or the wait ran out).
        `on_hold` is called when the request starts to wait in the queue (the ingress gives
        back its intake slot: router/frontend/intake.py)."""
        if not self.enabled:
            return self._grant(len(profiles), Verdict(True, REASON_OFF), 0.0, priority)
        if not len(self.queue):  # nobody held ahead of it
            verdict = self._judge(profiles, priority)
            if verdict.admit:
                return self._grant(len(profiles), verdict, 0.0, priority)
        held = _Held(key, priority, profiles, time.monotonic(), asyncio.get_running_loop().create_future())
        evicted = self.queue.evict_for(priority, key)
        if evicted is not None:
            victim, for_better_band = evicted
            victim.future.set_exception(
                self._shed("queue_full", "The server's admission queue is full of requests of a better priority",
                           status=503)
                if for_better_band else
                self._shed("queue_full", f"The server's admission queue is full and this API key holds the most "
                                         f"of its {self.queue.capacity} places")
            )
        if not self.queue.push(priority, key, held):
            # Refused: its own key holds its share (429), or every place is better work (503).
            over_share = self.queue.depth(key) > 0
            raise self._shed("queue_full", f"The server's admission queue is full ({self.queue.capacity} requests held)",
                             status=429 if over_share else 503)
        self._queue_changed()
        self.pump()
        if on_hold is not None and not held.future.done():
            on_hold()
        try:
            async with asyncio.timeout(self.max_wait_s):
                return await asyncio.shield(held.future)
        except TimeoutError:
            self._drop(held)
            raise self._shed("queue_timeout", f"No worker could take the request within {self.max_wait_s:g} s",
                             status=503) from None
        except asyncio.CancelledError:
            self._drop(held)
            raise

    def _drop(self, held: _Held) -> None:
        """The waiter is gone: out of the queue, or, when it was granted meanwhile, released."""
        if self.queue.remove(held.band, held.key, held):
            self._queue_changed()
        elif held.future.done() and not held.future.cancelled():
            held.future.result().release()
        held.future.cancel()

    def pump(self) -> None:
        """Let held requests go, round robin between keys, while any key's head can go: a
        head that does not fit waits without holding back other keys' heads that do
        (within a key, FIFO). A large request passed over keeps its turn and goes once
        it fits, or is shed at max_wait_s."""
        granted = True
        while granted and len(self.queue):
            granted = False
            for band, key, held in self.queue.heads():  # best band first
                verdict = self._judge(held.profiles, band)
                if verdict.admit:
                    self.queue.pop_key(band, key)
                    held.future.set_result(self._grant(len(held.profiles), verdict, time.monotonic() - held.enqueued_at,
                                                       band))
                    granted = True
                    break  # the counts changed: judge again from the rotation's front
        self._queue_changed()

    def _judge(self, profiles: list[RequestProfile], band: int) -> Verdict:
        snapshot = self._source.snapshot() if self._source is not None else None
        if snapshot is not None:
            self._forget_dispatched(snapshot)
            self._forget_reflected(snapshot)
        verdict = judge(profiles, snapshot, self._pending, self.max_waiting_per_replica)
        if not verdict.admit and self.num_in_flight == 0:
            return replace(verdict, admit=True, reason=REASON_IDLE)
        if not verdict.admit and snapshot is not None and self._overtakes(band, len(profiles), snapshot):
            return replace(verdict, admit=True, reason=REASON_OVERTAKES)
        return verdict

    def _overtakes(self, band: int, num_requests: int, snapshot: RoutingSnapshot) -> bool:
        """Whether a request may go although the replicas look full, because worse bands'
        work fills them: an engine admits a better band ahead of it, preempting it when no
        slot or no blocks are left (worker/scheduling/scheduler.py), so the request waits a step there
        instead of here for a completion. Only while this ingress has worse-band requests in
        flight (work to overtake), and its band and the better ones in flight here, this one
        included, fit the replicas' running slots and waiting rooms (as if the worse bands
        were not there)."""
        worse = sum(n for b, n in self._in_flight_by_band.items() if b > band)
        if not worse:
            return False
        room = sum(r.max_num_seqs + self.max_waiting_per_replica for r in snapshot.reports if r is not None and r.healthy)
        return self.num_in_flight - worse + num_requests <= room

    def _forget_dispatched(self, snapshot: RoutingSnapshot) -> None:
        """With a routing view, a pending admission stops counting once the router has sent
        it: the view counts it from then on (every ingress's, when shared). Sends are matched
        to grants in grant order, by count: as routed_total advances by k, the oldest k
        requests' worth are sent; an entry of n > 1 requests goes when all n are.

        Invariant: _num_dispatched <= the grants here that the router has sent or never will
        (cancelled first), so an entry is dropped at its send or later, never before (late
        only counts it twice until a report reflects it). Hence a first view, or a router
        whose count restarted, only sets the baseline: what it sent before cannot be told
        apart from this controller's grants. The one exception: a migrated request is sent
        twice (router/frontend/migration.py); the cap at _num_granted bounds what that drops early."""
        total = snapshot.routed_total
        previous, self._routed_total = self._routed_total, total
        if total is None:
            return
        if self.num_in_flight == 0:
            # Every grant here has been sent or given up: the count is exact again (sends
            # before a baseline, grants cancelled before their send).
            self._num_dispatched = self._num_granted
        elif previous is not None and total >= previous:
            self._num_dispatched = min(self._num_dispatched + total - previous, self._num_granted)
        sent = 0
        while sent < len(self._pending) and self._pending[sent].granted_through <= self._num_dispatched:
            sent += 1
        del self._pending[:sent]

    def _forget_reflected(self, snapshot: RoutingSnapshot) -> None:
        """Pending admissions that every replica has reported since stop counting (and any
        older than the staleness bound: a fresh report is newer than that)."""
        if not self._pending:
            return
        cutoff = snapshot.now - snapshot.params.stale_after_s
        reports = [r for r in snapshot.reports if r is not None]
        if reports and len(reports) == len(snapshot.reports):
            cutoff = max(cutoff, min(r.timestamp for r in reports) - snapshot.params.report_lag_s)
        self._pending = [p for p in self._pending if p.admitted_at > cutoff]

    def _grant(self, num_requests: int, verdict: Verdict, wait_s: float, band: int) -> Ticket:
        self.num_in_flight += num_requests
        self._in_flight_by_band[band] += num_requests
        # Every grant goes through the router, pending or not (stale stats, ...): its send
        # advances routed_total too.
        self._num_granted += num_requests
        if verdict.reason in (REASON_FITS, REASON_IDLE, REASON_OVERTAKES):
            self._pending.append(_Pending(self._clock(), num_requests, verdict.need_blocks, self._num_granted))
        if wait_s > 0:
            self._wait_ewma_s += _WAIT_EWMA_ALPHA * (wait_s - self._wait_ewma_s)
        if self._metrics is not None:
            self._metrics.observe_admitted(wait_s, verdict.reason, verdict.predicted_cached_tokens)
        return Ticket(self, num_requests, verdict, wait_s, band)

    def _release(self, ticket: Ticket) -> None:
        self.num_in_flight -= ticket.num_requests
        self._in_flight_by_band[ticket.band] -= ticket.num_requests
        if len(self.queue):
            self.pump()

    def _shed(self, reason: str, message: str, status: int = 429) -> errors.APIError:
        if self._metrics is not None:
            self._metrics.observe_shed(reason)
        retry = self.retry_after_s
        return shed_error(f"{message}; retry after {retry} s.", retry, status)

    # ------------------------------------------------------------------ the ticker
    def _queue_changed(self) -> None:
        if self._metrics is not None:
            self._metrics.set_queue_length(len(self.queue))
        if len(self.queue) and (self._ticker is None or self._ticker.done()):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a release outside the loop (a stream collected): the next admit restarts it
                return
            self._ticker = loop.create_task(self._tick())

    async def _tick(self) -> None:
        """Re-judge the held requests while there are any: reports change without a
        completion here (another ingress's requests finish, a replica is added)."""
        while len(self.queue):
            await asyncio.sleep(self._poll_interval_s)  # a polling period, not synchronisation
            self.pump()


def shed_error(message: str, retry_after_s: int, status: int = 429) -> errors.APIError:
    """429 (the tenant is over its share) or 503 (the cluster has no capacity for it) with a
    Retry-After hint (router/frontend/ingress.py sends it as the header; gRPC maps 429 to
    RESOURCE_EXHAUSTED, 503 to UNAVAILABLE, and the message says it)."""
    if status == 503:
        error = errors.APIError(503, message, "server_error", None, "server_overloaded")
    else:
        error = errors.APIError(429, message, "rate_limit_error", None, "server_overloaded")
    error.retry_after_s = retry_after_s  # type: ignore[attr-defined]
    return error
