"""The FP8 KV cache (`engine.kv_cache_dtype: fp8`) through the engine: the pool holds e4m3
blocks; a prefix-cache hit, a block reloaded from the host tier and a disaggregated
import give exactly the tokens of a fresh computation on the same FP8 pool; an export
carries its dtype and a mismatch is refused; the routing report states the halved block
bytes, and so twice the blocks from the same budget."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.unit.worker.kvcache.test_disagg_engine import PROMPTS, MAX_TOKENS, _disaggregated, _step_until
from tests.unit.worker.kvcache.test_kv_tiers_vs_hf import LATER, LATER_MAX_TOKENS, _turns
from worker.api import KVImportError, SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine
from worker.engine.core import Engine
from worker.serving.routing_report import build_routing_stats

BLOCK = 16


def _engine(model_dir: Path, kv: str = "fp8", num_blocks: int | None = 128, prefix: bool = True,
            host_bytes: int = 0, budget: int = 256 * 1024, dtype: str = "float32", max_tokens: int = 256) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype=dtype, device="cpu"),
        CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks, enable_prefix_caching=prefix,
                    host_kv_cache_bytes=host_bytes, kv_cache_bytes=budget, kv_cache_dtype=kv),
        SchedulerConfig(max_num_seqs=4 if host_bytes else 16, max_num_batched_tokens=32 if host_bytes else max_tokens),
    ))


def _greedy(ns: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0) for n in ns]


def test_prefix_hits_give_the_tokens_of_a_fresh_fp8_run(tiny_llama: Path, run_engine: Callable) -> None:
    fresh = run_engine(_engine(tiny_llama, prefix=False, max_tokens=7), PROMPTS, _greedy(MAX_TOKENS))
    engine = _engine(tiny_llama)
    assert engine.runner.kv_caches.dtype == torch.float8_e4m3fn
    finals: dict = {}
    first = run_engine(engine, PROMPTS[:5], _greedy(MAX_TOKENS[:5]))
    last = run_engine(engine, PROMPTS[5:], _greedy(MAX_TOKENS[5:]), request_ids=["5"], final_outputs=finals)
    assert finals["5"].num_cached_tokens == 2 * BLOCK  # the shared prefix came from the FP8 pool
    assert {**first, **last} == fresh
    # The FP8 cache changes some greedy tokens of a random model, not all (tiny and undecided).
    auto = run_engine(_engine(tiny_llama, kv="auto"), PROMPTS, _greedy(MAX_TOKENS))
    agree = sum(a == b for k in auto for a, b in zip(auto[k], fresh[k])) / sum(len(v) for v in auto.values())
    assert agree > 0.5


def test_blocks_reloaded_from_the_host_tier_give_the_same_tokens(tiny_llama: Path, run_engine: Callable) -> None:
    device = _turns(_engine(tiny_llama, num_blocks=64, host_bytes=0), run_engine)
    small = _engine(tiny_llama, num_blocks=16, host_bytes=64 * 2048)
    assert small.runner.kv_spec.bytes_per_block == 2048  # fp32: 8192; the host tier stores the FP8 bytes
    finals: dict = {}
    assert _turns(small, run_engine, finals=finals) == device
    assert small.tiers.num_loaded_blocks >= 5 and finals["later0"].num_cached_tokens > 0
    assert small.tiers.host.buffer.dtype == torch.float8_e4m3fn
    small.tiers.close()
    assert len(device) == len(LATER) and [len(device[f"later{i}"]) for i in range(4)] <= LATER_MAX_TOKENS


def test_disaggregated_fp8_equals_one_fp8_engine(tiny_llama: Path, run_engine: Callable) -> None:
    prefill, decode = _engine(tiny_llama), _engine(tiny_llama)
    tokens, cached = _disaggregated(prefill, decode, [[0, 1, 2, 3, 4], [5]])
    assert cached["5"] == 2 * BLOCK
    single = run_engine(_engine(tiny_llama), PROMPTS, _greedy(MAX_TOKENS))
    assert tokens == single


def test_an_export_carries_its_dtype_and_a_mismatch_is_refused(tiny_llama: Path) -> None:
    prefill = _engine(tiny_llama)
    prefill.add_request("r", PROMPTS[3], _greedy([1])[0], export_kv=True)
    (out,) = _step_until(prefill, {"r"})["r"]
    export = out.extra["kv_export"]
    assert export.dtype == "float8_e4m3fn" and export.kv.dtype == torch.float8_e4m3fn
    with pytest.raises(KVImportError, match="dtype: export has float8_e4m3fn, this cache has float32"):
        _engine(tiny_llama, kv="auto").add_request("r", PROMPTS[3], _greedy([5])[0], kv_import=export)


def test_routing_report_states_half_the_bytes_and_twice_the_blocks(tiny_llama: Path) -> None:
    """bf16 model, the same CPU KV budget: the FP8 pool has twice the blocks."""
    reports = {}
    for kv in ("auto", "fp8"):
        engine = _engine(tiny_llama, kv=kv, num_blocks=None, dtype="bfloat16")
        reports[kv] = build_routing_stats(engine, engine.stats(), [], 0.0)
    assert reports["fp8"].kv_bytes_per_block * 2 == reports["auto"].kv_bytes_per_block > 0
    assert reports["fp8"].total_blocks == 2 * reports["auto"].total_blocks


def test_config_and_cli_select_the_fp8_cache(tmp_path: Path) -> None:
    from cluster.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert config_from_args(args).engine_config().cache.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8"):
        CacheConfig(kv_cache_dtype="int8")
    from worker.attention import select_backend

    with pytest.raises(ValueError, match="flash cannot read an FP8 KV cache"):
        select_backend("flash", torch.device("cpu"), needs_fp8_kv=True)
