"""KV events (kv/kv_events.py) as the block pool and the tiers record them, and the
replica's numbered stream of them (worker/kvcache/event_stream.py), with exact hashes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kv.block_pool import BlockPool
from kv.disk_tier import DiskTier
from kv.host_tier import HostTier
from kv.kv_cache import KVCacheSpec
from kv.kv_events import CLEARED, DEVICE, DISK, HOST, MOVED, REMOVED, STORED, KVEvent, KVEventLog
from worker.kvcache.event_stream import KVEventStream
from worker.kvcache.tiers import TierManager

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, dtype=torch.float32)


class TensorRunner:
    """A KV-transfer runner over a plain KV tensor (the tiers' copies, no model)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv = torch.arange(num_blocks * 2 * 4 * 2, dtype=torch.float32).reshape(1, 2, num_blocks * 4, 1, 2)

    @property
    def kv_spec(self) -> KVCacheSpec:
        return SPEC

    def execute(self, plan: object) -> None:
        raise AssertionError("not stepped here")

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        return torch.cat([self.kv[:, :, b * 4:(b + 1) * 4] for b in block_ids], dim=2).clone()

    def import_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        for i, b in enumerate(block_ids):
            self.kv[:, :, b * 4:(b + 1) * 4] = kv[:, :, i * 4:(i + 1) * 4]


def cache(pool: BlockPool, *hashes: int) -> list:
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.free(reversed(blocks))
    return blocks


def test_pool_records_stored_evicted_and_cleared_folded_per_kind() -> None:
    pool = BlockPool(3)
    log = pool.events = KVEventLog()
    cache(pool, 101, 102, 103)
    pool.allocate(2)  # evicts the two least recently freed: 103, then 102 (freed tail first)
    assert log.drain() == [KVEvent(STORED, (101, 102, 103), DEVICE), KVEvent(REMOVED, (103, 102), DEVICE)]
    assert log.drain() == []
    pool.reset_prefix_cache()
    cache(pool, 104)
    assert log.drain() == [KVEvent(CLEARED), KVEvent(STORED, (104,), DEVICE)]


def test_an_event_needs_a_known_kind_and_tiers() -> None:
    with pytest.raises(ValueError):
        KVEvent("evicted", (1,), DEVICE)
    with pytest.raises(ValueError):
        KVEvent(MOVED, (1,), DEVICE, DEVICE)


def test_tiers_record_moves_down_and_push_outs(tmp_path: Path) -> None:
    """Device -> host is one `moved`; a block the host holds already is only `removed` from
    the device; the host's push-outs are `removed` there and `stored` on disk once written."""
    pool = BlockPool(4)
    log = KVEventLog()
    pool.events, pool.evicted = log, []
    disk = DiskTier(tmp_path / "disk", 1 << 20, SPEC, "m")
    tiers = TierManager(TensorRunner(4), SPEC, HostTier(SPEC, 2), disk)
    tiers.use_events(log)
    cache(pool, 11, 12, 13, 14)
    log.drain()
    pool.allocate(3)  # evicts 14, 13, 12 (the pool's freed order), 11 stays
    tiers.offload(pool.evicted)  # the host has 2 slots: 14 goes on to the disk
    tiers.flush()
    assert log.drain() == [KVEvent(MOVED, (14, 13, 12), DEVICE, HOST), KVEvent(REMOVED, (14,), HOST),
                           KVEvent(STORED, (14,), DISK)]
    assert set(tiers.host.hashes()) == {13, 12} and disk.knows(14)
    pool.free(pool.allocate(1))  # evicts 11: new to the host, which pushes 13 out
    tiers.offload(pool.evicted)
    tiers.flush()
    assert log.drain() == [KVEvent(MOVED, (11,), DEVICE, HOST), KVEvent(REMOVED, (13,), HOST),
                           KVEvent(STORED, (13,), DISK)]
    tiers.close()


def test_stream_numbers_batches_and_windows_them_for_reports() -> None:
    log = KVEventLog()
    stream = KVEventStream(log, retain_reports=2)
    assert stream.drain() is None  # nothing happened: no batch, no seq
    log.stored(1, DEVICE)
    first = stream.drain()
    log.removed(1, DEVICE)
    second = stream.drain()
    assert first is not None and second is not None and (first.seq, second.seq) == (1, 2)
    report = stream.report()
    assert report["kv_seq"] == 2 and report["kv_events"] == [first, second] and report["kv_snapshot_seq"] == 0
    stream.take_snapshot([5], [], [])  # exact at seq 2
    log.stored(6, DEVICE)
    third = stream.drain()
    # The window reaches back to the report 2 reports ago (a router that missed one
    # catches up) ...
    assert stream.report()["kv_events"] == [first, second, third]
    # ... or to the snapshot, whichever is older: a rebuild finds every batch after it.
    report = stream.report()
    assert report["kv_events"] == [third] and report["kv_seq"] == 3
    assert report["kv_snapshot_seq"] == 2 and report["prefix_hashes"] == [5]


def test_trimming_keeps_every_batch_after_the_snapshot() -> None:
    log = KVEventLog()
    stream = KVEventStream(log, max_hashes=2, retain_reports=1)
    for h in range(5):
        log.stored(h, DEVICE)
        stream.drain()
    # Over max_hashes, but none is older than the snapshot (seq 0): all stay.
    assert [b.seq for b in stream.report()["kv_events"]] == [1, 2, 3, 4, 5]
    stream.take_snapshot([4, 3, 2, 1, 0], [], [])
    assert stream.report()["kv_events"] == []
    log.stored(9, DEVICE)
    stream.drain()
    assert [b.seq for b in stream.report()["kv_events"]] == [6]
