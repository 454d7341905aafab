"""The headroom policy: kvserve's router. Per request, every candidate replica is scored by
the KV it has left after what it already holds and what was promised to it since its last
report, the prefix of this request it caches, and the prefill work queued there
(router/routing/scoring.py has the formulas); the decision is `rank_replicas` below.

Modes, decided among the replicas where q fits (the others come last, least deficit first,
net of the blocks their cached prefix of q saves: any other replica needs those too):
  * "affinity": the owner (highest credit > 0; ties: lower ttft) first, while its prefill
    backlog with q stays within prefill rate x target_ttft_s (router/routing/scoring.py's
    within_target) and its ongoing requests are not more over its share than its gate
    limit (gate_limits: load_gate_threshold, or load_gate_fraction of the share when more).
    Affinity with a principled release: the owner keeps its prefix as long as it can still
    prefill in time, and no longer (no hot spot, no death spiral).
  * "headroom": otherwise, highest rank_key first: the fill term spreads a burst in
    proportion to headroom (reserved at dispatch, so stale reports do not herd it), the
    TTFT term sends work where it is prefilled soonest, partial matches pull gently.
  * "spread": the request opens a session this router has not seen (router/routing/sessions.py):
    among the open replicas within target that cache the most of its prompt (all of them
    for a cold prompt), the one with the fewest active sessions per unit of capacity
    first. A session's future turns are work no report shows while it thinks: placing
    sessions by headroom puts them where sessions are thinking, so they are dealt by count.
  * "load_gate": some replica's ongoing requests (per unit of capacity) are over its share
    by more than its gate limit plus the move's cost (gate_allowances: at most one more
    limit): it comes after the others, least queued first. KV usage alone hides such a
    queue (an engine capped by max_num_seqs queues while its blocks look free). The move
    cost (move_costs) is the prompt a move recomputes, in mean requests' worth of
    prefill: moving an agentic turn off its session's replica recomputes its whole history.
  * "pow2": no replica has fresh stats, or the request has no token ids: power of two
    choices on queue length. Stale stats never refuse traffic: stale replicas are ranked
    by power of two after the fitting fresh ones, before the non-fitting ones.

Capacity weights: a replica reports capacity_weight (its device's throughput relative to
the reference device that params.prefill_tokens_per_s describes) and optionally its own
measured prefill_tokens_per_s; the TTFT term and the queue gate divide by them, so a
replica twice as fast takes twice the work.

Reservations (router/routing/reservations.py via router/routing/routing_view.py): a request's need, its
uncached prompt tokens and its decode blocks are reserved on its top-ranked replica at
choice time, moved if Serve sends it elsewhere, released on completion, and stop counting
once a report taken report_lag_s after the dispatch shows the request.

The policy keeps these in a routing view (router/routing/routing_view.py: private, or
shared by every router through Redis), learns which replica got which prefix and which
replica served each session last (router/routing/sessions.py, which also counts each
replica's active sessions for new ones), and the mean uncached prompt a dispatch carries
(the load gate's unit of move cost).
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from router.routing.types import RoutingParams, ReplicaKey, ReplicaReport, ReplicaView, RequestProfile, is_fresh, power_of_two
from router.routing.policies.base import RoutingRequest
from router.routing.scoring import (
    Ranking,
    ReplicaScore,
    decode_blocks,
    gate_allowances,
    load_excess,
    score_replica,
)
from router.routing.routing_view import LocalRoutingView, RoutingView
from router.routing.sent_adapters import SentAdapters
from router.routing.sessions import SessionTable

# Ledger housekeeping at most this often (as router/routing/serve_router.py).
_PRUNE_INTERVAL_S = 1.0
# Sessions remembered for soft affinity (least recently used forgotten first).
_MAX_SESSIONS = 1 << 16
# Weight of one dispatch in the mean uncached prompt tokens (an exponential average over
# roughly the last 1/_WORK_ALPHA dispatches: follows a workload's shift within seconds).
_WORK_ALPHA = 0.02



MODE_AFFINITY = "affinity"
MODE_HEADROOM = "headroom"
MODE_SPREAD = "spread"
MODE_LOAD_GATE = "load_gate"
MODE_POW2 = "pow2"
# Every candidate reported itself unhealthy: none is offered (Serve backs off and retries,
# by which time the broken replica has been replaced).
MODE_NONE_HEALTHY = "none_healthy"


class HeadroomPolicy:
    name = "headroom"

    def __init__(self, params: RoutingParams | None = None, seed: int = 0, view: RoutingView | None = None) -> None:
        self.params = params or RoutingParams()
        # The routing view (router/routing/routing_view.py): private unless the caller shares one
        # between routers (Redis under Serve, one object in the simulator).
        self.ledger: RoutingView = view if view is not None else LocalRoutingView(self.params.report_lag_s)
        self._rng = random.Random(seed)
        self._last_prune_s = -float("inf")
        self.last_mode = ""  # one of the MODE_* above
        # The last decision's prefix credit: leading prompt blocks counted as cached on each
        # fresh replica (reported or hinted), and when (for tests and debugging).
        self.last_credited: dict[ReplicaKey, int] = {}
        self.last_decided_at = 0.0
        self._block_size: int | None = None  # the replicas' KV block size, from their reports
        # session id -> the replica that served it last (soft affinity), and active sessions
        # per replica (new sessions spread by them).
        self.sessions = SessionTable(self.params.session_idle_s, _MAX_SESSIONS)
        # Mean uncached prompt tokens per dispatched request (0 until the first one).
        self.request_tokens = 0.0
        self.sent_adapters = SentAdapters()  # LoRA adapters sent since each replica's report

    def _view(self, view: ReplicaView) -> ReplicaView:
        report = view.report
        if report is not None:
            self.ledger.observe_report(view.key, report.timestamp)
            report = self.sent_adapters.with_unseen(view.key, report)
        unreflected = self.ledger.unreflected(view.key)
        return replace(view, report=report, unreflected_blocks=unreflected.blocks, unreflected_requests=unreflected.requests,
                       unreflected_prefill_tokens=unreflected.prefill_tokens,
                       unreflected_decode_blocks=unreflected.decode_blocks)

    def _hints(self, request: RoutingRequest, views: Sequence[ReplicaView]) -> dict[ReplicaKey, int]:
        """Prefix owners routers learned from their dispatches, at the reports' block size."""
        bs = next((v.report.block_size for v in views if v.report is not None), None)
        if bs is None:
            return {}
        self._block_size = bs  # on_dispatch learns the prefix at this block size
        # A replica whose cache started empty since (cleared, restarted: its report's
        # kv_since) no longer holds what routers sent it before.
        not_before = {v.key: v.report.kv_since for v in views if v.report is not None and v.report.kv_since > 0}
        return self.ledger.prefix_owner_hints(request.profile.block_hashes(bs), not_before)

    def rank(self, request: RoutingRequest, views: Sequence[ReplicaView], now: float) -> list[ReplicaKey]:
        if now - self._last_prune_s >= _PRUNE_INTERVAL_S:
            self._last_prune_s = now
            self.ledger.prune(now, None, self.params.unconfirmed_ttl_s, self.params.reservation_ttl_s)
        session = counts = None
        if request.session_id is not None:
            active = self.sessions.active_counts(now)  # expires idle sessions first
            session = self.sessions.replica_of(request.session_id)
            counts = active if session is None else None  # only a new session is spread
        seen = [self._view(v) for v in views]  # the reports reach the view before its hints are read
        context = RankContext(hints=self._hints(request, views), session_replica=session, session_counts=counts,
                              request_tokens=self.request_tokens)
        ranking = rank_replicas(request.profile, seen, self.params, now, self._rng, context)
        self.last_mode = ranking.mode
        self.last_credited = {k: s.cached_blocks for k, s in ranking.scores.items()}
        self.last_decided_at = now
        if ranking.order:
            top = ranking.order[0]
            self.ledger.reserve(request.request_id, top, ranking.need_blocks, now,
                                prefill_tokens=dict(ranking.prefill_tokens), decode_blocks=ranking.decode_blocks)
            tokens = ranking.prefill_tokens.get(top, request.prompt_len)
            self.request_tokens = tokens if self.request_tokens == 0 else (
                self.request_tokens + _WORK_ALPHA * (tokens - self.request_tokens))
        return list(ranking.order)

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaKey, now: float) -> None:
        self.ledger.routed(request.request_id, replica)
        if request.lora_name is not None:
            self.sent_adapters.sent(replica, request.lora_name, now)
        report_bs = self._block_size
        if report_bs is not None:
            self.ledger.learn_prefix(replica, request.profile.block_hashes(report_bs), now)
        if request.session_id is not None:
            self.sessions.touch(request.session_id, replica, now)

    def on_complete(self, request_id: str, replica: ReplicaKey, now: float) -> None:
        self.ledger.complete(request_id, replica)

    def on_report(self, replica: ReplicaKey, report: ReplicaReport, now: float) -> None:
        self._block_size = report.block_size
        self.ledger.observe_report(replica, report.timestamp)


def _owner(fitting: Sequence[ReplicaScore]) -> ReplicaScore | None:
    """The replica with the most credit (> 0), fewest predicted seconds on ties."""
    best = None
    for s in fitting:
        if s.credit > 0 and (best is None or (s.credit, -s.ttft_s) > (best.credit, -best.ttft_s)):
            best = s
    return best


def _least_sessions(open_: Sequence[ReplicaScore], session_counts: Mapping[ReplicaKey, int],
                    index: Mapping[ReplicaKey, int]) -> ReplicaScore | None:
    """The open replica within target with the fewest active sessions per unit of capacity
    (ties: higher rank_key), when every open replica caches as much of the prompt as any
    (a cold prompt, or a system prompt all of them hold); else None. A prompt some replica
    caches more of has been served before, whatever this router's own session table says:
    another router may have served its session (each sees only the turns sent through it),
    or it shares a tenant's prefix with that replica only; affinity and the headroom ranking
    weigh that cache against the queue, as for a known session, where a count would deal
    the request to a replica that recomputes the prefix."""
    if not open_ or len({s.cached_blocks for s in open_}) > 1:
        return None
    ready = [s for s in open_ if s.within_target]
    if not ready:
        return None
    return min(ready, key=lambda s: (session_counts.get(s.key, 0) / s.capacity_weight, -s.rank_key, index[s.key]))


@dataclass(frozen=True)
class RankContext:
    """What the router knows about one request beyond the replicas' reports."""

    # Leading prompt blocks routers sent to each replica (at the fresh reports' block size).
    hints: Mapping[ReplicaKey, int] = field(default_factory=dict)
    # The replica that served the request's session last.
    session_replica: ReplicaKey | None = None
    # Active sessions per replica: given only when the request opens a session (spread).
    session_counts: Mapping[ReplicaKey, int] | None = None
    # The mean uncached prompt tokens per dispatched request (the load gate's move cost
    # is counted in it).
    request_tokens: float = 0.0


def rank_replicas(
    request: RequestProfile | None,
    views: Sequence[ReplicaView],
    params: RoutingParams,
    now: float,
    rng: random.Random,
    context: RankContext | None = None,
) -> Ranking:
    """Rank the candidate replicas for one request, best first.

    A replica whose last report says it is unhealthy is never offered, however old that
    report. Without a fresh report, or without the request's token ids, the healthy
    replicas go by power of two choices on queue length. Otherwise: first the fresh
    replicas where the request fits, those within their load gate in the order of the
    mode (spread, affinity or headroom: the module's docstring) and then those past it,
    least queued first; then the stale replicas by power of two choices; last the fresh
    ones where it does not fit, best score first."""
    context = context or RankContext()
    # Candidate filtering: the healthy replicas, fresh ones scored.
    healthy = [v for v in views if v.report is None or v.report.healthy]
    if not healthy:
        return Ranking(order=(), mode=MODE_NONE_HEALTHY, need_blocks={}, scores={})
    fresh = [v for v in healthy if is_fresh(v.report, now, params)]
    if request is None or not fresh:
        return _power_of_two_ranking(request, healthy, params, rng)
    stale = [v for v in healthy if not is_fresh(v.report, now, params)]
    index = {v.key: i for i, v in enumerate(healthy)}
    scores = [score_replica(request, v, params, context.hints.get(v.key, 0), v.key == context.session_replica)
              for v in fresh]

    # Gating and ordering.
    fitting, mode = _order_fitting(scores, params, context, index)
    # Least deficit first, net of the cached prefix: any other replica needs those blocks too.
    not_fitting = sorted((s for s in scores if not s.fits),
                         key=lambda s: (-(s.score + s.cached_pool_blocks), s.queue_depth, index[s.key]))
    order = [s.key for s in fitting] + power_of_two(stale, rng) + [s.key for s in not_fitting]

    # The ranking: what to reserve on whichever replica takes the request.
    need = {s.key: s.need_blocks for s in scores}
    prefill = {s.key: s.uncached_tokens for s in scores}
    for v in stale:
        if v.report is not None:
            need[v.key] = v.report.request_blocks(request, v.report.expected_output_tokens(params))
            prefill[v.key] = request.prompt_len
    # The ledger keeps one decode figure per request: the top-ranked fresh replica's forecast.
    top = {v.key: v.report for v in fresh}.get(order[0]) or fresh[0].report
    assert top is not None
    return Ranking(order=tuple(order), mode=mode, need_blocks=need, scores={s.key: s for s in scores},
                   prefill_tokens=prefill,
                   decode_blocks=decode_blocks(request, top.block_size, top.expected_output_tokens(params), top))


def _power_of_two_ranking(request: RequestProfile | None, views: Sequence[ReplicaView], params: RoutingParams,
                          rng: random.Random) -> Ranking:
    """Power of two choices over `views` (no fresh report, or no token ids), each reported
    replica's need reserved in its own blocks: a report's block size and KV geometry,
    however old, are still right."""
    need = {}
    if request is not None:
        for v in views:
            if v.report is not None:
                need[v.key] = v.report.request_blocks(request, v.report.expected_output_tokens(params))
    return Ranking(order=tuple(power_of_two(views, rng)), mode=MODE_POW2, need_blocks=need, scores={},
                   prefill_tokens={k: request.prompt_len for k in need} if request is not None else {})


def _order_fitting(scores: Sequence[ReplicaScore], params: RoutingParams, context: RankContext,
                   index: Mapping[ReplicaKey, int]) -> tuple[list[ReplicaScore], str]:
    """The fresh replicas where the request fits, best first, and the decision's mode.

    Replicas with more excess over their share than their gate limit (gate_limits) plus
    what moving the request away from them costs (move_costs) take no affinity and come
    after the others, least loaded first."""
    excess, allowed = load_excess(scores), gate_allowances(scores, params, context.request_tokens)
    fitting = [s for s in scores if s.fits]
    open_ = [s for s in fitting if excess[s.key] <= allowed[s.key]]
    gated = [s for s in fitting if excess[s.key] > allowed[s.key]]
    owner = _owner([s for s in open_ if s.within_target])
    spread = _least_sessions(open_, context.session_counts, index) if context.session_counts is not None else None
    # A cold request (no replica caches any of it, no session, its LoRA adapter as far
    # from every replica) also balances by requests: load above or below a replica's share
    # tilts the order, a gate's worth of excess weighing one whole rank_key unit. Not when
    # some replica holds part of the prompt or the adapter: there the tilt would outweigh
    # what that replica saves and throw the hit rate away. A spread in proportion to
    # size has no excess either way: the fill term rules.
    warm = any(s.credit > 0 for s in scores) or len({s.adapter_s for s in scores}) > 1
    tilt = 0.0 if warm else 1.0 / max(params.load_gate_threshold, 1.0)
    first = spread or owner
    open_.sort(key=lambda s: (s is not first, -(s.rank_key - tilt * excess[s.key]), -s.score, index[s.key]))
    gated.sort(key=lambda s: (s.queue_depth, -s.rank_key, index[s.key]))
    mode = (MODE_SPREAD if spread is not None else MODE_AFFINITY if owner is not None
            else MODE_LOAD_GATE if gated else MODE_HEADROOM)
    return open_ + gated, mode
