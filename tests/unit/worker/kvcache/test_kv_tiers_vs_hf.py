"""KV tiers on the real CPU engine: greedy outputs equal transformers' token for token
whether a prefix comes back from the device, the host tier, the disk tier or is
recomputed, with chunked prefill and preemption in the mix; a bad disk entry is dropped
and recomputed, and a disk that stops taking writes leaves the host tier serving."""
from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kv.block_hash import hash_full_blocks
from worker.api import SamplingParams
from worker.serving.routing_report import build_routing_stats
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.engine.build import build_engine

if TYPE_CHECKING:
    from tests.conftest import HFReference

BLOCK = 16
VOCAB = 512
MAX_TOKENS = 6


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


_rng = random.Random(11)
PREFIX = _tokens(_rng, 5 * BLOCK)  # the conversation so far: 5 full blocks
FIRST = PREFIX + _tokens(_rng, 7)
# Working set that pushes the prefix off a 16-block device pool.
FILLERS = [_tokens(_rng, 3 * BLOCK + 5) for _ in range(4)]
# Later turns, side by side with two long decodes: chunked prefill (32-token budget) and,
# in the small pool, preemption.
LATER = [PREFIX + _tokens(_rng, 9), PREFIX + _tokens(_rng, 21), _tokens(_rng, 40), _tokens(_rng, 33)]
LATER_MAX_TOKENS = [60, 60, 100, 100]  # together they outgrow the pool: preemption


def _engine(model_dir: Path, num_blocks: int, host_bytes: int = 0, disk_dir: Path | None = None,
            shared_dir: Path | None = None) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks, host_kv_cache_bytes=host_bytes,
                    disk_kv_cache_dir=None if disk_dir is None else str(disk_dir),
                    shared_kv_store_dir=None if shared_dir is None else str(shared_dir)),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
    ))


def _turns(engine: Engine, run_engine, corrupt_disk: bool = False,
           finals: dict | None = None) -> dict[str, list[int]]:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    run_engine(engine, [FIRST], greedy, ["first"])
    run_engine(engine, FILLERS, greedy, [f"filler{i}" for i in range(len(FILLERS))])
    if engine.tiers is not None and engine.tiers.disk is not None:
        engine.tiers.flush()  # the pushed-out blocks are on disk before the next turn looks
        if corrupt_disk:
            for path in engine.tiers.disk.directory.glob("*.kv"):
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF
                path.write_bytes(bytes(data))
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in LATER_MAX_TOKENS]
    return run_engine(engine, LATER, params, [f"later{i}" for i in range(len(LATER))], finals)


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, hf_reference: HFReference) -> dict[str, list[int]]:
    outs = hf_reference("llama", LATER, LATER_MAX_TOKENS)
    return {f"later{i}": out for i, out in enumerate(outs)}


def _block_bytes(engine: Engine) -> int:
    return engine.runner.kv_spec.bytes_per_block


@pytest.mark.parametrize("path", ["device", "host", "disk", "recompute"])
def test_later_turns_match_hf_from_every_tier(path: str, tiny_llama: Path, expected: dict[str, list[int]],
                                              run_engine, tmp_path: Path) -> None:
    small = 16
    if path == "device":
        engine = _engine(tiny_llama, num_blocks=64)
    elif path == "host":
        engine = _engine(tiny_llama, small, host_bytes=64 * 8192)
    elif path == "disk":  # a two-block host tier: the prefix is pushed on to disk
        engine = _engine(tiny_llama, small, host_bytes=2 * 8192, disk_dir=tmp_path / "kv")
    else:
        engine = _engine(tiny_llama, small)
    assert path == "device" or _block_bytes(engine) == 8192
    finals: dict = {}
    assert _turns(engine, run_engine, finals=finals) == expected
    # The first later turn found the whole prefix: on the device, or loaded from a tier.
    assert finals["later0"].num_cached_tokens == (0 if path == "recompute" else len(PREFIX))
    tiers = engine.tiers
    assert engine.scheduler.num_preemptions > 0 or path == "device"
    if path == "host":
        assert tiers.num_loaded_blocks >= 5 and tiers.num_disk_loaded_blocks == 0
        # What the replica reports for the router to credit (worker/serving/routing_report.py).
        stats = build_routing_stats(engine, engine.stats(), [], 0.0, tier_hashes=tiers.routing_hashes(1000))
        assert set(hash_full_blocks(PREFIX, BLOCK)) <= set(stats.host_prefix_hashes)
        kv_stats = engine.stats().kv
        assert kv_stats.num_host_blocks == len(tiers.host) > 0 and kv_stats.num_disk_blocks == 0
        assert kv_stats.to_dict()["num_tier_loaded_blocks"] == tiers.num_loaded_blocks
    elif path == "disk":
        assert tiers.num_disk_loaded_blocks >= 5
    else:
        assert tiers is None
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    if tiers is not None:
        tiers.close()


def test_corrupt_disk_entries_are_recomputed(tiny_llama: Path, expected: dict[str, list[int]],
                                             run_engine, tmp_path: Path) -> None:
    engine = _engine(tiny_llama, 16, host_bytes=2 * 8192, disk_dir=tmp_path / "kv")
    assert _turns(engine, run_engine, corrupt_disk=True) == expected
    assert engine.tiers.disk.num_dropped >= 1  # later disk loads are of entries written after the damage
    engine.tiers.close()


def test_disk_gone_degrades_to_host_tier(tiny_llama: Path, expected: dict[str, list[int]], run_engine,
                                         tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(tiny_llama, 16, host_bytes=8 * 8192, disk_dir=tmp_path / "kv")
    shutil.rmtree(tmp_path / "kv")  # the volume went away after start
    with caplog.at_level(logging.WARNING, logger="kv.disk_tier"):
        assert _turns(engine, run_engine) == expected
        engine.tiers.flush()
    assert not engine.tiers.disk.writable
    assert len([r for r in caplog.records if "not writable" in r.message]) == 1
    assert engine.tiers.num_loaded_blocks >= 1
    engine.tiers.close()


def test_a_replica_loads_what_another_computed_from_the_shared_store(
        tiny_llama: Path, expected: dict[str, list[int]], run_engine, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_KV_STORE_KEY", "test-store-key")  # a shared store needs its key
    store = tmp_path / "shared"
    first = _engine(tiny_llama, 16, host_bytes=8 * 8192, shared_dir=store)
    run_engine(first, [FIRST], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), ["first"])
    first.tiers.flush()
    assert first.tiers.num_published_blocks >= 5
    (subdir,) = store.iterdir()  # one directory per model and KV layout
    assert len(list(subdir.glob("*.kv"))) >= 5
    second = _engine(tiny_llama, 16, host_bytes=8 * 8192, shared_dir=store)  # a peer, cold
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in LATER_MAX_TOKENS]
    finals: dict = {}
    got = run_engine(second, LATER, params, [f"later{i}" for i in range(len(LATER))], finals)
    assert got == expected
    assert finals["later0"].num_cached_tokens == len(PREFIX)
    assert second.tiers.num_disk_loaded_blocks >= 5 and second.tiers.shared.num_dropped == 0
    first.tiers.close()
    second.tiers.close()


def test_tier_settings_are_checked_and_never_silently_ignored(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="under the host tier"):
        CacheConfig(disk_kv_cache_dir="/tmp/x")
    with pytest.raises(ValueError, match="under the host tier"):
        CacheConfig(shared_kv_store_dir="/tmp/x")
    with pytest.raises(ValueError, match="not modelled by the simulated device"):
        build_engine(EngineConfig(ModelConfig(str(tiny_llama), device="sim:h200"),
                                        CacheConfig(host_kv_cache_bytes=1 << 20)))


def test_abort_while_loading_from_disk_frees_blocks_and_keeps_serving(
        tiny_llama: Path, expected: dict[str, list[int]], run_engine, tmp_path: Path) -> None:
    engine = _engine(tiny_llama, 16, host_bytes=2 * 8192, disk_dir=tmp_path / "kv")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    run_engine(engine, [FIRST], greedy, ["first"])
    run_engine(engine, FILLERS, greedy, [f"filler{i}" for i in range(len(FILLERS))])
    engine.tiers.flush()
    engine.add_request("gone", LATER[0], greedy)
    assert engine.step() == []
    assert engine.scheduler.loading and engine.tiers.has_pending  # its disk blocks are being read
    engine.abort_request("gone")
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    engine.tiers.poll(wait=True)  # the read lands after the abort: nothing is copied, nothing resumes
    assert not engine.scheduler.has_unfinished()
    params = SamplingParams(max_tokens=LATER_MAX_TOKENS[1], temperature=0.0)
    assert run_engine(engine, [LATER[1]], params, ["later1"]) == {"later1": expected["later1"]}
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    engine.tiers.close()
