"""The KV-headroom routing policy, as pure functions (no Ray import; unit-tested alone).

`router/request_router.py` feeds this module what a Ray Serve request router can see:
each worker replica's last routing-stats report (seconds old), plus the requests this
router has dispatched since. It gets back a ranked list of replicas.

Score of replica r for request q (all counts in KV blocks of r's block size):

    available(r) = floor(free_blocks(r) * headroom_share)
                   - reserved_blocks(r)          # the replica's own waiting queue
                   - unreflected_blocks(r)       # promised by THIS router since r's report
    need(q, r)   = blocks(prompt_len + min(max_tokens, expected_output_tokens))
                   - cached_blocks(q, r)
    score(q, r)  = available(r) - need(q, r)     # >= 0 means "fits"

    cached_blocks(q, r) = leading matches of q's chained full-block hashes in r's
                          reported prefix_hashes (at most (prompt_len - 1) // block_size:
                          the engine always recomputes the last prompt token).

Ranking (mode "headroom"): replicas where the request fits come first, highest rank_key
first (ties: higher score, then candidate order):

    rank_key(q, r) = score(q, r) / capacity(r)                           # fill term
                   + prefix_weight * cached_blocks(q, r) / cacheable(q)  # prefix credit
    capacity(r)    = max(floor(free_blocks(r) * headroom_share) - reserved_blocks(r), 0)
    cacheable(q)   = (prompt_len - 1) // block_size

  The fill term is the fraction of the replica's report-time headroom that would be left
  after this request; capacity 0 gives -inf (the request cannot fit there anyway).

  * Why a fraction: picking the replica that keeps the largest FRACTION of its reported
    headroom, and counting every dispatch against it at once, spreads a burst in
    proportion to headroom (100/200/300 free blocks -> 1:2:3 of the requests). Ranking by
    absolute free blocks would pour the whole burst into the emptiest replica until it
    merely equalled the next one (water-filling), and with stale reports and no
    reservations it would herd everything onto it.
  * Prefix credit is dimensionless: with prefix_weight >= 1 a replica caching the whole
    prompt beats every uncached replica as long as the request fits there; partial
    matches earn partial credit.
  * Replicas where the request does not fit come after every fitting replica (and after
    replicas with stale stats), least deficit first: they are only used when everyone
    better refuses the request (Serve's max_ongoing_requests), never while others fit.

Load gate (mode "load_gate"). KV usage alone hides a long waiting queue (an engine capped
by max_num_seqs queues requests while its blocks look free), and cache affinity alone
builds a hot spot. So:

    depth(r)   = num_waiting(r) + unreflected_requests(r)
    excess(r)  = num_waiting(r) - min_r' num_waiting(r')                # reported queues
               + unreflected_requests(r) - U * capacity(r) / sum(capacity)  # own dispatches
                 (U = sum of unreflected_requests; the second line is the excess over the
                 replica's headroom-proportional share of this router's recent dispatches)
    tripped    = max_r excess(r) > load_gate_threshold

When tripped, fitting replicas are ranked least-loaded first (by depth, then rank_key).
Reported waiting queues are compared absolutely (a queue is compute time to wait behind,
whatever the KV headroom); recent dispatches are compared with the headroom share, so a
burst spread in proportion to headroom never trips the gate by itself, while affinity
piling a burst onto one replica does.

Stale or missing stats (older than stale_after_periods * stats_period_s, or never seen):
those replicas are ranked by power-of-two-choices on queue length (two random ones, the
shorter queue first, then the rest), after the fitting fresh replicas and before the
non-fitting ones. When no replica has fresh stats, or the request carries no token ids
(calls other than `generate`), the whole ranking is power-of-two (mode "pow2").

Reservations (`ReservationLedger`, router/reservations.py): a request's `need` is reserved on its top-ranked
replica at dispatch (choice) time, moved if Serve ends up sending it elsewhere, and
released when it completes. A reservation stops counting (is "reflected") once the replica
reports with a timestamp at least `report_lag_s` after the dispatch: that report already
shows the request (in free_blocks if admitted, in reserved_blocks/num_waiting if queued).

Known limits: a reflected request's future decode growth is not counted (the report's
free_blocks only shows what it holds now); reused cached blocks that were idle also leave
the free pool, which the prefix credit does not model; each router sees only its own
reservations (see router/request_router.py for the multi-router mitigation).
"""
from __future__ import annotations

import math
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

from kv.block_hash import hash_full_blocks

ReplicaKey = Hashable

MODE_HEADROOM = "headroom"
MODE_LOAD_GATE = "load_gate"
MODE_POW2 = "pow2"
# Every candidate reported itself unhealthy: none is offered (Serve backs off and retries,
# by which time the broken replica has been replaced).
MODE_NONE_HEALTHY = "none_healthy"


@dataclass(frozen=True)
class HeadroomParams:
    """Policy parameters (request_router_kwargs of the deployment's RequestRouterConfig)."""

    # Decode tokens counted per request: min(max_tokens, this). Most requests stop well
    # before max_tokens; counting all of it would make every replica look full.
    expected_output_tokens: int = 256
    # Credit for a fully cached prompt, in rank_key units (1.0 = a whole replica's headroom).
    prefix_weight: float = 1.0
    # Requests beyond a replica's headroom-proportional share of queue depth that trip the gate.
    # 4, not 16: with 16 the gate hardly ever tripped at max_num_seqs 16, prefix affinity piled
    # a prefix group on one replica, and benchmarks.router (2026-11-30, idle 2-core box) gave
    # headroom a mean TTFT 1.3-2x pow2's and throughput 0.96-0.98x in 4 of 4 runs; with 4:
    # mean TTFT 0.8-1.3x, throughput 1.006-1.057x, TTFT p99 ratio 0.83-1.99 in 3 runs.
    load_gate_threshold: float = 4.0
    # The period at which replicas report (RequestRouterConfig.request_routing_stats_period_s):
    # `serve_router_config()` sets Serve's period from this field, so the two cannot differ.
    stats_period_s: float = 1.0
    # Stats older than stale_after_periods * stats_period_s are stale.
    stale_after_periods: float = 3.0
    # A report reflects a dispatch only when taken at least this long after it (transit
    # to the replica + clock skew between hosts).
    report_lag_s: float = 0.05
    # Fraction of each replica's free blocks this router may promise. With N router
    # replicas (ingress replicas), 1/N keeps their private views from over-committing.
    headroom_share: float = 1.0
    # Reservations never confirmed by Serve (request cancelled before it was sent) are
    # dropped after this long; any reservation after reservation_ttl_s.
    unconfirmed_ttl_s: float = 60.0
    reservation_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.expected_output_tokens < 0:
            raise ValueError(f"expected_output_tokens must be >= 0, got {self.expected_output_tokens}")
        if self.prefix_weight < 0:
            raise ValueError(f"prefix_weight must be >= 0, got {self.prefix_weight}")
        if self.load_gate_threshold < 0:
            raise ValueError(f"load_gate_threshold must be >= 0, got {self.load_gate_threshold}")
        if self.stats_period_s <= 0 or self.stale_after_periods <= 0:
            raise ValueError("stats_period_s and stale_after_periods must be > 0")
        if self.report_lag_s < 0:
            raise ValueError(f"report_lag_s must be >= 0, got {self.report_lag_s}")
        if not 0.0 < self.headroom_share <= 1.0:
            raise ValueError(f"headroom_share must be in (0, 1], got {self.headroom_share}")
        if self.unconfirmed_ttl_s <= 0 or self.reservation_ttl_s <= 0:
            raise ValueError("unconfirmed_ttl_s and reservation_ttl_s must be > 0")

    @property
    def stale_after_s(self) -> float:
        return self.stale_after_periods * self.stats_period_s

    def serve_router_config(self) -> dict[str, object]:
        """RequestRouterConfig's fields for these parameters (besides the router class):
        Serve's report period is derived from stats_period_s, never set beside it."""
        return {"request_router_kwargs": asdict(self), "request_routing_stats_period_s": self.stats_period_s}

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object]) -> HeadroomParams:
        """Build from request_router_kwargs; unknown keys are an error (typos must not pass)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown KV-headroom router parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ReplicaReport:
    """One routing-stats report (worker.api.RoutingStats), parsed once."""

    free_blocks: int
    total_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_waiting_prompt_tokens: int
    reserved_blocks: int
    prefix_hashes: frozenset[int]
    timestamp: float
    # False once the replica cannot serve (its engine loop stopped, a tensor-parallel rank
    # died): the router stops choosing it at its next report, before Serve's health check
    # replaces it.
    healthy: bool = True

    @classmethod
    def from_stats(cls, stats: Mapping[str, object] | None) -> ReplicaReport | None:
        """None when the replica has not reported yet or the report is malformed."""
        if not stats:
            return None
        try:
            report = cls(
                free_blocks=int(stats["free_blocks"]),  # type: ignore[arg-type]
                total_blocks=int(stats["total_blocks"]),  # type: ignore[arg-type]
                block_size=int(stats["block_size"]),  # type: ignore[arg-type]
                num_running=int(stats.get("num_running", 0)),  # type: ignore[arg-type]
                num_waiting=int(stats.get("num_waiting", 0)),  # type: ignore[arg-type]
                num_waiting_prompt_tokens=int(stats.get("num_waiting_prompt_tokens", 0)),  # type: ignore[arg-type]
                reserved_blocks=int(stats.get("reserved_blocks", 0)),  # type: ignore[arg-type]
                prefix_hashes=frozenset(stats.get("prefix_hashes") or ()),  # type: ignore[arg-type]
                timestamp=float(stats["timestamp"]),  # type: ignore[arg-type]
                healthy=bool(stats.get("healthy", True)),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if report.block_size <= 0:
            return None
        return report


@dataclass
class RequestProfile:
    """What the policy needs of a request: its token ids and max_tokens."""

    prompt_token_ids: Sequence[int]
    max_tokens: int
    _hashes_by_block_size: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks (kv.block_hash), memoised per block size."""
        hashes = self._hashes_by_block_size.get(block_size)
        if hashes is None:
            hashes = hash_full_blocks(self.prompt_token_ids, block_size)
            self._hashes_by_block_size[block_size] = hashes
        return hashes

    def cacheable_blocks(self, block_size: int) -> int:
        """Most prompt blocks a cache hit can cover (the last prompt token is always computed)."""
        return max(self.prompt_len - 1, 0) // block_size

    def cached_blocks(self, block_size: int, prefix_hashes: frozenset[int]) -> int:
        """Leading blocks of the prompt whose chained hash the replica reports as cached."""
        if not prefix_hashes:
            return 0
        limit = self.cacheable_blocks(block_size)
        num = 0
        for h in self.block_hashes(block_size)[:limit]:
            if h not in prefix_hashes:
                break
            num += 1
        return num

    def total_blocks(self, block_size: int, expected_output_tokens: int) -> int:
        """Blocks the request will hold: prompt plus expected decode tokens (they share the
        prompt's last partial block, hence one ceil over the sum)."""
        num_tokens = self.prompt_len + min(max(self.max_tokens, 0), expected_output_tokens)
        return -(-num_tokens // block_size)


@dataclass(frozen=True)
class ReplicaView:
    """A replica as this router sees it at choice time."""

    key: ReplicaKey
    report: ReplicaReport | None
    unreflected_blocks: int = 0  # reserved by this router, not yet in a report
    unreflected_requests: int = 0
    queue_len: int = 0  # requests outstanding there as far as this router knows (pow2)
    # Work promised since the report (the ledger's Unreflected): uncached prompt tokens still
    # to prefill, and the decode blocks those requests will grow into.
    unreflected_prefill_tokens: int = 0
    unreflected_decode_blocks: int = 0


@dataclass(frozen=True)
class ReplicaScore:
    key: ReplicaKey
    fits: bool
    score: int
    capacity: int
    need_blocks: int
    cached_blocks: int
    rank_key: float
    num_waiting: int
    unreflected_requests: int

    @property
    def queue_depth(self) -> int:
        return self.num_waiting + self.unreflected_requests


@dataclass(frozen=True)
class Ranking:
    order: tuple[ReplicaKey, ...]
    mode: str
    # Blocks to reserve if the request ends up on that replica (all candidates, so a
    # reservation can move when Serve picks a lower rank).
    need_blocks: Mapping[ReplicaKey, int]
    scores: Mapping[ReplicaKey, ReplicaScore]


def is_fresh(report: ReplicaReport | None, now: float, params: HeadroomParams) -> bool:
    return report is not None and now - report.timestamp <= params.stale_after_s


def score_replica(request: RequestProfile, view: ReplicaView, params: HeadroomParams) -> ReplicaScore:
    """The headroom score of one replica with fresh stats (see the module docstring)."""
    report = view.report
    assert report is not None
    bs = report.block_size
    cached = request.cached_blocks(bs, report.prefix_hashes)
    need = max(request.total_blocks(bs, params.expected_output_tokens) - cached, 0)
    capacity = max(math.floor(report.free_blocks * params.headroom_share) - report.reserved_blocks, 0)
    score = capacity - view.unreflected_blocks - need
    cacheable = request.cacheable_blocks(bs)
    credit = params.prefix_weight * cached / cacheable if cacheable else 0.0
    fill = score / capacity if capacity > 0 else -math.inf
    return ReplicaScore(
        key=view.key,
        fits=score >= 0,
        score=score,
        capacity=capacity,
        need_blocks=need,
        cached_blocks=cached,
        rank_key=fill + credit,
        num_waiting=report.num_waiting,
        unreflected_requests=view.unreflected_requests,
    )


def load_gate_tripped(scores: Sequence[ReplicaScore], params: HeadroomParams) -> bool:
    """True when some replica's queue exceeds the others' by more than load_gate_threshold
    requests (reported waiting queues absolutely, recent dispatches against the replica's
    headroom share; see the module docstring)."""
    if len(scores) < 2:
        return False
    min_waiting = min(s.num_waiting for s in scores)
    total_unreflected = sum(s.unreflected_requests for s in scores)
    total_capacity = sum(s.capacity for s in scores)
    for s in scores:
        share = s.capacity / total_capacity if total_capacity > 0 else 1.0 / len(scores)
        excess = (s.num_waiting - min_waiting) + (s.unreflected_requests - total_unreflected * share)
        if excess > params.load_gate_threshold:
            return True
    return False


def power_of_two(views: Sequence[ReplicaView], rng: random.Random) -> list[ReplicaKey]:
    """Two random replicas, shorter queue first (ties: random order), then the rest shuffled."""
    if not views:
        return []
    order = list(views)
    rng.shuffle(order)
    first, rest = order[:2], order[2:]
    first.sort(key=lambda v: v.queue_len)  # stable: ties keep the random order
    return [v.key for v in first + rest]


def rank_replicas(
    request: RequestProfile | None,
    views: Sequence[ReplicaView],
    params: HeadroomParams,
    now: float,
    rng: random.Random,
) -> Ranking:
    """Rank the candidate replicas for one request (best first). A replica whose last
    report says it is unhealthy is never offered, however old that report."""
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
                    need[v.key] = request.total_blocks(v.report.block_size, params.expected_output_tokens)
        return Ranking(order=tuple(power_of_two(views, rng)), mode=MODE_POW2, need_blocks=need, scores={})

    index = {v.key: i for i, v in enumerate(views)}
    scores = [score_replica(request, v, params) for v in fresh]
    fitting = [s for s in scores if s.fits]
    not_fitting = [s for s in scores if not s.fits]

    if load_gate_tripped(scores, params):
        mode = MODE_LOAD_GATE
        fitting.sort(key=lambda s: (s.queue_depth, -s.rank_key, index[s.key]))
    else:
        mode = MODE_HEADROOM
        fitting.sort(key=lambda s: (-s.rank_key, -s.score, index[s.key]))
    not_fitting.sort(key=lambda s: (-s.score, s.queue_depth, index[s.key]))

    order = [s.key for s in fitting] + power_of_two(stale, rng) + [s.key for s in not_fitting]
    need = {s.key: s.need_blocks for s in scores}
    for v in stale:
        if v.report is not None:
            need[v.key] = request.total_blocks(v.report.block_size, params.expected_output_tokens)
    return Ranking(order=tuple(order), mode=mode, need_blocks=need, scores={s.key: s for s in scores})
