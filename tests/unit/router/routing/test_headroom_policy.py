"""The KV-headroom routing policy (router/routing/types.py, router/routing/scoring.py, router/routing/work.py), without Ray."""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

import pytest

from kv.block_hash import hash_full_blocks
from router.routing import scoring
from router.routing.types import RoutingParams, ReplicaReport, ReplicaView, RequestProfile
from router.routing.policies.base import RoutingRequest
from router.routing.policies.headroom import HeadroomPolicy
from router.routing.scoring import Ranking, load_gate_tripped, score_replica
from router.routing.policies.headroom import MODE_AFFINITY, MODE_HEADROOM, MODE_LOAD_GATE, MODE_NONE_HEALTHY, MODE_POW2, RankContext, rank_replicas
from router.routing.reservations import ReservationLedger, Unreflected

BS = 16
NOW = 1_000.0
PARAMS = RoutingParams(stats_period_s=1.0, stale_after_periods=3.0, expected_output_tokens=256)


def report(
    free_blocks: int,
    *,
    num_waiting: int = 0,
    reserved_blocks: int = 0,
    prefix_hashes: list[int] | tuple[int, ...] = (),
    timestamp: float = NOW - 0.5,
    total_blocks: int = 1000,
    block_size: int = BS,
    healthy: bool = True,
) -> ReplicaReport:
    stats = {
        "free_blocks": free_blocks,
        "total_blocks": total_blocks,
        "block_size": block_size,
        "num_running": 0,
        "num_waiting": num_waiting,
        "num_waiting_prompt_tokens": num_waiting * block_size,
        "reserved_blocks": reserved_blocks,
        "prefix_hashes": list(prefix_hashes),
        "timestamp": timestamp,
        "healthy": healthy,
    }
    parsed = ReplicaReport.from_stats(stats)
    assert parsed is not None
    return parsed


def small_request(i: int = 0) -> RequestProfile:
    # 8 prompt tokens + 8 decode tokens = exactly one 16-token block.
    return RequestProfile(prompt_token_ids=[1000 + i] * 8, max_tokens=8)


def views_for(reports: Mapping[str, ReplicaReport | None], ledger: ReservationLedger) -> list[ReplicaView]:
    views = []
    for key, rep in reports.items():
        if rep is not None:
            ledger.observe_report(key, rep.timestamp)
        u = ledger.unreflected(key)
        views.append(ReplicaView(key, rep, u.blocks, u.requests, queue_len=ledger.outstanding(key),
                                 unreflected_prefill_tokens=u.prefill_tokens, unreflected_decode_blocks=u.decode_blocks))
    return views


def dispatch(
    reports: Mapping[str, ReplicaReport | None],
    requests: list[RequestProfile],
    params: RoutingParams = PARAMS,
    ledger: ReservationLedger | None = None,
    now: float = NOW,
    rng: random.Random | None = None,
) -> tuple[Counter[str], list[Ranking]]:
    """What a router does for a burst with no new reports: rank, send to the top replica,
    reserve its need there at dispatch time."""
    ledger = ledger if ledger is not None else ReservationLedger(params.report_lag_s)
    rng = rng or random.Random(0)
    counts: Counter[str] = Counter()
    rankings = []
    for i, req in enumerate(requests):
        ranking = rank_replicas(req, views_for(reports, ledger), params, now, rng)
        top = ranking.order[0]
        ledger.reserve(f"req-{i}-{len(ledger)}", top, ranking.need_blocks, now,
                       prefill_tokens=dict(ranking.prefill_tokens), decode_blocks=ranking.decode_blocks)
        counts[top] += 1
        rankings.append(ranking)
    return counts, rankings


# ---------------------------------------------------------------- need and score


def test_need_counts_prompt_plus_capped_decode_in_one_ceil() -> None:
    req = RequestProfile(prompt_token_ids=list(range(40)), max_tokens=100)
    assert req.total_blocks(BS, expected_output_tokens=256) == 9  # ceil(140 / 16)
    long = RequestProfile(prompt_token_ids=list(range(40)), max_tokens=4000)
    assert long.total_blocks(BS, expected_output_tokens=256) == 19  # ceil((40 + 256) / 16)
    assert long.total_blocks(BS, expected_output_tokens=0) == 3  # ceil(40 / 16)


def test_cached_blocks_is_a_leading_match_capped_below_the_last_token() -> None:
    tokens = list(range(64))  # 4 full blocks
    hashes = hash_full_blocks(tokens, BS)
    req = RequestProfile(prompt_token_ids=tokens + [7], max_tokens=1)
    # Blocks 0, 1 and 3 cached, block 2 not: only the leading two count.
    assert req.cached_blocks(BS, frozenset([hashes[0], hashes[1], hashes[3]])) == 2
    assert req.cached_blocks(BS, frozenset(hashes)) == 4
    # A prompt of exactly 4 blocks: the engine recomputes the last token, so at most 3 hit.
    exact = RequestProfile(prompt_token_ids=tokens, max_tokens=1)
    assert exact.cached_blocks(BS, frozenset(hashes)) == 3
    # Hashes of another block size never match.
    assert req.cached_blocks(32, frozenset(hashes)) == 0


def test_score_formula() -> None:
    req = RequestProfile(prompt_token_ids=list(range(40)), max_tokens=100)  # need 9
    view = ReplicaView("r", report(100, reserved_blocks=10, num_waiting=3), unreflected_blocks=5, unreflected_requests=2)
    s = score_replica(req, view, PARAMS)
    assert (s.capacity, s.need_blocks, s.score, s.fits, s.queue_depth) == (90, 9, 76, True, 5)
    # TTFT term: (3 waiting x 16 prompt tokens + 40 uncached) / 40k tok/s, over the 2 s target.
    assert s.ttft_s == pytest.approx(88 / 40_000)
    assert s.rank_key == pytest.approx(76 / 90 - 88 / 40_000 / 2.0)
    # headroom_share: this router may promise only half of the free blocks.
    half = score_replica(req, view, RoutingParams(headroom_share=0.5, stats_period_s=1.0))
    assert (half.capacity, half.score) == (40, 26)


def test_score_subtracts_cached_blocks_and_adds_prefix_credit() -> None:
    prefix = list(range(512))  # 32 blocks
    req = RequestProfile(prompt_token_ids=prefix + [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=8)
    cached_view = ReplicaView("a", report(200, prefix_hashes=hash_full_blocks(prefix, BS)))
    cold_view = ReplicaView("b", report(200))
    hot, cold = score_replica(req, cached_view, PARAMS), score_replica(req, cold_view, PARAMS)
    assert (hot.cached_blocks, hot.need_blocks, hot.score) == (32, 1, 199)  # ceil(528/16) - 32
    assert (cold.cached_blocks, cold.need_blocks, cold.score) == (0, 33, 167)
    # Fully cached: credit = prefix_weight; only 8 tokens left to prefill there, 520 elsewhere.
    assert (hot.uncached_tokens, cold.uncached_tokens) == (8, 520)
    assert hot.rank_key == pytest.approx(199 / 200 + 1.0 - 8 / 80_000)
    assert cold.rank_key == pytest.approx(167 / 200 - 520 / 80_000)


# ---------------------------------------------------------------- herding


def test_burst_of_200_spreads_in_proportion_to_headroom() -> None:
    # Idle replicas of 100, 200 and 300 blocks (a busy one's used blocks are its requests').
    reports = {f"r{n}": report(n, total_blocks=n) for n in (100, 200, 300)}
    counts, rankings = dispatch(reports, [small_request(i) for i in range(200)])
    # 200 one-block requests over 600 free blocks: each replica keeps 2/3 of its headroom.
    assert counts == {"r100": 33, "r200": 67, "r300": 100}
    # A proportional burst never trips the load gate by itself.
    assert {r.mode for r in rankings} == {MODE_HEADROOM}


def test_without_dispatch_time_reservations_the_burst_herds() -> None:
    """The failure mode the ledger exists for: with only the last report, every request of
    the burst goes to the replica that looked emptiest."""
    reports = {"r100": report(100), "r200": report(200), "r300": report(300)}
    views = [ReplicaView(k, r) for k, r in reports.items()]
    tops = {rank_replicas(small_request(i), views, PARAMS, NOW, random.Random(0)).order[0] for i in range(200)}
    assert tops == {"r300"}


def test_burst_proportions_hold_for_multi_block_requests() -> None:
    reports = {"a": report(100, total_blocks=100), "b": report(300, total_blocks=300)}
    reqs = [RequestProfile(prompt_token_ids=list(range(40)), max_tokens=8) for _ in range(40)]  # 3 blocks each
    counts, _ = dispatch(reports, reqs)
    assert counts == {"a": 10, "b": 30}  # 120 of 400 blocks, 30% of each replica


# ---------------------------------------------------------------- running out of headroom


def test_replica_with_no_headroom_gets_nothing_while_others_have_headroom() -> None:
    reports = {
        "full": report(0),
        "queued": report(40, reserved_blocks=40),  # free blocks all promised to its queue
        "a": report(50),
        "b": report(50),
    }
    counts, _ = dispatch(reports, [small_request(i) for i in range(100)])
    assert counts == {"a": 50, "b": 50}


def test_unhealthy_replica_is_never_chosen_even_with_the_most_headroom() -> None:
    # e.g. a tensor-parallel rank died: the replica's next report says so, and it gets
    # nothing from then on (also not as a stale or a not-fitting fallback).
    reports = {"broken": report(900, healthy=False), "a": report(50), "old": report(60, timestamp=NOW - 100)}
    counts, rankings = dispatch(reports, [small_request(i) for i in range(20)])
    assert "broken" not in counts and sum(counts.values()) == 20
    assert all("broken" not in r.order for r in rankings)


def test_no_healthy_replica_offers_none() -> None:
    ranking = rank_replicas(small_request(), views_for({"x": report(100, healthy=False)}, ReservationLedger()),
                            PARAMS, NOW, random.Random(0))
    assert ranking.order == () and ranking.mode == MODE_NONE_HEALTHY


def test_replica_that_runs_out_mid_burst_stops_receiving() -> None:
    reports = {"small": report(10), "big": report(100)}
    reqs = [RequestProfile(prompt_token_ids=[5] * 40, max_tokens=8) for _ in range(36)]  # 3 blocks each
    counts, rankings = dispatch(reports, reqs)
    # Proportional until "small" holds 3 requests (9 of 10 blocks; a 4th needs 12), then
    # everything goes to "big" until it is full too (33 x 3 = 99 of 100 blocks).
    assert counts == {"small": 3, "big": 33}
    stopped = next(i for i, r in enumerate(rankings) if not r.scores["small"].fits)
    assert all(r.order[0] == "big" for r in rankings[stopped:])
    assert rankings[-1].order == ("big", "small")  # no longer fits: last, kept as a fallback
    assert stopped < 35


def test_when_nothing_fits_least_deficit_first() -> None:
    reports = {"a": report(2), "b": report(5), "c": report(0)}
    req = RequestProfile(prompt_token_ids=[1] * 100, max_tokens=8)  # 7 blocks
    ranking = rank_replicas(req, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0))
    assert ranking.order == ("b", "a", "c")
    assert [ranking.scores[k].score for k in ranking.order] == [-2, -5, -7]


# ---------------------------------------------------------------- prefix affinity and the load gate


def prefix_requests(prefix: list[int], n: int) -> list[RequestProfile]:
    return [RequestProfile(prompt_token_ids=prefix + [9000 + i] * 8, max_tokens=8) for i in range(n)]


def test_prefix_affinity_wins_while_the_cached_replica_has_headroom() -> None:
    prefix = list(range(512))
    reports = {
        "cold-big": report(1000),
        "cached": report(60, prefix_hashes=hash_full_blocks(prefix, BS)),
        "cold": report(200),
    }
    # A gate of 16: a burst of 10 on one replica stays below it (the default 4 would
    # spread it; see test_affinity_hot_spot_built_in_one_burst_is_capped_by_the_gate).
    params = RoutingParams(stats_period_s=1.0, stale_after_periods=3.0, expected_output_tokens=256,
                            load_gate_threshold=16.0)
    counts, rankings = dispatch(reports, prefix_requests(prefix, 10), params)
    assert counts == {"cached": 10}
    assert {r.mode for r in rankings} == {MODE_AFFINITY}


def test_prefix_affinity_ends_when_the_cached_replica_runs_out_of_headroom() -> None:
    prefix = list(range(512))
    reports = {"cached": report(4, prefix_hashes=hash_full_blocks(prefix, BS)), "cold": report(1000)}
    counts, _ = dispatch(reports, prefix_requests(prefix, 10))
    assert counts == {"cached": 4, "cold": 6}  # each needs 1 block there, 33 elsewhere


def test_cached_replica_owing_its_queue_keeps_the_turn_within_its_free_blocks() -> None:
    """Its waiting prompts' reservations leave no headroom, but its free blocks hold the
    turn's own blocks: the turn waits there behind them (the cached prefix would cost any
    other replica 33 blocks and its recompute), until what routers sent since the report
    uses the free blocks up; a cold replica owing as much gets no such slack."""
    prefix = list(range(512))
    reports = {"cached": report(4, reserved_blocks=20, num_waiting=1, prefix_hashes=hash_full_blocks(prefix, BS)),
               "cold": report(1000)}
    counts, rankings = dispatch(reports, prefix_requests(prefix, 10))
    assert counts == {"cached": 4, "cold": 6}
    assert rankings[0].mode == MODE_AFFINITY and rankings[0].scores["cached"].fits
    owing_cold = {"cold-owing": report(1000, reserved_blocks=1000), "cold": report(1000)}
    counts, _ = dispatch(owing_cold, prefix_requests(prefix, 3))
    assert counts == {"cold": 3}
    no_free = {"cached": report(0, reserved_blocks=20, num_waiting=1, prefix_hashes=hash_full_blocks(prefix, BS)),
               "cold": report(1000)}
    counts, _ = dispatch(no_free, prefix_requests(prefix, 2))
    assert counts == {"cold": 2}


def test_where_nothing_fits_the_least_deficit_counts_the_cached_prefix() -> None:
    """Neither replica has room; the one caching the prefix is short by more blocks (what
    routers sent it since its report), but fewer than the 32 its prefix would cost the
    other: it comes first."""
    prefix = list(range(512))
    request = prefix_requests(prefix, 1)[0]
    views = [ReplicaView("cached", report(0, prefix_hashes=hash_full_blocks(prefix, BS)), 40, 2),
             ReplicaView("cold", report(0), 0, 0)]
    ranking = rank_replicas(request, views, PARAMS, NOW, random.Random(0), RankContext())
    assert not any(s.fits for s in ranking.scores.values())
    assert ranking.scores["cached"].score < ranking.scores["cold"].score
    assert ranking.order[0] == "cached"
    views[0] = replace(views[0], unreflected_blocks=70)  # short by more than its prefix saves
    assert rank_replicas(request, views, PARAMS, NOW, random.Random(0), RankContext()).order[0] == "cold"


def test_partial_prefix_match_earns_partial_credit() -> None:
    prefix = list(range(512))
    hashes = hash_full_blocks(prefix, BS)
    reports = {"half": report(200, prefix_hashes=hashes[:16]), "cold": report(200)}
    req = prefix_requests(prefix, 1)[0]
    ranking = rank_replicas(req, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0))
    half = ranking.scores["half"]
    assert half.cached_blocks == 16
    assert half.rank_key == pytest.approx((200 - 17) / 200 + 16 / 32 - (520 - 256) / 80_000)
    assert ranking.order[0] == "half"


def test_prefix_affinity_loses_to_the_load_gate_when_overloaded() -> None:
    prefix = list(range(512))
    hashes = hash_full_blocks(prefix, BS)
    reports = {
        "cached": report(800, num_waiting=30, reserved_blocks=60, prefix_hashes=hashes),
        "a": report(800),
        "b": report(700),
    }
    ranking = rank_replicas(prefix_requests(prefix, 1)[0], views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0))
    assert ranking.mode == MODE_LOAD_GATE
    assert ranking.order == ("a", "b", "cached")  # least-loaded first; equal depth: rank_key
    # Without the gate the cached replica would have won.
    no_gate = RoutingParams(stats_period_s=1.0, load_gate_threshold=1e9)
    ungated = rank_replicas(prefix_requests(prefix, 1)[0], views_for(reports, ReservationLedger()), no_gate, NOW, random.Random(0))
    assert ungated.mode == MODE_AFFINITY and ungated.order[0] == "cached"


def test_affinity_hot_spot_built_in_one_burst_is_capped_by_the_gate() -> None:
    prefix = list(range(512))
    reports = {
        "cached": report(1000, prefix_hashes=hash_full_blocks(prefix, BS)),
        "a": report(1000),
        "b": report(1000),
    }
    counts, rankings = dispatch(reports, prefix_requests(prefix, 90))
    # Affinity until "cached" holds more than its fair third + the gate (8), then the others.
    assert [r.mode for r in rankings[:13]] == [MODE_AFFINITY] * 13  # 13 - 13/3 = 8.67 > 8 after the 13th
    assert rankings[13].mode == MODE_LOAD_GATE
    assert MODE_LOAD_GATE in {r.mode for r in rankings}
    assert counts["cached"] - 90 / 3 <= PARAMS.load_gate_threshold + 1
    assert counts["a"] > 0 and counts["b"] > 0
    assert counts == {"cached": 38, "a": 26, "b": 26}  # 38 = fair 30 + threshold 8


def test_kv_usage_alone_hides_a_long_waiting_queue() -> None:
    # "busy" looks emptier by KV, but 30 requests wait there (e.g. max_num_seqs reached).
    reports = {"busy": report(500, num_waiting=30, reserved_blocks=30), "idle": report(300)}
    ranking = rank_replicas(small_request(), views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0))
    assert ranking.mode == MODE_LOAD_GATE
    assert ranking.order == ("idle", "busy")


def test_load_gate_counts_unreflected_dispatches_as_queue_depth() -> None:
    r = report(100)
    balanced = [score_replica(small_request(), ReplicaView(k, r, unreflected_requests=n), PARAMS) for k, n in (("a", 10), ("b", 10))]
    assert not load_gate_tripped(balanced, PARAMS)
    skewed = [score_replica(small_request(), ReplicaView(k, r, unreflected_requests=n), PARAMS) for k, n in (("a", 40), ("b", 0))]
    assert load_gate_tripped(skewed, PARAMS)  # excess 40 - 20 = 20 > 8


def test_the_gate_limit_grows_with_each_replicas_share_of_a_busy_cluster() -> None:
    """load_gate_fraction: 8 over a share of 20 is a hot spot; 20 over a share of 120 (a busy
    replica of 256 slots) is the ordinary spread, and 40 over it is a hot spot again."""
    r = report(100)

    def scores(a: int, b: int) -> list:
        return [score_replica(small_request(), ReplicaView(k, r, unreflected_requests=n), PARAMS) for k, n in (("a", a), ("b", b))]

    assert PARAMS.load_gate_threshold == 8 and PARAMS.load_gate_fraction == 0.25
    assert load_gate_tripped(scores(29, 11), PARAMS)  # share 20, limit 8: excess 9
    assert not load_gate_tripped(scores(140, 100), PARAMS)  # share 120, limit 30: excess 20
    assert load_gate_tripped(scores(160, 80), PARAMS)  # share 120, limit 30: excess 40
    assert not load_gate_tripped(scores(29, 11), replace(PARAMS, load_gate_fraction=0.5, load_gate_threshold=10))


# ---------------------------------------------------------------- stale / missing stats


def test_all_stats_stale_falls_back_to_power_of_two_on_queue_length() -> None:
    old = NOW - 3.5  # stale after 3 x 1 s
    views = [
        ReplicaView("q0", report(900, timestamp=old), queue_len=0),
        ReplicaView("q5", report(900, timestamp=old), queue_len=5),
        ReplicaView("q9", None, queue_len=9),  # never reported
    ]
    rng = random.Random(1234)
    firsts: Counter[str] = Counter()
    for _ in range(600):
        ranking = rank_replicas(small_request(), views, PARAMS, NOW, rng)
        assert ranking.mode == MODE_POW2
        assert sorted(ranking.order) == ["q0", "q5", "q9"]
        firsts[ranking.order[0]] += 1
    # The shorter queue of a random pair: q0 wins 2/3 of pairs, q5 1/3, q9 never.
    assert firsts["q9"] == 0
    assert 350 < firsts["q0"] < 450 and 150 < firsts["q5"] < 250


def test_stats_just_inside_the_staleness_window_are_used() -> None:
    views = [ReplicaView("a", report(10, timestamp=NOW - 2.9)), ReplicaView("b", report(900, timestamp=NOW - 2.9))]
    ranking = rank_replicas(small_request(), views, PARAMS, NOW, random.Random(0))
    assert ranking.mode == MODE_HEADROOM and ranking.order == ("b", "a")


def test_mixed_fresh_and_stale_ranks_fitting_then_stale_then_full() -> None:
    views = [
        ReplicaView("full", report(0)),
        ReplicaView("stale", report(900, timestamp=NOW - 60)),
        ReplicaView("fresh", report(100)),
        ReplicaView("new", None),
    ]
    ranking = rank_replicas(small_request(), views, PARAMS, NOW, random.Random(0))
    assert ranking.mode == MODE_HEADROOM
    assert ranking.order[0] == "fresh"
    assert set(ranking.order[1:3]) == {"stale", "new"}
    assert ranking.order[3] == "full"


def test_request_without_token_ids_uses_power_of_two() -> None:
    views = [ReplicaView("a", report(0), queue_len=3), ReplicaView("b", report(900), queue_len=1)]
    ranking = rank_replicas(None, views, PARAMS, NOW, random.Random(0))
    assert ranking.mode == MODE_POW2
    assert ranking.order == ("b", "a")  # two replicas: both sampled, shorter queue first
    assert ranking.need_blocks == {}


# ---------------------------------------------------------------- the reservation ledger


def test_reservation_counts_until_a_report_taken_after_dispatch() -> None:
    ledger = ReservationLedger(report_lag_s=0.05)
    ledger.observe_report("r", NOW - 1.0)
    ledger.reserve("x", "r", {"r": 7}, now=NOW)
    assert ledger.unreflected("r") == Unreflected(7, 1)
    ledger.observe_report("r", NOW + 0.01)  # taken before the request can have arrived
    assert ledger.unreflected("r") == Unreflected(7, 1)
    ledger.observe_report("r", NOW + 0.2)  # reflects it
    assert ledger.unreflected("r") == Unreflected(0, 0)
    assert ledger.outstanding("r") == 1  # still running there
    ledger.complete("x", "r")
    assert ledger.outstanding("r") == 0 and len(ledger) == 0


def test_completion_releases_an_unreflected_reservation() -> None:
    ledger = ReservationLedger()
    ledger.reserve("x", "r", {"r": 4}, now=NOW)
    ledger.reserve("y", "r", {"r": 2}, now=NOW)
    ledger.complete("x", "r")
    assert ledger.unreflected("r") == Unreflected(2, 1)


def test_reservation_moves_when_serve_sends_the_request_elsewhere() -> None:
    ledger = ReservationLedger()
    ledger.reserve("x", "top", {"top": 1, "second": 33}, now=NOW)
    ledger.routed("x", "second")  # "top" refused (max_ongoing_requests)
    assert ledger.unreflected("top") == Unreflected(0, 0)
    assert ledger.unreflected("second") == Unreflected(33, 1)
    # A late completion of the refused attempt on "top" must not drop the live reservation.
    ledger.complete("x", "top")
    assert ledger.unreflected("second") == Unreflected(33, 1)
    ledger.complete("x", "second")
    assert len(ledger) == 0


def test_rechoice_replaces_the_earlier_reservation() -> None:
    ledger = ReservationLedger()
    ledger.reserve("x", "a", {"a": 5, "b": 6}, now=NOW)
    ledger.reserve("x", "b", {"a": 5, "b": 6}, now=NOW + 0.1)
    assert ledger.unreflected("a") == Unreflected(0, 0)
    assert ledger.unreflected("b") == Unreflected(6, 1)
    assert len(ledger) == 1


def test_routed_after_completion_is_a_no_op() -> None:
    ledger = ReservationLedger()
    ledger.reserve("x", "a", {"a": 5}, now=NOW)
    ledger.complete("x", "a")  # a fast request finished before Serve reported it routed
    ledger.routed("x", "a")
    assert len(ledger) == 0 and ledger.unreflected("a") == Unreflected(0, 0)


def test_prune_drops_gone_replicas_and_abandoned_reservations() -> None:
    ledger = ReservationLedger()
    ledger.reserve("gone", "dead", {"dead": 3}, now=NOW)
    ledger.reserve("abandoned", "a", {"a": 3}, now=NOW - 120)  # never confirmed
    ledger.reserve("running", "a", {"a": 4}, now=NOW - 120)
    ledger.routed("running", "a")
    dropped = ledger.prune(NOW, {"a"}, unconfirmed_ttl_s=60, ttl_s=3600)
    assert dropped == 2
    assert "running" in ledger and len(ledger) == 1
    assert ledger.unreflected("a") == Unreflected(4, 1)
    assert ledger.unreflected("dead") == Unreflected(0, 0)


def test_burst_then_fresh_reports_resets_the_view() -> None:
    """After a report reflects the burst, the router trusts the report, not its ledger."""
    ledger = ReservationLedger(PARAMS.report_lag_s)
    reports = {"a": report(100), "b": report(100)}
    dispatch(reports, [small_request(i) for i in range(50)], ledger=ledger)
    assert ledger.unreflected("a").blocks + ledger.unreflected("b").blocks == 50
    # The replicas now report what the burst holds (25 blocks each), taken after it.
    later = {"a": report(75, timestamp=NOW + 0.5), "b": report(75, timestamp=NOW + 0.5)}
    views = views_for(later, ledger)
    assert [(v.unreflected_blocks, v.unreflected_requests) for v in views] == [(0, 0), (0, 0)]
    assert [ledger.outstanding(k) for k in later] == [25, 25]


# ---------------------------------------------------------------- parsing and parameters


def test_report_parsing() -> None:
    assert ReplicaReport.from_stats(None) is None
    assert ReplicaReport.from_stats({}) is None
    assert ReplicaReport.from_stats({"free_blocks": 3}) is None
    assert ReplicaReport.from_stats({"free_blocks": 1, "total_blocks": 1, "block_size": 0, "timestamp": 1.0}) is None
    rep = ReplicaReport.from_stats(
        {"free_blocks": 5, "total_blocks": 9, "block_size": 16, "timestamp": 2.0, "prefix_hashes": [3, 4]}
    )
    assert rep is not None and rep.prefix_hashes == frozenset({3, 4}) and rep.num_waiting == 0
    assert rep.healthy  # reports without the field (older replicas) count as healthy
    # Older replicas send no capacity fields: the reference device, rate unknown.
    assert (rep.capacity_weight, rep.prefill_tokens_per_s) == (1.0, 0.0)
    base = {"free_blocks": 5, "total_blocks": 9, "block_size": 16, "timestamp": 2.0}
    fast = ReplicaReport.from_stats({**base, "capacity_weight": 2.5, "prefill_tokens_per_s": 90_000.0})
    assert fast is not None and (fast.capacity_weight, fast.prefill_tokens_per_s) == (2.5, 90_000.0)
    assert ReplicaReport.from_stats({**base, "capacity_weight": -1.0}) is None


def test_params_from_kwargs() -> None:
    p = RoutingParams.from_kwargs({"stats_period_s": 0.5, "load_gate_threshold": 4})
    assert p.stale_after_s == pytest.approx(1.5)
    with pytest.raises(ValueError, match="unknown"):
        RoutingParams.from_kwargs({"load_gate": 4})
    with pytest.raises(ValueError, match="headroom_share"):
        RoutingParams(headroom_share=0.0)


# ---------------------------------------------------------------- work, affinity release, weights


def test_prefill_rate_is_measured_or_reference_times_weight() -> None:
    base = report(100)
    assert scoring.prefill_rate(base, PARAMS) == 40_000.0
    assert scoring.prefill_rate(replace(base, capacity_weight=0.5), PARAMS) == 20_000.0
    assert scoring.prefill_rate(replace(base, capacity_weight=0.5, prefill_tokens_per_s=55_000.0), PARAMS) == 55_000.0


def test_affinity_released_once_the_owner_cannot_prefill_within_target() -> None:
    prefix = list(range(512))
    req = prefix_requests(prefix, 1)[0]  # 520 tokens, 32 blocks cached on the owner: 8 uncached
    hashes = hash_full_blocks(prefix, BS)

    def rank(waiting_tokens: int) -> Ranking:
        owner = replace(report(1000, prefix_hashes=hashes), num_waiting_prompt_tokens=waiting_tokens)
        reports = {"owner": owner, "cold": report(1000)}
        return rank_replicas(req, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0))

    # 40k tok/s x 2 s = 80_000 tokens the owner may have queued, this request's 8 included.
    kept = rank(79_992)
    assert kept.scores["owner"].within_target
    assert (kept.mode, kept.order) == (MODE_AFFINITY, ("owner", "cold"))
    # One token more: released (no affinity), ranked by rank_key, where the owner's credit
    # (1.0) still outweighs its 2 s of queued prefill (-1.0) against the cold fill.
    released = rank(79_993)
    assert not released.scores["owner"].within_target
    assert (released.mode, released.order) == (MODE_HEADROOM, ("owner", "cold"))
    assert released.scores["owner"].rank_key == pytest.approx((1000 - 1) / 1000 + 1.0 - 80_001 / 40_000 / 2.0)
    assert released.scores["cold"].rank_key == pytest.approx((1000 - 33) / 1000 - 520 / 40_000 / 2.0)
    # A deeper queue (2.25 s of prefill there): the cold replica's predicted TTFT wins.
    deep = rank(90_000)
    assert (deep.mode, deep.order) == (MODE_HEADROOM, ("cold", "owner"))


def test_owner_work_counts_from_dispatch_time() -> None:
    # Frozen reports: only the ledger's unreflected prefill tokens show the owner filling up.
    prefix = list(range(512))
    reports = {"owner": report(100_000, total_blocks=100_000, prefix_hashes=hash_full_blocks(prefix, BS)),
               "cold": report(100_000, total_blocks=100_000)}
    big = [RequestProfile(prompt_token_ids=prefix + [7000 + i] * 9_992, max_tokens=1) for i in range(10)]
    params = replace(PARAMS, load_gate_threshold=1e9)  # the prefill target alone
    _, rankings = dispatch(reports, big, params)
    # 10_000 uncached tokens each on the owner: 8 fit in 80_000, the 9th would not.
    assert [r.mode for r in rankings[:8]] == [MODE_AFFINITY] * 8
    assert rankings[8].mode == MODE_HEADROOM and rankings[8].order[0] == "cold"


def test_a_faster_replica_takes_more_of_a_burst() -> None:
    # Equal KV, one replica twice as fast: cold prompts of 4000 tokens split ~2:1 by work.
    reports = {"fast": replace(report(100_000, total_blocks=100_000), capacity_weight=2.0),
               "slow": report(100_000, total_blocks=100_000)}
    burst = [RequestProfile(prompt_token_ids=[50_000 + i] * 4000, max_tokens=1) for i in range(30)]
    counts, rankings = dispatch(reports, burst)
    assert counts == {"fast": 20, "slow": 10}
    assert {r.mode for r in rankings} == {MODE_HEADROOM}


def test_session_is_a_soft_preference() -> None:
    reports = {"a": report(500), "b": report(500)}
    req = small_request()
    plain = rank_replicas(req, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0))
    assert plain.order == ("a", "b")  # a tie: candidate order
    sticky = rank_replicas(req, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0),
                           RankContext(session_replica="b"))
    assert (sticky.mode, sticky.order) == (MODE_AFFINITY, ("b", "a"))
    assert sticky.scores["b"].credit == PARAMS.session_weight
    # Soft: a session replica far over its share of the load loses it.
    busy = {"a": report(500), "b": report(500, num_waiting=20)}
    gated = rank_replicas(req, views_for(busy, ReservationLedger()), PARAMS, NOW, random.Random(0), RankContext(session_replica="b"))
    assert (gated.mode, gated.order) == (MODE_LOAD_GATE, ("a", "b"))


def test_hints_count_as_cached_before_any_report_shows_the_prefix() -> None:
    prefix = list(range(512))
    req = prefix_requests(prefix, 1)[0]
    reports = {"a": report(500), "b": report(500)}
    ranking = rank_replicas(req, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0), RankContext(hints={"b": 20}))
    assert ranking.scores["b"].cached_blocks == 20 and ranking.scores["a"].cached_blocks == 0
    assert (ranking.mode, ranking.order) == (MODE_AFFINITY, ("b", "a"))
    assert ranking.prefill_tokens == {"a": 520, "b": 520 - 20 * BS}
    # A hint deeper than what a hit can cover is capped like a reported match (31 of 32 + 1).
    capped = rank_replicas(req, views_for(reports, ReservationLedger()), PARAMS, NOW, random.Random(0), RankContext(hints={"b": 99}))
    assert capped.scores["b"].cached_blocks == req.cacheable_blocks(BS) == 32


def test_policy_learns_prefix_owners_and_sessions_from_its_dispatches() -> None:
    policy = HeadroomPolicy(PARAMS)
    views = [ReplicaView("a", report(500)), ReplicaView("b", report(500))]
    for key, rep in (("a", views[0].report), ("b", views[1].report)):
        policy.on_report(key, rep, NOW)
    prefix = list(range(512))
    first = RoutingRequest("1", prefix + [1] * 8, 8)
    assert policy.rank(first, views, NOW)[0] == "a"
    policy.on_dispatch(first, "b", NOW)  # Serve sent it to b: b now holds the prefix
    second = RoutingRequest("2", prefix + [2] * 8, 8)
    assert policy.rank(second, views, NOW)[0] == "b" and policy.last_mode == MODE_AFFINITY
    # Sessions: the replica that served the session last, with no shared prefix at all.
    turn1 = RoutingRequest("3", [5] * 8, 8, session_id="s")
    policy.rank(turn1, views, NOW)
    policy.on_dispatch(turn1, "b", NOW)
    turn2 = RoutingRequest("4", [6] * 8, 8, session_id="s")
    assert policy.rank(turn2, views, NOW)[0] == "b" and policy.last_mode == MODE_AFFINITY


def test_a_long_prompt_mid_prefill_is_backlog_the_next_request_avoids() -> None:
    # Replica a admitted a 100k-token prompt and prefills it chunk by chunk: nothing is
    # waiting there, but 96k prompt tokens (2.4 s at 40k tokens/s) are still ahead of any
    # request sent to it. The TTFT term counts them: a cold request goes to b, and a is
    # past its target.
    busy = replace(report(900), num_running=1, num_running_prompt_tokens=96_000)
    scores = {k: score_replica(small_request(), ReplicaView(k, r), PARAMS) for k, r in {"a": busy, "b": report(900)}.items()}
    assert scores["a"].prefill_backlog == 96_000 and not scores["a"].within_target
    assert scores["a"].ttft_s == pytest.approx((96_000 + 8) / PARAMS.prefill_tokens_per_s)
    counts, rankings = dispatch({"a": busy, "b": report(900)}, [small_request()])
    assert counts == Counter({"b": 1}) and rankings[0].order[0] == "b"
