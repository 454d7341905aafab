"""Whether a request can go to the workers now: the arithmetic of admission control
(router/routing/admission.py holds, sheds and lets requests go by it).

"Can some replica take it" (`judge`), from the routing stats the request router in this
process holds (the same reports it ranks with), the work its routing view says was sent to
each replica since (u(r): router/routing/reservations.py's Unreflected; none for a baseline router)
and what this ingress admitted that the router has not sent yet:

    avail(r) = free_blocks(r) - reserved_blocks(r) - decode_growth_blocks(r) - u.blocks(r)
               (router/routing/scoring.py's report_headroom and score, the same arithmetic; need:
               prompt + expected decode blocks at r's observed mean output length, less the
               blocks r has cached; growth: what r's requests will still grow into; u.blocks:
               the needs reserved there, their decode blocks included)
    fits(r)  = avail(r) >= need(q, r)
    slots(r) = max(free_seqs(r) + max_waiting_per_replica - num_waiting(r) - u.requests(r), 0)
               where fits(r), else 0 (free_seqs: max_num_seqs(r) - num_running(r), its free
               running slots)
    admit   <=> sum_r slots(r) > pending                          (requests, see below)
            and sum_{r fits} avail(r) - pending_blocks >= min_r need(q, r)

  `pending`: requests this controller let go that are in flight towards some replica
  (which one only the router knows) and counted nowhere else yet. With a view, an admission
  stops counting once the router has sent it (the view counts it from then on): the
  router's send count (routed_total) is matched to admissions in grant order. Without one,
  or as a safety net, it stops counting once its dispatch is reflected (admitted at t,
  every replica reported at t + report_lag_s or later).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.routing.reservations import NOTHING, Unreflected
from router.routing.scoring import report_headroom
from router.routing.types import ReplicaReport, RequestProfile, RoutingParams, is_fresh

REASON_FITS = "fits"
REASON_FULL = "full"
REASON_STALE = "stale"  # some replica without fresh stats: pow2 fallback, never refuse
REASON_NO_ROUTER = "no_router"  # no kvserve router (yet): nothing to judge with
REASON_IDLE = "idle"  # nothing of this ingress in flight
REASON_OFF = "off"
REASON_TOO_LARGE = "too_large"  # more blocks than any replica has at all: the engine answers it
REASON_OVERTAKES = "overtakes"  # a better band than work in flight: the engines put it first


@dataclass(frozen=True)
class RoutingSnapshot:
    """What the request router in this process knows of the worker replicas right now."""

    reports: tuple[ReplicaReport | None, ...]  # one per live replica; None: no report yet
    params: RoutingParams  # the router's (fallback decode tokens, staleness, report lag)
    now: float  # the reports' clock (time.time())
    # The router's routing view, aligned with `reports`: the work promised to each replica
    # since its report (shared view: by every ingress's router). Empty: the router keeps none.
    unreflected: tuple[Unreflected, ...] = ()
    # Engine requests (generate calls) this process's router has sent so far, the ones its
    # view counts; None when the router keeps no view.
    routed_total: int | None = None


class SnapshotSource(Protocol):
    def snapshot(self) -> RoutingSnapshot | None:
        """None while there is no kvserve router to ask (Serve's own router, or none yet)."""
        ...


@dataclass(frozen=True)
class Verdict:
    admit: bool
    reason: str
    # Prompt tokens the best-placed fresh replica reports cached, summed over the request's
    # engine inputs: the prefix hit routing could get (metrics: predicted vs realised).
    predicted_cached_tokens: int = 0
    need_blocks: int = 0  # the request's blocks on the replica where it needs fewest


@dataclass
class _Pending:
    admitted_at: float
    num_requests: int
    blocks: int
    # Engine requests granted by this controller up to and including this one's: it has been
    # sent once the router has sent that many of them (AdmissionController._forget_dispatched).
    granted_through: int = 0


def judge(
    profiles: Sequence[RequestProfile],
    snapshot: RoutingSnapshot | None,
    pending: Sequence[_Pending],
    max_waiting_per_replica: int,
) -> Verdict:
    """Whether a request (its engine inputs' profiles) can go now; see the module docstring."""
    if snapshot is None:
        return Verdict(True, REASON_NO_ROUTER)
    params = snapshot.params
    unreflected = snapshot.unreflected or (NOTHING,) * len(snapshot.reports)
    live = [(r, u) for r, u in zip(snapshot.reports, unreflected, strict=True) if r is None or r.healthy]
    reports = [r for r, _ in live]
    if not reports or any(not is_fresh(r, snapshot.now, params) for r in reports):
        return Verdict(True, REASON_STALE)
    slots = 0
    free = 0
    min_need: int | None = None
    predicted = 0
    for profile in profiles:
        best = 0
        for r in reports:
            assert r is not None  # fresh
            best = max(best, profile.cached_blocks(r.block_size, r.prefix_hashes) * r.block_size)
        predicted += best
    too_large = True
    for r, u in live:
        assert r is not None
        need = 0
        for profile in profiles:
            cached = profile.cached_blocks(r.block_size, r.prefix_hashes)
            need += max(r.request_blocks(profile, r.expected_output_tokens(params)) - r.prefix_blocks(cached), 0)
        too_large = too_large and need > r.total_blocks
        # What its waiting prompts, the growth of its requests and the work sent there since
        # its report leave: router/routing/scoring.py's score, whole share. Not u.decode_blocks too:
        # a reservation's blocks are its need, expected decode included.
        available = report_headroom(r) - u.blocks
        if available < need:
            continue
        # Requests sent since the report take its free running slots first, then may wait
        # there too (the router counts them as ongoing): a burst at an idle replica starts
        # at once instead of max_waiting_per_replica requests per report.
        slots += max(r.free_seqs + max_waiting_per_replica - r.num_waiting - u.requests, 0)
        free += available
        min_need = need if min_need is None else min(min_need, need)
    if too_large:  # holding cannot help: let the engine refuse it (400) now
        return Verdict(True, REASON_TOO_LARGE, predicted)
    num_pending = sum(p.num_requests for p in pending)
    pending_blocks = sum(p.blocks for p in pending)
    fits = min_need is not None and slots - num_pending >= len(profiles) and free - pending_blocks >= min_need
    return Verdict(fits, REASON_FITS if fits else REASON_FULL, predicted, min_need or 0)
