"""Replicas report their own KV geometry (kv/kv_geometry.py) and the router counts a
request's need, a replica's growth and its load share by it: a fleet mixing a
sliding-window model and a full-attention one is scored in each replica's own blocks.
The gpt-oss-class simulated shape reports what its engine's KV manager holds."""
from __future__ import annotations

import pytest

from benchmarks.models_kv import sliding_kv_blocks_vs_full
from kv.cache_manager import cdiv
from kv.kv_geometry import KVGeometry
from kv.kv_groups import layout_for_windows
from router.routing.scoring import decode_blocks, load_shares, score_replica
from router.routing.types import ReplicaReport, ReplicaView, RequestProfile, RoutingParams
from worker.api import SamplingParams
from worker.config import CacheConfig, SchedulerConfig
from worker.serving.routing_report import build_routing_stats
from worker.sim.build import build_sim_engine
from worker.costs.shapes import load_shape

BS = 16
PARAMS = RoutingParams(stats_period_s=1.0, stale_after_periods=3.0, expected_output_tokens=256)


def _parse(free: int, total: int, **geometry: object) -> ReplicaReport | None:
    stats = {"free_blocks": free, "total_blocks": total, "block_size": BS, "num_waiting": 0,
             "reserved_blocks": 0, "prefix_hashes": [], "timestamp": 0.0, **geometry}
    return ReplicaReport.from_stats(stats)


def _report(free: int, total: int, **geometry: object) -> ReplicaReport:
    report = _parse(free, total, **geometry)
    assert report is not None
    return report


def test_geometry_counts_every_group_and_the_window() -> None:
    plain = KVGeometry(BS)
    assert plain.blocks_for_tokens(1000) == cdiv(1000, BS)
    gemma = KVGeometry.from_layout(layout_for_windows([1024] * 5 + [None]), BS)  # 1 full, 5 sliding
    assert (gemma.num_full_groups, gemma.sliding_windows) == (1, (1024,) * 5)
    n = cdiv(32_000, BS)
    assert gemma.blocks_for_tokens(32_000) == n + 5 * (cdiv(1023, BS) + 2)
    assert gemma.blocks_for_tokens(100) == 6 * cdiv(100, BS)  # inside the window every group grows
    assert gemma.token_capacity(6000) == 6000 * BS


def test_a_report_without_geometry_is_one_full_group() -> None:
    report = _report(1000, 1000)
    assert report.geometry == KVGeometry(BS)
    assert _parse(1000, 1000, kv_full_groups=0, kv_sliding_windows=()) is None  # no group at all
    assert _parse(1000, 1000, kv_sliding_windows=[0]) is None


def test_need_on_a_sliding_replica_is_its_own_blocks() -> None:
    """A 32k-token prompt: the Gemma-like replica needs one full group's blocks plus five
    windows; a full-attention replica one block per 16 tokens. Each is scored in its own."""
    request = RequestProfile(prompt_token_ids=[5] * 32_000, max_tokens=1)
    gemma = _report(20_000, 20_000, kv_full_groups=1, kv_sliding_windows=[1024] * 5)
    llama = _report(20_000, 20_000)
    need_gemma = score_replica(request, ReplicaView("g", gemma), PARAMS).need_blocks
    need_llama = score_replica(request, ReplicaView("l", llama), PARAMS).need_blocks
    assert need_llama == cdiv(32_001, BS)
    assert need_gemma == cdiv(32_001, BS) + 5 * (cdiv(1023, BS) + 2)
    # a Mistral-like replica (every layer sliding) needs only its window
    mistral = _report(100, 100, kv_full_groups=0, kv_sliding_windows=[1024])
    assert score_replica(request, ReplicaView("m", mistral), PARAMS).need_blocks == cdiv(1023, BS) + 2
    assert score_replica(request, ReplicaView("m", mistral), PARAMS).fits


def test_decode_blocks_follow_the_geometry() -> None:
    request = RequestProfile(prompt_token_ids=[5] * 4096, max_tokens=4096)
    mistral = _report(100, 100, kv_full_groups=0, kv_sliding_windows=[1024])
    assert decode_blocks(request, BS, 4096, mistral) == 0  # past the window nothing grows
    assert decode_blocks(request, BS, 4096) == 256


def test_load_shares_compare_tokens_not_blocks() -> None:
    """Two replicas of the same memory: the one with two groups has twice the blocks of half
    the bytes; it holds as many long-sequence tokens, so it gets the same share."""
    request = RequestProfile(prompt_token_ids=[5] * 64, max_tokens=16)
    full = _report(1000, 1000)
    two = _report(2000, 2000, kv_full_groups=2, kv_sliding_windows=[])
    scores = [score_replica(request, ReplicaView("f", full), PARAMS),
              score_replica(request, ReplicaView("t", two), PARAMS)]
    shares = load_shares(scores)
    assert shares["f"] == pytest.approx(shares["t"])


def test_gpt_oss_shape_reports_its_geometry_and_holds_its_window() -> None:
    shape = load_shape("gpt-oss-20b")
    layout = shape.kv_layout()
    assert layout.layers_per_group == 12 and layout.num_groups == 2
    assert shape.kv_block_bytes(BS) * 2 == load_shape("gpt-oss-20b").kv_bytes_per_token() * BS
    engine = build_sim_engine(shape, "h200", SchedulerConfig(max_num_batched_tokens=512),
                              CacheConfig(block_size=BS), sleep=False)
    engine.add_request("a", [7] * 2000, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):
        engine.step()
    held = engine.kv.num_held_blocks("a")
    assert held[0] == cdiv(engine.seqs["a"].num_computed_tokens + 1, BS) or held[0] >= 125
    assert held[1] <= cdiv(127, BS) + 2
    stats = build_routing_stats(engine, engine.stats(), [], timestamp=1.0)
    assert (stats.kv_full_groups, stats.kv_sliding_windows) == (1, (128,))
    assert stats.kv_bytes_per_block == shape.kv_block_bytes(BS)
    report = ReplicaReport.from_stats(stats.to_dict())
    assert report is not None and report.geometry.sliding_windows == (128,)


def test_sliding_kv_blocks_vs_full_measures_what_the_geometry_says() -> None:
    result = sliding_kv_blocks_vs_full(prompt_tokens=2048, output_tokens=64)
    assert result["measured"] == pytest.approx(result["expected"])
    assert 0.5 < result["measured"] < 0.6  # half the layers hold a window's worth

