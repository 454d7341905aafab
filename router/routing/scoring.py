"""The arithmetic of the headroom policy (router/routing/policies/headroom.py), as pure
functions: what a request needs on a replica, what the replica has, and the work it has
queued, each in the replica's own units. No Ray import; unit-tested alone.

Per fresh replica r and request q (KV in r's blocks, work in r's prompt tokens):

    cached(q, r)   = max(leading prompt blocks in r's reported prefix_hashes,
                         leading prompt blocks routers sent to r (hints)),
                     at most cacheable(q) = (prompt_len - 1) // block_size
    host, disk     = blocks after those that r's KV tiers hold (its host_prefix_hashes,
                     disk_prefix_hashes): loaded, not recomputed, but they need device
                     blocks as much as computed ones
    expected(q, r) = min(max_tokens, r's reported mean_output_tokens, or
                         params.expected_output_tokens while r has observed none)
    need(q, r)     = blocks_r(prompt_len + expected(q, r)) - blocks_r(cached * block_size)
                     (blocks_r: r's own KV geometry, kv/kv_geometry.py: every KV group's
                     blocks, a sliding-window group's at most its window's)
    capacity(r)    = max(floor(free_blocks * headroom_share) - reserved_blocks
                         - decode_growth_blocks, 0)
                     (reserved: the waiting prompts' blocks; growth: what the requests
                     already there will still grow into, worker/serving/routing_report.py)
    score(q, r)    = capacity - unreflected_blocks - need
    slack(q, r)    = min(reserved_blocks + decode_growth_blocks, blocks_r(cached * block_size))
    fits(q, r)     = score >= 0, or floor(free_blocks * headroom_share) - reserved_blocks
                     - decode_growth_blocks + slack - unreflected_blocks - need >= 0
                     (a replica that caches part of the prompt takes q although what it
                     owes its queue, its waiting prompts' blocks and its running requests'
                     growth, leaves no room, as long as the prompt blocks it caches cover
                     that shortfall: those debts are paid from the blocks its running
                     requests free as they finish, which capacity does not credit; q waits
                     its turn behind them, a wait the TTFT term prices; and any other
                     replica would need the cached blocks too, besides recomputing them.
                     Never beyond its free blocks: what routers sent since its report
                     counts whole. Without the slack a session's turn is pushed off its
                     history's replica, to cost the cluster its whole history again, for
                     want of the few blocks the turn adds)
    credit(q, r)   = prefix_weight * (cached + host_hit_weight * host
                     + disk_hit_weight * disk) / cacheable        # partial match, partial credit
                     + session_weight if r served q's session last  # a soft preference
    rank_key(q, r) = score / capacity + credit - ttft / target_ttft_s

Work, because KV usage hides queued work and request counts hide request sizes (a
32k-token prompt and a chat turn are each "one request"):

    rate(r)       = r's reported prefill_tokens_per_s if it measured one (prompt tokens per
                    device second over its recent budget-full steps: worker/engine/step_meters.py),
                    else params.prefill_tokens_per_s * capacity_weight(r)
    backlog(r)    = num_waiting_prompt_tokens(r) + num_running_prompt_tokens(r)
                    + unreflected_prefill_tokens(r)
    uncached(q,r) = prompt_len(q) - (cached + host + disk) * block_size
    load(q, r)    = block_size * (host / host_load_tokens_per_s + disk / disk_load_tokens_per_s)
                    + adapter(q, r)
    adapter(q, r) = 0 for the base model or an adapter in r's device slots (lora_resident),
                    lora_swap_s for one in its host memory (lora_loaded), else lora_load_s;
                    + lora_slot_wait_s where running sequences hold all r's slots
                    (lora_active, max_loras): none can take the adapter until one drains
    ttft(q, r)    = (backlog(r) + uncached(q, r)) / rate(r) + load(q, r)  # predicted prefill wait
    within_target(q, r) = backlog(r) + uncached(q, r) <= rate(r) * target_ttft_s

Load: each replica's share of all ongoing requests is in proportion to its size (total
KV blocks) times capacity weight; its excess is what it carries beyond that share. Not to
its headroom: the requests a replica carries use its headroom up, so a share by headroom
shrinks as the replica fills and its excess grows twice over (positive feedback): the gate
then moves its cached requests elsewhere in a wave, each a recompute there, until the
other replica is the one over its share. The gate limit is
load_gate_threshold requests or load_gate_fraction of the share, whichever is more (a fixed
count alone closes on the ordinary spread of a busy cluster); a move's cost is the prompt
tokens only this replica caches, in mean uncached requests, capped at one more limit (an
uncapped cost lets a stream of small cached requests keep a hot spot open forever).

Decode growth is subtracted whole although free_blocks counts evictable cached blocks as
free: growth takes blocks from that pool either way (an evicted prefix is no longer a hit).
Known limits: the growth forecast is an expectation per request; blocks that requests free
when they finish, before the routed one does, are not credited; reused cached blocks that
were idle also leave the free pool, which the prefix credit does not model.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from router.routing.types import RoutingParams, ReplicaKey, ReplicaReport, ReplicaView, RequestProfile


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
    total_blocks: int = 0  # its KV size (load shares)
    adapter_s: float = 0.0  # the request's LoRA adapter's load there, in ttft_s
    cached_pool_blocks: int = 0  # the pool blocks its cached prefix of the prompt stands for

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


def decode_blocks(request: RequestProfile, block_size: int, expected_output_tokens: int,
                  report: ReplicaReport | None = None) -> int:
    """Blocks the request's expected decode adds beyond its prompt's (in `report`'s
    geometry when given)."""
    if report is not None:
        geometry = report.geometry
        return (geometry.blocks_for_tokens(request.num_tokens(expected_output_tokens))
                - geometry.blocks_for_tokens(request.prompt_len))
    return request.total_blocks(block_size, expected_output_tokens) - -(-request.prompt_len // block_size)


def report_headroom(report: ReplicaReport, headroom_share: float = 1.0) -> int:
    """Blocks a report leaves for new requests (capacity before the 0 floor): this router's
    share of the free blocks, less its waiting prompts' reservations and the growth of its
    requests. Admission control (router/routing/admission.py) judges with the same figure (at the
    whole share), less the same unreflected blocks, so the two agree on what fits."""
    return math.floor(report.free_blocks * headroom_share) - report.reserved_blocks - report.decode_growth_blocks


def score_replica(
    request: RequestProfile,
    view: ReplicaView,
    params: RoutingParams,
    hinted_blocks: int = 0,
    session: bool = False,
) -> ReplicaScore:
    """The score of one replica with fresh stats (see the module docstring). `hinted_blocks`:
    leading prompt blocks routers sent there (router/routing/routing_view.py's prefix hints);
    `session`: it served this request's session last."""
    report = view.report
    assert report is not None
    bs = report.block_size
    cacheable = request.cacheable_blocks(bs)
    cached = max(request.cached_blocks(bs, report.prefix_hashes), min(hinted_blocks, cacheable))
    need = max(report.request_blocks(request, report.expected_output_tokens(params)) - report.prefix_blocks(cached), 0)
    headroom = report_headroom(report, params.headroom_share)
    capacity = max(headroom, 0)
    score = capacity - view.unreflected_blocks - need
    slack = min(report.reserved_blocks + report.decode_growth_blocks, report.prefix_blocks(cached))
    host, disk = request.tier_blocks(bs, cached, report.host_prefix_hashes, report.disk_prefix_hashes)
    hits = cached + params.host_hit_weight * host + params.disk_hit_weight * disk
    credit = (params.prefix_weight * hits / cacheable if cacheable else 0.0) + (params.session_weight if session else 0.0)
    fill = score / capacity if capacity > 0 else -math.inf
    rate = prefill_rate(report, params)
    backlog = prefill_backlog(view)
    uncached = uncached_tokens(request, cached + host + disk, bs)
    adapter_s = adapter_load_s(request, report, params)
    ttft = predicted_ttft_s(backlog, uncached, rate) + tier_load_s(host, disk, bs, params) + adapter_s
    within = within_target(backlog, uncached, rate, params)
    return ReplicaScore(
        key=view.key,
        fits=score >= 0 or headroom + slack - view.unreflected_blocks - need >= 0,
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
        # often less than it looks, and dropping the credit throws the hit rate away.
        rank_key=fill + credit - ttft / params.target_ttft_s,
        num_waiting=report.num_waiting,
        unreflected_requests=view.unreflected_requests,
        capacity_weight=report.capacity_weight,
        total_blocks=report.token_capacity // bs,  # in full-attention blocks: shares compare tokens
        ongoing=max(view.queue_len, report.num_running + report.num_waiting + view.unreflected_requests),
        adapter_s=adapter_s,
        cached_pool_blocks=report.prefix_blocks(cached),
    )


def load_shares(scores: Sequence[ReplicaScore]) -> dict[ReplicaKey, float]:
    """Each replica's share of all ongoing requests: its KV size times its capacity weight
    over everyone's (equal shares when none reports a size). Never its headroom, which its
    own requests use up (the module docstring)."""
    weights = {s.key: s.total_blocks * s.capacity_weight for s in scores}
    total_weight = sum(weights.values())
    total = sum(s.ongoing for s in scores)
    return {s.key: total * (weights[s.key] / total_weight if total_weight > 0 else 1.0 / len(scores)) for s in scores}


def load_excess(scores: Sequence[ReplicaScore]) -> dict[ReplicaKey, float]:
    """Requests ongoing at each replica beyond its share of all ongoing requests: a burst
    spread in proportion to size (and speed) has no excess; affinity piling onto one
    replica has."""
    shares = load_shares(scores)
    return {s.key: s.ongoing - shares[s.key] for s in scores}


def gate_limits(scores: Sequence[ReplicaScore], params: RoutingParams) -> dict[ReplicaKey, float]:
    """The excess each replica may carry before the load gate closes on it: load_gate_threshold
    requests, or load_gate_fraction of its share when that is more: a fixed count alone
    closes the gate on the ordinary spread of a busy cluster and turns affinity into cache
    misses, whose extra prefill is the TTFT the gate means to avoid."""
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


def gate_allowances(scores: Sequence[ReplicaScore], params: RoutingParams, request_tokens: float) -> dict[ReplicaKey, float]:
    """The excess each replica may carry before the gate sends this request elsewhere: its
    gate limit plus the move's cost, the cost at most one more limit. Uncapped, a stream of
    small cached requests prices a long prefix at many requests and the gate never closes
    on its owner: the hot spot the gate bounds would be unbounded again. Capped, an owner
    carries at most twice its limit over its share."""
    limits, moves = gate_limits(scores, params), move_costs(scores, request_tokens)
    return {k: limit + min(moves[k], limit) for k, limit in limits.items()}


def load_gate_tripped(scores: Sequence[ReplicaScore], params: RoutingParams) -> bool:
    """True when some replica carries more excess than its gate limit."""
    if len(scores) < 2:
        return False
    excess, limits = load_excess(scores), gate_limits(scores, params)
    return any(excess[k] > limits[k] for k in excess)


def prefill_rate(report: ReplicaReport, params: RoutingParams) -> float:
    """Prompt tokens per second the replica prefills (always > 0)."""
    if report.prefill_tokens_per_s > 0:
        return report.prefill_tokens_per_s
    return params.prefill_tokens_per_s * report.capacity_weight


def prefill_backlog(view: ReplicaView) -> int:
    """Prompt tokens queued there: at the report (waiting prompts, and what running ones
    have left to prefill: a long prompt admitted whole is prefilled over seconds, and is
    no longer waiting), plus those sent since (uncached ones)."""
    assert view.report is not None
    return (view.report.num_waiting_prompt_tokens + view.report.num_running_prompt_tokens
            + view.unreflected_prefill_tokens)


def uncached_tokens(request: RequestProfile, cached_blocks: int, block_size: int) -> int:
    return max(request.prompt_len - cached_blocks * block_size, 0)


def tier_load_s(num_host: int, num_disk: int, block_size: int, params: RoutingParams) -> float:
    """Seconds to load prefix blocks from a replica's host tier and disk."""
    return block_size * (num_host / params.host_load_tokens_per_s + num_disk / params.disk_load_tokens_per_s)


def adapter_load_s(request: RequestProfile, report: ReplicaReport, params: RoutingParams) -> float:
    """Seconds the request's LoRA adapter takes to reach a device slot on the replica:
    residency as the replica reports it, not requests in flight (an adapter stays resident
    after its last request, and one with requests may still be loading)."""
    name = request.lora_name
    if name is None or name in report.lora_resident:
        return 0.0
    load = params.lora_swap_s if name in report.lora_loaded else params.lora_load_s
    if report.max_loras and len(report.lora_active) >= report.max_loras:
        load += params.lora_slot_wait_s  # no free or idle slot: one must drain first
    return load


def predicted_ttft_s(backlog: int, uncached: int, rate: float) -> float:
    """Seconds until this request's prefill is done, if the replica prefills its queue first."""
    return (backlog + uncached) / rate


def within_target(backlog: int, uncached: int, rate: float, params: RoutingParams) -> bool:
    return backlog + uncached <= rate * params.target_ttft_s
