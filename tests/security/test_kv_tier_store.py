"""The disk KV tiers as a trust boundary (issue 48, findings 3-5): the fingerprint covers the
weights' bytes, entries are authenticated with the store's key, every malformed entry is
a miss (deleted, logged), files and directories are private, the bound holds with several
writers, a full disk recovers, and leftovers are cleaned."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import resource
import signal
import stat
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kv.disk_tier import DiskTier, entry_name, layout_fingerprint
from kv.kv_cache import KVCacheSpec
from kv.tier_entry import MAGIC
from kv.tier_store import STORE_FILE, claim_store
from worker.kvcache.weights_digest import CACHE_NAME, model_id_of

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype=torch.float32)
SHAPE = (2, 2, 4, 1, 2)
KEY = b"store-key"


def block(value: float) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).reshape(SHAPE) + value


def tier(path: Path, capacity: int = 1 << 20, shared: bool = False, key: bytes = KEY, **kw: Any) -> DiskTier:
    return DiskTier(path, capacity, SPEC, "m", shared=shared, key=key, **kw)


class _Clock:
    """The back-off's clock, stepped by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def forge(header: Any, payload: bytes, key: bytes = KEY) -> bytes:
    """An entry whose MAC is valid under `key` whatever its header says (a buggy or older
    writer that holds the key)."""
    head = json.dumps(header).encode()
    body = MAGIC + struct.pack("<I", len(head)) + head + payload
    return body + hmac.new(key, body, hashlib.sha256).digest()


# -- finding 3: the fingerprint covers the weights' contents ------------------------------------
def _checkpoint(directory: Path, weights: bytes) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def test_weights_replaced_in_place_with_the_same_size_change_the_fingerprint(tmp_path: Path) -> None:
    # Finding: names and sizes only, so new weights of the same shapes served the old KV.
    model = _checkpoint(tmp_path / "model", b"\x01" * 4096)
    before = model_id_of(model)
    (model / "model.safetensors").write_bytes(b"\x02" * 4096)  # same name, same size
    assert model_id_of(model) != before
    # Two copies of one checkpoint at different paths agree (replicas share a store).
    assert model_id_of(_checkpoint(tmp_path / "copy", b"\x02" * 4096)) == model_id_of(model)


def test_the_weights_digest_is_cached_beside_the_files_by_size_and_mtime(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "model", b"\x01" * 4096)
    first = model_id_of(model)
    cache = json.loads((model / CACHE_NAME).read_text())["files"]["model.safetensors"]
    st = (model / "model.safetensors").stat()
    assert cache[:2] == [st.st_size, st.st_mtime_ns]
    # A file whose size and mtime match its cached line is not read again: bytes changed
    # behind an unchanged (forged) mtime keep the cached digest ...
    (model / "model.safetensors").write_bytes(b"\x03" * 4096)
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_id_of(model) == first
    # ... and any real change of the mtime rehashes.
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert model_id_of(model) != first


def test_a_read_only_model_caches_its_digest_in_the_tier_root_under_the_key(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "model", b"\x01" * 4096)
    (model / CACHE_NAME).mkdir()  # the cache cannot be written beside the files
    root = tmp_path / "store-root"
    first = model_id_of(model, [root], KEY)
    (cache,) = root.glob(".weights-digest-*.json")
    st = (model / "model.safetensors").stat()
    # The cache in the tier root serves the next start: bytes changed behind a kept mtime
    # are not reread ...
    (model / "model.safetensors").write_bytes(b"\x03" * 4096)
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_id_of(model, [root], KEY) == first
    # ... but a cache rewritten without the key (here: the real digest swapped for another)
    # fails its MAC and the file is hashed again.
    data = json.loads(cache.read_text())
    data["files"]["model.safetensors"][2] = "0" * 32
    cache.write_text(json.dumps(data))
    assert model_id_of(model, [root], KEY) == model_id_of(_checkpoint(tmp_path / "copy", b"\x03" * 4096))


def test_a_store_of_replaced_weights_is_deleted_when_the_new_store_opens(tmp_path: Path) -> None:
    old = tmp_path / "aaaaaaaaaaaaaaaa"
    tier(old).put(1, block(1.0))
    claim_store(old, "/models/m", "weights-1", old.name)
    other_layout = tmp_path / "dddddddddddddddd"  # the same weights in bf16, say: maybe in use
    tier(other_layout).put(1, block(1.0))
    claim_store(other_layout, "/models/m", "weights-2", other_layout.name)
    other_model = tmp_path / "bbbbbbbbbbbbbbbb"
    tier(other_model).put(1, block(1.0))
    claim_store(other_model, "/models/other", "weights-9", other_model.name)
    new = tmp_path / "cccccccccccccccc"
    tier(new)
    claim_store(new, "/models/m", "weights-2", new.name)  # the same path, new weights
    assert not old.exists()  # never servable again: gone
    assert (other_layout / entry_name(1)).is_file() and (other_model / entry_name(1)).is_file()  # kept
    assert json.loads((new / STORE_FILE).read_text())["model_id"] == "weights-2"


# -- finding 4: authenticated, private, malformed entries are misses -----------------------------
def test_an_entry_written_without_the_key_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Finding: the checksum sat inside the file, so anyone who could write the directory
    # could plant KV that every replica served.
    keyed = tier(tmp_path)
    tier(tmp_path, key=b"").put(7, block(1.0))  # no key: a plain writer of the directory
    tier(tmp_path, key=b"another-key").put(8, block(2.0))
    keyed.refresh()
    with caplog.at_level(logging.WARNING, logger="kv.disk_tier"):
        assert keyed.get(7) is None and keyed.get(8) is None
    assert keyed.num_dropped == 2 and not (tmp_path / entry_name(7)).exists()
    assert "authentication failed" in caplog.text
    keyed.put(9, block(3.0))
    assert torch.equal(tier(tmp_path).get(9), block(3.0))  # the key's holders read each other


def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        t = tier(tmp_path / "store", shared=True)
        t.put(1, block(1.0))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "store" / entry_name(1)).stat().st_mode) == 0o600


def _payload() -> bytes:
    return block(1.0).view(torch.uint8).numpy().tobytes()


FINGERPRINT = layout_fingerprint(SPEC, "m")
GOOD = {"fingerprint": FINGERPRINT, "block_hash": f"{5:016x}", "shape": list(SHAPE), "nbytes": 128}
MALFORMED = {
    "a list": [1, 2, 3],
    "a string": "header",
    "an int shape": {**GOOD, "shape": 5},
    "a shape of strings": {**GOOD, "shape": ["2", "2", "4", "1", "2"]},
    "a short nbytes": {**GOOD, "nbytes": 64},
    "a string nbytes": {**GOOD, "nbytes": "128"},
    "no fields": {},
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_entry_with_a_valid_mac_is_a_miss_deleted_and_logged(
        tmp_path: Path, what: str, caplog: pytest.LogCaptureFixture) -> None:
    # Finding: a valid checksum with a bad header (a list, an int shape, a short nbytes)
    # raised past DiskTier.get into the engine loop, and the entry stayed.
    payload = _payload()
    if what == "a short nbytes":
        payload = payload[:64]
    path = tmp_path / entry_name(5)
    t = tier(tmp_path)
    path.write_bytes(forge(MALFORMED[what], payload))
    t.refresh()
    with caplog.at_level(logging.WARNING, logger="kv.disk_tier"):
        assert t.get(5) is None
    assert t.num_dropped == 1 and not path.exists() and 5 not in t
    assert "dropped" in caplog.text
    path.write_bytes(forge(GOOD, _payload()))  # the forge itself is sound: a good header serves
    assert torch.equal(t.get(5), block(1.0))


# -- finding 5: bounded across writers, ENOSPC recovers, leftovers cleaned -----------------------
def test_the_shared_bound_holds_with_several_writers(tmp_path: Path) -> None:
    # Finding: the bound was per process: 4 writers with a 10-entry bound left 40 entries.
    probe = tier(tmp_path / "probe")
    probe.put(0, block(0.0))
    entry_bytes = probe.num_bytes
    writers = [tier(tmp_path / "store", capacity=10 * entry_bytes, shared=True) for _ in range(4)]
    for i in range(10):  # interleaved, as replicas publish
        for w, writer in enumerate(writers):
            assert writer.put(1000 * w + i, block(float(i)))
            total = sum(p.stat().st_size for p in (tmp_path / "store").glob("*.kv"))
            assert total <= 12 * entry_bytes  # never far over, whoever writes
    total = sum(p.stat().st_size for p in (tmp_path / "store").glob("*.kv"))
    assert total <= 10 * entry_bytes


def test_writing_resumes_after_a_full_disk_once_space_is_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Finding: after ENOSPC `writable` stayed False for good. A file-size limit makes the
    # kernel refuse the write (EFBIG) as a full disk would (ENOSPC); both are OSErrors.
    clock = _Clock()
    t = tier(tmp_path, retry_after_s=0.2, clock=clock)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
        with caplog.at_level(logging.WARNING, logger="kv.disk_tier"):
            assert not t.put(1, block(1.0))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert not t.writable and "not writable" in caplog.text
    assert not list(tmp_path.glob(".*.tmp"))  # the failed write left nothing behind
    assert not t.put(2, block(2.0))  # within the back-off: not tried
    clock.now += 0.25
    assert t.put(3, block(3.0)) and t.writable  # space is back: writes go on
    assert torch.equal(t.get(3), block(3.0))


def test_a_vanished_directory_is_made_again_after_the_back_off(tmp_path: Path) -> None:
    clock = _Clock()
    t = tier(tmp_path / "store", retry_after_s=0.1, clock=clock)
    (tmp_path / "store").rename(tmp_path / "gone")  # the volume went away
    assert not t.put(1, block(1.0)) and not t.writable
    clock.now += 0.15
    assert t.put(2, block(2.0)) and (tmp_path / "store" / entry_name(2)).is_file()


def test_leftover_temporary_files_are_deleted_when_a_store_opens(tmp_path: Path) -> None:
    # Finding: a crashed writer's .tmp files stayed for good.
    stale = tmp_path / f".{entry_name(1)}.0123.tmp"
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = tmp_path / f".{entry_name(2)}.4567.tmp"  # maybe another writer's, right now
    fresh.write_bytes(b"y")
    tier(tmp_path, shared=True)
    assert not stale.exists() and fresh.exists()
