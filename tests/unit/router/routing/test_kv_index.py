"""The router's exact KV index (router/routing/kv_index.py), with exact hashes: events
applied in order, a gap rebuilds from the snapshot, a new epoch drops the old entries at
once, tier moves change the tier a hit is scored at, and a real engine's events keep the
index equal to its block pool's cache."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from kv.block_hash import hash_full_blocks
from kv.kv_events import CLEARED, DEVICE, DISK, HOST, MOVED, REMOVED, STORED, KVEvent, KVEventBatch
from router.routing.kv_index import APPLIED, DROPPED, REBUILT, KVIndex
from router.routing.routing_view import LocalRoutingView
from router.routing.scoring import score_replica
from router.routing.types import ReplicaReport, ReplicaView, RequestProfile, RoutingParams
from tests.support.fake_runner import TOKEN, VOCAB, FakeRunner
from worker.api import SamplingParams
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.kvcache.event_stream import KVEventStream
from worker.serving.routing_report import build_routing_stats

BS = 4
PROMPT = list(range(1, 18))  # 4 full blocks (16 tokens) + 1; 4 cacheable
H = hash_full_blocks(PROMPT, BS)


def stats(epoch: str, seq: int, batches: list[KVEventBatch], snapshot_seq: int = 0,
          device: list[int] | None = None, host: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    return {"free_blocks": 100, "total_blocks": 100, "block_size": BS, "timestamp": float(seq), "kv_epoch": epoch,
            "kv_seq": seq, "kv_events": batches, "kv_snapshot_seq": snapshot_seq, "prefix_hashes": device or [],
            "host_prefix_hashes": host or [], "disk_prefix_hashes": [], **extra}


def batch(seq: int, *events: KVEvent) -> KVEventBatch:
    return KVEventBatch(seq, events)


def test_events_apply_in_order_and_a_report_is_applied_once() -> None:
    index = KVIndex()
    b1 = batch(1, KVEvent(STORED, (H[0], H[1], H[2]), DEVICE))
    b2 = batch(2, KVEvent(MOVED, (H[2],), DEVICE, HOST), KVEvent(STORED, (H[3],), DISK))
    held = index.apply("r", stats("e1", 1, [b1]))
    assert held is not None and held.device == {H[0], H[1], H[2]} and held.seq == 1
    # The window overlaps the last report: batch 1 again is skipped, batch 2 applied.
    held = index.apply("r", stats("e1", 2, [b1, b2]))
    assert held.device == {H[0], H[1]} and held.host == {H[2]} and held.disk == {H[3]} and held.seq == 2
    index.apply("r", stats("e1", 3, [batch(3, KVEvent(REMOVED, (H[1], 999), DEVICE))]))  # 999: never held
    assert held.device == {H[0]} and index.num_reports == {APPLIED: 2, REBUILT: 1, DROPPED: 0}
    index.apply("r", stats("e1", 4, [batch(4, KVEvent(CLEARED))]))
    assert held.device == held.host == held.disk == set()


def test_a_gap_rebuilds_the_replica_from_the_snapshot_then_applies_what_follows() -> None:
    index = KVIndex()
    index.apply("r", stats("e1", 1, [batch(1, KVEvent(STORED, (H[0],), DEVICE))]))
    # Batches 2-4 missed (reports this router never saw); the snapshot is exact at 3.
    b4 = batch(4, KVEvent(STORED, (H[3],), DEVICE))
    held = index.apply("r", stats("e1", 4, [b4], snapshot_seq=3, device=[H[1], H[2]], host=[H[0]]))
    assert index.num_gaps == 1
    assert held.device == {H[1], H[2], H[3]} and held.host == {H[0]} and held.seq == 4


def test_a_new_epoch_drops_the_old_entries_at_once() -> None:
    index = KVIndex()
    index.apply("r", stats("e1", 2, [batch(1, KVEvent(STORED, tuple(H), DEVICE))]))
    held = index.apply("r", stats("e2", 0, []))  # the engine restarted: an empty cache, seq from 0
    assert held.epoch == "e2" and held.device == set() and index.num_reports[DROPPED] == 1


def test_a_replica_that_leaves_is_forgotten_and_one_without_events_is_not_indexed() -> None:
    index = KVIndex()
    index.apply("a", stats("e1", 1, [batch(1, KVEvent(STORED, (H[0],), DEVICE))]))
    index.apply("b", stats("e1", 1, [batch(1, KVEvent(STORED, (H[0],), DEVICE))]))
    index.forget({"b"})
    assert "a" not in index and "b" in index
    assert index.apply("b", {**stats("", 0, []), "prefix_hashes": [H[0]]}) is None and "b" not in index


def view_of(held_device: set[int], held_host: set[int], held_disk: set[int]) -> ReplicaView:
    report = ReplicaReport.from_stats(stats("e1", 0, []))
    assert report is not None
    report = replace(report, prefix_hashes=held_device, host_prefix_hashes=held_host,
                     disk_prefix_hashes=held_disk, kv_exact=True)
    return ReplicaView("r", report)


def test_tier_moves_change_the_tier_a_hit_is_scored_at() -> None:
    params = RoutingParams()
    request = RequestProfile(PROMPT, max_tokens=4)
    index = KVIndex()
    held = index.apply("r", stats("e1", 1, [batch(1, KVEvent(STORED, tuple(H), DEVICE))]))
    on_device = score_replica(request, view_of(held.device, held.host, held.disk), params)
    index.apply("r", stats("e1", 2, [batch(2, KVEvent(MOVED, (H[2], H[3]), DEVICE, HOST))]))
    half_host = score_replica(request, view_of(held.device, held.host, held.disk), params)
    index.apply("r", stats("e1", 3, [batch(3, KVEvent(MOVED, (H[3],), HOST, DISK))]))
    with_disk = score_replica(request, view_of(held.device, held.host, held.disk), params)
    assert on_device.cached_blocks == 4 and on_device.credit == params.prefix_weight
    assert half_host.cached_blocks == 2
    assert half_host.credit == params.prefix_weight * (2 + 2 * params.host_hit_weight) / 4
    assert with_disk.credit == params.prefix_weight * (2 + params.host_hit_weight + params.disk_hit_weight) / 4
    assert on_device.ttft_s < half_host.ttft_s < with_disk.ttft_s  # loads take time; disk longer


def test_hints_learned_before_a_replica_started_empty_do_not_count() -> None:
    view = LocalRoutingView()
    view.learn_prefix("r", H, now=100.0)
    assert view.prefix_owner_hints(H) == {"r": 4}
    assert view.prefix_owner_hints(H, not_before={"r": 150.0}) == {}
    view.learn_prefix("r", H[:2], now=200.0)  # sent there again after the clear
    assert view.prefix_owner_hints(H, not_before={"r": 150.0}) == {"r": 2}


def test_a_real_engines_events_keep_the_index_equal_to_its_cache() -> None:
    """The engine core over a model-free runner, 12 blocks: prompts that share a prefix,
    evictions, a reset. After every step's report the index holds exactly the pool's cache."""
    scheduler = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    engine = Engine(scheduler, CacheConfig(block_size=BS, num_blocks_override=12), FakeRunner(12, TOKEN), VOCAB)
    stream = KVEventStream(engine.enable_kv_events())
    index = KVIndex()
    prompts = [PROMPT, PROMPT[:9] + [40] * 8, [30 + i for i in range(20)], PROMPT]
    checked = 0
    for i, prompt in enumerate(prompts + ["reset", PROMPT]):
        if prompt == "reset":
            engine.reset_prefix_cache()
        else:
            engine.add_request(f"q{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0))
        while True:
            engine.step()
            stream.drain()
            report = build_routing_stats(engine, engine.stats(), [], float(checked), kv_events=stream.report())
            held = index.apply("r", report.to_dict())
            assert held is not None and held.device == set(engine.kv.pool.cached), (i, checked)
            checked += 1
            if not engine.has_unfinished():
                break
    assert engine.kv.pool.num_evictions > 0 and index.num_reports[REBUILT] == 1 and index.num_gaps == 0
