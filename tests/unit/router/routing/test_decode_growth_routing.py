"""The router's use of the replicas' decode forecast (router/routing/scoring.py, router/routing/types.py):
decode_growth_blocks counts against capacity, mean_output_tokens sets a request's decode."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from router.routing.types import RoutingParams, ReplicaReport, ReplicaView, RequestProfile
from router.routing.scoring import score_replica
from router.routing.policies.headroom import MODE_HEADROOM, MODE_POW2, rank_replicas

BS = 16
NOW = 1_000.0
PARAMS = RoutingParams(stats_period_s=1.0, stale_after_periods=3.0, expected_output_tokens=256)
BASE = {"free_blocks": 100, "total_blocks": 1000, "block_size": BS, "timestamp": NOW - 0.5}


def report(**fields: object) -> ReplicaReport:
    parsed = ReplicaReport.from_stats({**BASE, **fields})
    assert parsed is not None
    return parsed


def test_old_reports_parse_without_the_new_fields() -> None:
    old = report()
    assert (old.decode_growth_blocks, old.mean_output_tokens) == (0, 0.0)
    new = report(decode_growth_blocks=12, mean_output_tokens=57.5)
    assert (new.decode_growth_blocks, new.mean_output_tokens) == (12, 57.5)


@pytest.mark.parametrize("bad", [{"decode_growth_blocks": -1}, {"mean_output_tokens": -0.5},
                                 {"mean_output_tokens": float("nan")}, {"decode_growth_blocks": "x"}])
def test_negative_or_malformed_forecasts_are_rejected(bad: dict[str, object]) -> None:
    assert ReplicaReport.from_stats({**BASE, **bad}) is None


def test_expected_output_is_the_observed_mean_else_the_parameter() -> None:
    assert report().expected_output_tokens(PARAMS) == 256
    assert report(mean_output_tokens=40.4).expected_output_tokens(PARAMS) == 40


def test_capacity_subtracts_growth_and_need_uses_the_observed_mean() -> None:
    req = RequestProfile(prompt_token_ids=list(range(40)), max_tokens=100)
    # Without a mean: 40 + min(100, 256) = 140 tokens = 9 blocks; capacity 100 - 10 - 30.
    s = score_replica(req, ReplicaView("r", report(reserved_blocks=10, decode_growth_blocks=30)), PARAMS)
    assert (s.capacity, s.need_blocks, s.score) == (60, 9, 51)
    # A mean of 24 output tokens: 64 tokens = 4 blocks.
    s = score_replica(req, ReplicaView("r", report(reserved_blocks=10, decode_growth_blocks=30,
                                                   mean_output_tokens=24.0)), PARAMS)
    assert (s.capacity, s.need_blocks, s.score) == (60, 4, 56)
    # Growth beyond what is free leaves no capacity (not a negative one).
    assert score_replica(req, ReplicaView("r", report(decode_growth_blocks=500)), PARAMS).capacity == 0


def test_a_replica_whose_requests_will_grow_ranks_below_one_that_will_not() -> None:
    req = RequestProfile(prompt_token_ids=list(range(40)), max_tokens=100)
    growing = ReplicaView("growing", report(free_blocks=300, decode_growth_blocks=150))
    settled = ReplicaView("settled", report(free_blocks=300))
    for views in ([growing, settled], [settled, growing]):
        ranking = rank_replicas(req, views, PARAMS, NOW, random.Random(0))
        assert ranking.mode == MODE_HEADROOM and ranking.order[0] == "settled"
        assert ranking.scores["growing"].score == 150 - 9 and ranking.scores["settled"].score == 300 - 9


def test_growth_past_free_blocks_makes_a_replica_not_fit() -> None:
    req = RequestProfile(prompt_token_ids=list(range(40)), max_tokens=100)
    full = ReplicaView("full", report(free_blocks=300, decode_growth_blocks=295))
    other = ReplicaView("other", report(free_blocks=50))
    ranking = rank_replicas(req, [full, other], PARAMS, NOW, random.Random(0))
    assert ranking.order == ("other", "full") and not ranking.scores["full"].fits


def test_the_ledger_and_stale_paths_use_the_replicas_mean() -> None:
    req = RequestProfile(prompt_token_ids=list(range(40)), max_tokens=100)
    short = ReplicaView("short", report(mean_output_tokens=8.0))
    ranking = rank_replicas(req, [short], PARAMS, NOW, random.Random(0))
    # 40 + 8 = 48 tokens = 3 blocks, all prompt blocks: the decode adds none.
    assert (ranking.need_blocks["short"], ranking.decode_blocks) == (3, 0)
    stale = replace(short, report=replace(short.report, timestamp=NOW - 100.0))  # type: ignore[type-var]
    ranking = rank_replicas(req, [stale], PARAMS, NOW, random.Random(0))
    assert ranking.mode == MODE_POW2 and ranking.need_blocks["short"] == 3
