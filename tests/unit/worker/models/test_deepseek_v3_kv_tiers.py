"""Latent blocks through the KV tiers below the device: a DeepSeek-V3 prefix pushed off a
small pool into the host tier (or on to disk) comes back and the later turns are
transformers' greedy tokens, with chunked prefill and preemption in the mix."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.tiny_deepseek import VOCAB, DeepseekReference
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.engine.build import build_engine

BLOCK = 16
VARIANT = "ds_qlora"

_rng = random.Random(12)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, VOCAB) for _ in range(n)]


PREFIX = _tokens(5 * BLOCK)
FIRST = PREFIX + _tokens(7)
FILLERS = [_tokens(3 * BLOCK + 5) for _ in range(4)]  # push the prefix off a 16-block pool
LATER = [PREFIX + _tokens(9), PREFIX + _tokens(21), _tokens(40), _tokens(33)]
LATER_MAX_TOKENS = [40, 40, 70, 70]  # together they outgrow the pool: preemption


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeepseekReference]:
    yield DeepseekReference(tmp_path_factory.mktemp("tiny-deepseek-tiers"))


def _engine(model_dir: Path, host_blocks: int, disk_dir: Path | None, block_bytes: int) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK, num_blocks_override=16, host_kv_cache_bytes=host_blocks * block_bytes,
                    disk_kv_cache_dir=None if disk_dir is None else str(disk_dir)),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
    ))


@pytest.mark.parametrize("path", ["host", "disk"])
def test_latent_prefix_comes_back_from_a_tier(path: str, reference: DeepseekReference, run_engine: Callable,
                                              tmp_path: Path) -> None:
    model_dir = reference.checkpoint(VARIANT)
    block_bytes = 3 * 1 * BLOCK * (32 + 16) * 4  # layers x one plane x tokens x latent row x fp32
    host_blocks, disk_dir = (64, None) if path == "host" else (2, tmp_path / "kv")
    engine = _engine(model_dir, host_blocks, disk_dir, block_bytes)
    assert engine.runner.kv_spec.bytes_per_block == block_bytes
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    run_engine(engine, [FIRST], greedy, ["first"])
    run_engine(engine, FILLERS, greedy, [f"filler{i}" for i in range(len(FILLERS))])
    if disk_dir is not None:
        engine.tiers.flush()
    finals: dict = {}
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in LATER_MAX_TOKENS]
    out = run_engine(engine, LATER, params, [f"later{i}" for i in range(len(LATER))], finals)
    expected = reference.greedy(VARIANT, LATER, LATER_MAX_TOKENS)
    assert out == {f"later{i}": ref for i, ref in enumerate(expected)}
    assert finals["later0"].num_cached_tokens == len(PREFIX)
    assert engine.scheduler.num_preemptions > 0
    loaded = engine.tiers.num_loaded_blocks if path == "host" else engine.tiers.num_disk_loaded_blocks
    assert loaded >= 5
    engine.tiers.close()
