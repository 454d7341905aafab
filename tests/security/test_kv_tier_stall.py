"""A KV tier store that hangs never stalls the engine, and a shared store needs its key
(issue 48, findings 4 and 6): lookups make no file-system call on the engine thread, a
read that hangs is given up after tier_io_timeout_s (the prefix is recomputed, the
output unchanged), check_health reports the stuck store, and a shared store without a
key is refused at start."""
from __future__ import annotations

import os
import pathlib
import threading
from pathlib import Path
from typing import Any

import pytest

from kv.block_hash import hash_full_blocks
from tests.support.waiting import wait_until
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine
from worker.engine.core import Engine
from worker.kvcache import tiers as tiers_module

BLOCK = 4
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(18)]  # 4 full blocks and 2 tokens
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _engine(model: Path, store: Path | None = None, timeout_s: float = 30.0) -> Engine:
    tiers = {} if store is None else {"host_kv_cache_bytes": 1 << 16, "shared_kv_store_dir": str(store),
                                       "tier_io_timeout_s": timeout_s}
    return build_engine(EngineConfig(
        ModelConfig(str(model), dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK, num_blocks_override=32, **tiers),
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32),
    ))


@pytest.fixture
def store_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_KV_STORE_KEY", "test-store-key")


def test_a_shared_store_without_a_key_is_refused(tiny_llama: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Finding: the shared store was a trust boundary with no authentication.
    monkeypatch.delenv("KVSERVE_KV_STORE_KEY", raising=False)
    with pytest.raises(ValueError, match="KVSERVE_KV_STORE_KEY"):
        _engine(tiny_llama, tmp_path / "shared")


def test_tier_lookups_make_no_file_system_call(tiny_llama: Path, tmp_path: Path, store_key: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Finding: `is_file()` on the engine thread (DiskTier.__contains__ on a miss): a hung
    # shared file system stalled the step loop.
    engine = _engine(tiny_llama, tmp_path / "shared")
    calls: list[str] = []
    for name in ("is_file", "exists", "stat"):
        original = getattr(pathlib.Path, name)
        monkeypatch.setattr(pathlib.Path, name,
                            lambda self, *a, _n=name, _o=original, **k: calls.append(_n) or _o(self, *a, **k))
    monkeypatch.setattr(os, "stat", lambda *a, _o=os.stat, **k: calls.append("os.stat") or _o(*a, **k))
    hashes = hash_full_blocks(PROMPT, BLOCK)
    assert engine.tiers.num_available(hashes) == 0 and hashes[0] not in engine.tiers.shared
    assert calls == []
    engine.tiers.close()


def test_a_peers_entries_reach_the_view_through_the_io_thread(
        tiny_llama: Path, tmp_path: Path, store_key: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # With no file-system call on a lookup, a replica learns what its peers stored from the
    # rescans its steps queue on the I/O thread.
    monkeypatch.setattr(tiers_module, "SHARED_REFRESH_S", 0.0)
    store = tmp_path / "shared"
    second = _engine(tiny_llama, store)  # started before the first one writes anything
    first = _engine(tiny_llama, store)
    _run_in_thread(first, {}).join(120)
    first.tiers.flush()
    assert hash_full_blocks(PROMPT, BLOCK)[0] not in second.tiers.shared  # not seen yet
    second.add_request("other", [5, 6, 7], GREEDY)  # any step queues a rescan
    while second.has_unfinished():
        second.step()
    second.tiers.flush()
    out: dict[str, Any] = {}
    _run_in_thread(second, out).join(120)
    assert second.tiers.num_disk_loaded_blocks == len(PROMPT) // BLOCK  # loaded, not recomputed
    first.tiers.close()
    second.tiers.close()


def _run_in_thread(engine: Engine, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        engine.add_request("r", list(PROMPT), GREEDY)
        tokens: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens.extend(o.new_token_ids)
        out["tokens"] = tokens

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_hung_store_read_times_out_and_check_health_reports_it(
        tiny_llama: Path, tmp_path: Path, store_key: None) -> None:
    # Finding: a hung store stalled the step loop while check_health stayed green.
    expected: dict[str, Any] = {}
    reference = _engine(tiny_llama)
    _run_in_thread(reference, expected).join(120)
    engine = _engine(tiny_llama, tmp_path / "shared", timeout_s=0.5)
    shared = engine.tiers.shared
    # A real hang: the store's entry for the prompt's first block is a FIFO no one writes,
    # so opening it blocks the reader until someone does.
    fifo = shared.directory / f"{hash_full_blocks(PROMPT, BLOCK)[0]:016x}.kv"
    os.mkfifo(fifo)
    shared.refresh()
    assert engine.tiers.num_available(hash_full_blocks(PROMPT, BLOCK)) == 1
    out: dict[str, Any] = {}
    thread = _run_in_thread(engine, out)
    try:
        thread.join(60)
        assert not thread.is_alive(), "the engine waited on the hung store"
        assert out["tokens"] == expected["tokens"]  # recomputed, the same greedy output
        assert engine.tiers.num_timed_out_loads == 1
        wait_until(lambda: engine.tiers.stalled_s() > 0.5, 10, message="the store's stall past io_timeout_s")
        with pytest.raises(RuntimeError, match="stalled"):
            engine.tiers.check_health()
        assert engine.tiers.num_available(hash_full_blocks(PROMPT, BLOCK)) == 0  # skipped while hung
    finally:  # the store answers again: the reader gets an empty file, a bad entry
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    wait_until(lambda: engine.tiers.stalled_s() == 0, 10, message="the I/O thread back from the store")
    engine.tiers.check_health()  # healthy again
    engine.tiers.flush()
    assert not fifo.exists() and shared.num_dropped == 1
    engine.tiers.close()
