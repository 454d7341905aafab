"""DiskTier: round trip, the checks that keep a bad entry from being served, the byte bound,
a directory that stops taking writes, and writers sharing one directory."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from kv.disk_tier import DiskTier, entry_name
from kv.kv_cache import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype=torch.float32)
SHAPE = (2, 2, 4, 1, 2)


def block(value: float) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).reshape(SHAPE) + value


def tier(path: Path, capacity: int = 1 << 20, model: str = "m", shared: bool = False) -> DiskTier:
    return DiskTier(path, capacity, SPEC, model, shared=shared)


def test_round_trip_and_reopen(tmp_path: Path) -> None:
    t = tier(tmp_path)
    assert t.put(0xABC, block(1.0))
    assert 0xABC in t and 0xABD not in t
    assert torch.equal(t.get(0xABC), block(1.0))
    assert (tmp_path / "0000000000000abc.kv").is_file()
    again = tier(tmp_path)  # a restarted replica finds its entries
    assert 0xABC in again and torch.equal(again.get(0xABC), block(1.0))


def test_bfloat16_blocks_round_trip(tmp_path: Path) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype=torch.bfloat16)
    t = DiskTier(tmp_path, 1 << 20, spec, "m")
    kv = block(0.5).to(torch.bfloat16)
    t.put(1, kv)
    assert torch.equal(t.get(1), kv)


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "wrong_hash", "garbage"])
def test_bad_entries_are_dropped_never_served(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    t = tier(tmp_path)
    t.put(5, block(1.0))
    path = tmp_path / entry_name(5)
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[:-10]))
    elif damage == "foreign":  # another model's KV under the same chain hash
        tier(tmp_path / "other", model="another-model").put(5, block(2.0))
        path.write_bytes((tmp_path / "other" / entry_name(5)).read_bytes())
    elif damage == "wrong_hash":  # a valid entry of block 6 copied under 5's name
        t.put(6, block(3.0))
        path.write_bytes((tmp_path / entry_name(6)).read_bytes())
    else:
        path.write_bytes(b"not a kv entry at all")
    with caplog.at_level(logging.WARNING, logger="kv.disk_tier"):
        assert t.get(5) is None
    assert t.num_dropped == 1 and 5 not in t and not path.exists()
    assert "dropped" in caplog.text


def test_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.put(1, block(1.0))
    entry_bytes = t.num_bytes
    t = tier(tmp_path, capacity=3 * entry_bytes)
    t.put(2, block(2.0))
    t.put(3, block(3.0))
    t.get(1)  # 2 is the least recently used now
    t.put(4, block(4.0))
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == [entry_name(h) for h in (1, 3, 4)]
    assert [h for h in (1, 2, 3, 4) if h in t] == [1, 3, 4] and t.num_bytes == 3 * entry_bytes


def test_unwritable_directory_degrades_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = tier(tmp_path / "store")
    t.put(1, block(1.0))
    (tmp_path / "store" / entry_name(1)).unlink()
    (tmp_path / "store").rmdir()  # the volume went away
    with caplog.at_level(logging.WARNING, logger="kv.disk_tier"):
        assert not t.put(2, block(2.0))
        assert not t.put(3, block(3.0))
    assert not t.writable
    assert len([r for r in caplog.records if "not writable" in r.message]) == 1
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    with caplog.at_level(logging.WARNING, logger="kv.disk_tier"):
        t2 = tier(blocked / "store")  # cannot even be created
    assert not t2.writable and not t2.put(1, block(1.0)) and t2.get(1) is None


def test_concurrent_writers_share_one_directory(tmp_path: Path) -> None:
    writers = [tier(tmp_path, shared=True) for _ in range(4)]

    def write(t: DiskTier) -> None:
        for h in range(40):
            assert t.put(h, block(float(h)))

    threads = [threading.Thread(target=write, args=(t,)) for t in writers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not list(tmp_path.glob(".*.tmp"))  # every temporary file was renamed
    reader = tier(tmp_path, shared=True)
    for h in range(40):
        assert torch.equal(reader.get(h), block(float(h)))
    assert reader.num_dropped == 0


def test_shared_store_sees_peers_and_bounds_the_whole_directory(tmp_path: Path) -> None:
    a = tier(tmp_path, shared=True)
    a.put(1, block(1.0))
    entry_bytes = a.num_bytes
    b = tier(tmp_path, capacity=2 * entry_bytes, shared=True)
    a.put(2, block(2.0))  # written after b started: b's view learns it at its next refresh
    assert 2 not in b  # no file-system call on a lookup
    b.refresh()  # what the tier manager's I/O thread runs every SHARED_REFRESH_S
    assert 2 in b and torch.equal(b.get(2), block(2.0))
    b.put(3, block(3.0))  # three entries in a two-entry store: b rescans, cuts below the bound
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == [entry_name(3)]  # oldest first: 1, 2
    assert 1 not in b and a.get(1) is None  # a's view heals on the miss
