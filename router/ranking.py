"""The KV-headroom ranking, as pure functions (no Ray import; unit-tested alone).

A router (router/request_router.py under Serve, router/policies/headroom.py anywhere) feeds
this module what it can see: each replica's last routing-stats report (seconds old), the
work it (or, with a shared routing view, every router) dispatched there since, the prefix
owners routers learned from their dispatches, and the session's last replica. It gets back
a ranked list of replicas. Per fresh replica r and request q (KV in r's blocks, work in
r's prompt tokens; router/work.py has the work model):

    cached(q, r)   = max(leading prompt blocks in r's reported prefix_hashes,
                         leading prompt blocks routers sent to r (hints)),
                     at most cacheable(q) = (prompt_len - 1) // block_size
    expected(q, r) = min(max_tokens, r's reported mean_output_tokens, or
                         params.expected_output_tokens while r has observed none)
    need(q, r)     = blocks(prompt_len + expected(q, r)) - cached
    capacity(r)    = max(floor(free_blocks * headroom_share) - reserved_blocks
                         - decode_growth_blocks, 0)
                     (reserved: the waiting prompts' blocks; growth: what the requests
                     already there will still grow into, worker/routing_report.py)
    score(q, r)    = capacity - unreflected_blocks - need          # >= 0: the request fits
    credit(q, r)   = prefix_weight * cached / cacheable             # partial match, partial credit
                     + session_weight if r served q's session last  # a soft preference
    ttft(q, r)     = (prefill backlog(r) + uncached(q, r)) / prefill rate(r)   (router/work.py)
    rank_key(q, r) = score / capacity + credit - ttft / target_ttft_s

Modes, decided among the replicas where q fits (the others come last, least deficit first):
  * "affinity": the owner (highest credit > 0; ties: lower ttft) first, while its prefill
    backlog with q stays within prefill rate x target_ttft_s (router/work.py) and its
    ongoing requests are not more over its share than its gate limit (gate_limits:
    load_gate_threshold, or load_gate_fraction of the share when more). Affinity with a
    principled release: the owner keeps its prefix as long as it can still prefill in
    time, and no longer (no hot spot, no death spiral).
  * "headroom": otherwise, highest rank_key first: the fill term spreads a burst in
    proportion to headroom (reserved at dispatch, so stale reports do not herd it), the
    TTFT term sends work where it is prefilled soonest, partial matches pull gently.
  * "spread": the request opens a session this router has not seen (router/sessions.py):
    among the open replicas within target that cache the most of its prompt (all of them
    for a cold prompt), the one with the fewest active sessions per unit of capacity
    first. A session's future turns are work no report shows while it thinks; placing
    sessions by headroom put them where sessions were thinking (agentic, 4 replicas, 65
    req/s: 28/31/18/23 sessions, TTFT p99 2.7 s; dealt by count 25/24/23/28, 0.84 s).
  * "load_gate": some replica's ongoing requests (per unit of capacity) are over its share
    by more than its gate limit plus the move's cost (gate_allowances: at most one more
    limit): it comes after the others, least queued first. KV usage alone hides such a
    queue (an engine capped by max_num_seqs queues while its blocks look free). The move
    cost (move_costs) is the prompt a move recomputes, in mean requests' worth of
    prefill: moving an agentic turn off its session's replica recomputes its whole
    history (the count-only gate moved 73 of 588 turns, which carried 45% of all uncached
    prefill, TTFT p99 3.7 s).
  * "pow2": no replica has fresh stats, or the request has no token ids: power of two
    choices on queue length. Stale stats never refuse traffic: stale replicas are ranked
    by power of two after the fitting fresh ones, before the non-fitting ones.

Capacity weights: a replica reports capacity_weight (its device's throughput relative to
the reference device that params.prefill_tokens_per_s describes) and optionally its own
measured prefill_tokens_per_s; the TTFT term and the queue gate divide by them, so a
replica twice as fast takes twice the work.

Reservations (router/reservations.py via router/routing_view.py): a request's need, its
uncached prompt tokens and its decode blocks are reserved on its top-ranked replica at
choice time, moved if Serve sends it elsewhere, released on completion, and stop counting
once a report taken report_lag_s after the dispatch shows the request.

Decode growth: a request's decode blocks count against its replica from dispatch (the
reservation's need) until a report reflects it, and from then on in the report's
decode_growth_blocks (forecast per request from its max_tokens and the replica's observed
output lengths), so a replica whose running requests are young looks as full as it will be.
Growth is subtracted whole although free_blocks counts evictable cached blocks as free:
growth takes blocks from that pool either way (an evicted prefix is no longer a hit).
Measured (benchmarks.routing --quick, 4 simulated H200s; routing-quick-2026-12-01-1356.txt
before, -1621.txt after): goodput unchanged (b2b 60.62, agentic 53.12 req/s), TTFT p99 at 80%
of round robin's goodput lower (b2b 0.223 -> 0.114 s, agentic 0.467 -> 0.205 s); KV is not
what binds there (a median report ~98% free), so the growth term mostly sharpens the fill
term rather than closing replicas.

Known limits: the growth forecast is an expectation per request; blocks that requests free
when they finish, before the routed one does, are not credited (a replica whose requests
finish soon looks fuller than it will be over the routed request's life). Reused cached
blocks that were idle also leave the free pool, which the prefix credit does not model.
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from router import work
from router.headroom import (
    HeadroomParams,
    ReplicaKey,
    ReplicaReport,
    ReplicaView,
    RequestProfile,
    is_fresh,
    power_of_two,
)

MODE_AFFINITY = "affinity"
MODE_HEADROOM = "headroom"
MODE_SPREAD = "spread"
MODE_LOAD_GATE = "load_gate"
MODE_POW2 = "pow2"
# Every candidate reported itself unhealthy: none is offered (Serve backs off and retries,
# by which time the broken replica has been replaced).
MODE_NONE_HEALTHY = "none_healthy"


@dataclass(frozen=True)
class ReplicaScore:
    key: ReplicaKey
    fits: bool
    score: int
    capacity: int
    need_blocks: int
    cached_blocks: int
    credit: float
    uncached_tokens: int
    prefill_backlog: int  # prompt tokens queued there (report + unreflected)
    prefill_rate: float
    ttft_s: float  # predicted prefill wait, this request included
    within_target: bool
    rank_key: float
    num_waiting: int
    unreflected_requests: int
    capacity_weight: float = 1.0
    ongoing: int = 0  # requests there now: Serve's queue length, or the report's + sent since

    @property
    def queue_depth(self) -> float:
        """Requests there per unit of capacity."""
        return self.ongoing / self.capacity_weight


@dataclass(frozen=True)
class Ranking:
    order: tuple[ReplicaKey, ...]
    mode: str
    # Blocks to reserve if the request ends up on that replica (all candidates, so a
    # reservation can move when Serve picks a lower rank).
    need_blocks: Mapping[ReplicaKey, int]
    scores: Mapping[ReplicaKey, ReplicaScore]
    # Uncached prompt tokens and decode blocks, per candidate (the ledger's work figures).
    prefill_tokens: Mapping[ReplicaKey, int] = field(default_factory=dict)
    decode_blocks: int = 0


def decode_blocks(request: RequestProfile, block_size: int, expected_output_tokens: int) -> int:
    """Blocks the request's expected decode adds beyond its prompt's."""
    return request.total_blocks(block_size, expected_output_tokens) - -(-request.prompt_len // block_size)


def report_headroom(report: ReplicaReport, headroom_share: float = 1.0) -> int:
    """Blocks a report leaves for new requests (capacity before the 0 floor): this router's
    share of the free blocks, less its waiting prompts' reservations and the growth of its
    requests. Admission control (router/admission.py) judges with the same figure (at the
    whole share), less the same unreflected blocks, so the two agree on what fits."""
    return math.floor(report.free_blocks * headroom_share) - report.reserved_blocks - report.decode_growth_blocks


def score_replica(
    request: RequestProfile,
    view: ReplicaView,
    params: HeadroomParams,
    hinted_blocks: int = 0,
    session: bool = False,
) -> ReplicaScore:
    """The score of one replica with fresh stats (see the module docstring). `hinted_blocks`:
    leading prompt blocks routers sent there (router/routing_view.py's prefix hints);
    `session`: it served this request's session last."""
    report = view.report
    assert report is not None
    bs = report.block_size
    cacheable = request.cacheable_blocks(bs)
    cached = max(request.cached_blocks(bs, report.prefix_hashes), min(hinted_blocks, cacheable))
    need = max(request.total_blocks(bs, report.expected_output_tokens(params)) - cached, 0)
    capacity = max(report_headroom(report, params.headroom_share), 0)
    score = capacity - view.unreflected_blocks - need
    credit = (params.prefix_weight * cached / cacheable if cacheable else 0.0) + (params.session_weight if session else 0.0)
    fill = score / capacity if capacity > 0 else -math.inf
    rate = work.prefill_rate(report, params)
    backlog = work.prefill_backlog(view)
    uncached = work.uncached_tokens(request, cached, bs)
    ttft = work.predicted_ttft_s(backlog, uncached, rate)
    within = work.within_target(backlog, uncached, rate, params)
    return ReplicaScore(
        key=view.key,
        fits=score >= 0,
        score=score,
        capacity=capacity,
        need_blocks=need,
        cached_blocks=cached,
        credit=credit,
        uncached_tokens=uncached,
        prefill_backlog=backlog,
        prefill_rate=rate,
        ttft_s=ttft,
        within_target=within,
        # Past its target the owner loses affinity but keeps its credit here: the reported
        # queue counts waiting prompts whole (cached prefixes too), so "past target" is
        # often less than it looks; dropping the credit cost agentic its hit rate (0.72 ->
        # 0.62) and the 216 req/s SLO (benchmarks/results/policy-balance-2026-12-01.txt).
        rank_key=fill + credit - ttft / params.target_ttft_s,
        num_waiting=report.num_waiting,
        unreflected_requests=view.unreflected_requests,
        capacity_weight=report.capacity_weight,
        ongoing=max(view.queue_len, report.num_running + report.num_waiting + view.unreflected_requests),
    )


def load_shares(scores: Sequence[ReplicaScore]) -> dict[ReplicaKey, float]:
    """Each replica's share of all ongoing requests: its headroom times its capacity weight
    over everyone's (equal shares when no replica has headroom)."""
    weights = {s.key: s.capacity * s.capacity_weight for s in scores}
    total_weight = sum(weights.values())
    total = sum(s.ongoing for s in scores)
    return {s.key: total * (weights[s.key] / total_weight if total_weight > 0 else 1.0 / len(scores)) for s in scores}


def load_excess(scores: Sequence[ReplicaScore]) -> dict[ReplicaKey, float]:
    """Requests ongoing at each replica beyond its share of all ongoing requests: a burst
    spread in proportion to headroom (and speed) has no excess; affinity piling onto one
    replica has."""
    shares = load_shares(scores)
    return {s.key: s.ongoing - shares[s.key] for s in scores}


def gate_limits(scores: Sequence[ReplicaScore], params: HeadroomParams) -> dict[ReplicaKey, float]:
    """The excess each replica may carry before the load gate closes on it: load_gate_threshold
    requests, or load_gate_fraction of its share when that is more. A fixed count alone
    closed the gate on the ordinary spread of a busy cluster (b2b at 60 req/s on 4 replicas of
    256 slots: ~120 ongoing each, 8 over is 7%), which turned half the decisions into cache
    misses (hit 0.81 -> 0.56) and the extra prefill into the TTFT it meant to avoid."""
    shares = load_shares(scores)
    return {k: max(params.load_gate_threshold, params.load_gate_fraction * share) for k, share in shares.items()}


def move_costs(scores: Sequence[ReplicaScore], request_tokens: float) -> dict[ReplicaKey, float]:
    """What sending the request away from each replica adds, in requests' worth of prefill:
    the prompt tokens it caches beyond the best other replica, over `request_tokens` (the
    mean uncached prompt tokens of the requests dispatched; 0: no move costs anything)."""
    if request_tokens <= 0 or len(scores) < 2:
        return {s.key: 0.0 for s in scores}
    ordered = sorted(s.uncached_tokens for s in scores)
    least, second = ordered[0], ordered[1]
    return {s.key: max((second if s.uncached_tokens == least else least) - s.uncached_tokens, 0) / request_tokens
            for s in scores}


def gate_allowances(scores: Sequence[ReplicaScore], params: HeadroomParams, request_tokens: float) -> dict[ReplicaKey, float]:
    """The excess each replica may carry before the gate sends this request elsewhere: its
    gate limit plus the move's cost, the cost at most one more limit. Uncapped, a stream of
    small cached requests (a mean of 8 uncached tokens) priced a 512-token prefix at 64
    requests and the gate never closed on its owner: the hot spot the gate bounds would be
    unbounded again. Capped, an owner carries at most twice its limit over its share."""
    limits, moves = gate_limits(scores, params), move_costs(scores, request_tokens)
    return {k: limit + min(moves[k], limit) for k, limit in limits.items()}


def load_gate_tripped(scores: Sequence[ReplicaScore], params: HeadroomParams) -> bool:
    """True when some replica carries more excess than its gate limit."""
    if len(scores) < 2:
        return False
    excess, limits = load_excess(scores), gate_limits(scores, params)
    return any(excess[k] > limits[k] for k in excess)


def _owner(fitting: Sequence[ReplicaScore]) -> ReplicaScore | None:
    """The replica with the most credit (> 0), fewest predicted seconds on ties."""
    best = None
    for s in fitting:
        if s.credit > 0 and (best is None or (s.credit, -s.ttft_s) > (best.credit, -best.ttft_s)):
            best = s
    return best


def _least_sessions(ready: Sequence[ReplicaScore], session_counts: Mapping[ReplicaKey, int],
                    index: Mapping[ReplicaKey, int]) -> ReplicaScore | None:
    """Among the replicas that cache the most of the prompt, the one with the fewest active
    sessions per unit of capacity (ties: higher rank_key). A new session that shares a
    prefix with one replica only (a tenant's system prompt) still goes to that replica."""
    if not ready:
        return None
    most = max(s.cached_blocks for s in ready)
    return min((s for s in ready if s.cached_blocks == most),
               key=lambda s: (session_counts.get(s.key, 0) / s.capacity_weight, -s.rank_key, index[s.key]))


def rank_replicas(
    request: RequestProfile | None,
    views: Sequence[ReplicaView],
    params: HeadroomParams,
    now: float,
    rng: random.Random,
    hints: Mapping[ReplicaKey, int] | None = None,
    session_replica: ReplicaKey | None = None,
    session_counts: Mapping[ReplicaKey, int] | None = None,
    request_tokens: float = 0.0,
) -> Ranking:
    """Rank the candidate replicas for one request (best first). A replica whose last
    report says it is unhealthy is never offered, however old that report. `hints`:
    leading prompt blocks routers sent to each replica (at the fresh reports' block size);
    `session_replica`: the replica that served the request's session last;
    `session_counts`: active sessions per replica, given when the request opens a session
    (spread); `request_tokens`: the mean uncached prompt tokens per dispatched request
    (the load gate's move cost is counted in it)."""
    views = [v for v in views if v.report is None or v.report.healthy]
    if not views:
        return Ranking(order=(), mode=MODE_NONE_HEALTHY, need_blocks={}, scores={})
    fresh = [v for v in views if is_fresh(v.report, now, params)]
    stale = [v for v in views if not is_fresh(v.report, now, params)]

    if request is None or not fresh:
        need = {}
        if request is not None:
            # No fresh block size to go by: a report's block size, however old, is still right.
            for v in views:
                if v.report is not None:
                    need[v.key] = request.total_blocks(v.report.block_size, v.report.expected_output_tokens(params))
        return Ranking(order=tuple(power_of_two(views, rng)), mode=MODE_POW2, need_blocks=need, scores={},
                       prefill_tokens={k: request.prompt_len for k in need} if request is not None else {})

    hints = hints or {}
    index = {v.key: i for i, v in enumerate(views)}
    scores = [score_replica(request, v, params, hints.get(v.key, 0), v.key == session_replica) for v in fresh]
    fitting = [s for s in scores if s.fits]
    not_fitting = [s for s in scores if not s.fits]

    # Replicas with more excess over their share than their gate limit (gate_limits) plus
    # what moving the request away from them costs (move_costs) take no affinity and come
    # after the others, least loaded first.
    excess, allowed = load_excess(scores), gate_allowances(scores, params, request_tokens)
    open_ = [s for s in fitting if excess[s.key] <= allowed[s.key]]
    gated = [s for s in fitting if excess[s.key] > allowed[s.key]]
    ready = [s for s in open_ if s.within_target]
    owner = _owner(ready)
    spread = _least_sessions(ready, session_counts, index) if session_counts is not None else None
    # A cold request (no replica caches any of it, no session) also balances by requests:
    # load above or below a replica's share tilts the order, a gate's worth of excess
    # weighing one whole rank_key unit (bursty, 4 replicas, 144 req/s: goodput 65.37 ->
    # 67.54). Not when some replica holds part of the prompt: there the tilt outweighed the
    # partial credit and cost agentic its hit rate (0.72 -> 0.62) and the 216 req/s SLO
    # (benchmarks/results/policy-balance-2026-12-01.txt). A spread in proportion to headroom
    # has no excess either way: the fill term rules.
    tilt = 0.0 if any(s.credit > 0 for s in scores) else 1.0 / max(params.load_gate_threshold, 1.0)
    first = spread or owner
    open_.sort(key=lambda s: (s is not first, -(s.rank_key - tilt * excess[s.key]), -s.score, index[s.key]))
    gated.sort(key=lambda s: (s.queue_depth, -s.rank_key, index[s.key]))
    mode = (MODE_SPREAD if spread is not None else MODE_AFFINITY if owner is not None
            else MODE_LOAD_GATE if gated else MODE_HEADROOM)
    fitting = open_ + gated
    not_fitting.sort(key=lambda s: (-s.score, s.queue_depth, index[s.key]))

    order = [s.key for s in fitting] + power_of_two(stale, rng) + [s.key for s in not_fitting]
    need = {s.key: s.need_blocks for s in scores}
    prefill = {s.key: s.uncached_tokens for s in scores}
    for v in stale:
        if v.report is not None:
            need[v.key] = request.total_blocks(v.report.block_size, v.report.expected_output_tokens(params))
            prefill[v.key] = request.prompt_len
    # The ledger keeps one decode figure per request: the top-ranked fresh replica's forecast.
    top = {v.key: v.report for v in fresh}.get(order[0]) or fresh[0].report
    assert top is not None
    return Ranking(order=tuple(order), mode=mode, need_blocks=need, scores={s.key: s for s in scores},
                   prefill_tokens=prefill,
                   decode_blocks=decode_blocks(request, top.block_size, top.expected_output_tokens(params)))
