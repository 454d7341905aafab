"""Gemma 3 under tensor parallelism 2 on CPU (gloo): each rank holds its share of the heads
in every KV group (global and local layers), the plan carries one table per group, and a
mixed batch with chunks, prefix hits and preemptions gives transformers' greedy tokens.

Rank 0 lives in its own Ray actor (a process joins one torch.distributed group in its life).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import ray

from tests.conftest import run_engine
from tests.support.tiny_gemma import make_tiny_gemma3
from tests.support.tiny_models import hf_greedy
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine


def _workload() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    prefix = tokens(48)
    prompts = [tokens(n) for n in (1, 17, 100, 33, 70)] + [prefix + tokens(n) for n in (5, 20, 9)]
    return prompts, [24, 12, 40, 30, 8, 16, 10, 25]


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend="torch",
                    num_threads=1, tensor_parallel_size=2),
        CacheConfig(block_size=16, num_blocks_override=40),  # tight: preemptions
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),  # chunks
    )


@ray.remote(num_cpus=1)
class GemmaTPHost:
    def __init__(self, config: EngineConfig) -> None:
        import torch

        torch.set_num_threads(1)
        self.engine = build_engine(config)

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[dict[str, list[int]], dict[str, float]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        first = run_engine(self.engine, prompts[:6], params[:6], request_ids=[str(i) for i in range(6)])
        second = run_engine(self.engine, prompts[6:], params[6:], request_ids=["6", "7"])
        stats = self.engine.stats().to_dict()
        assert self.engine.kv.num_free_blocks == self.engine.kv.num_total_blocks
        return {**first, **second}, stats

    def prefill_exports(self, prompts: list[list[int]]) -> list[object]:
        from tests.integration.test_tensor_parallel import _prefill_exports

        return _prefill_exports(self.engine, prompts)

    def decode_imports(self, prompts: list[list[int]], max_tokens: list[int], exports: list[object]) -> dict:
        from tests.integration.test_tensor_parallel import _decode_imports

        return _decode_imports(self.engine, prompts, max_tokens, exports)

    def shutdown(self) -> None:
        self.engine.runner.shutdown()


def test_gemma3_tp2_matches_transformers(serve_cluster: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = make_tiny_gemma3("gemma3", tmp_path_factory.mktemp("gemma-tp") / "gemma3")
    prompts, max_tokens = _workload()
    expected = dict(zip(map(str, range(len(prompts))), hf_greedy(model_dir, prompts, max_tokens)))
    host = GemmaTPHost.remote(_config(model_dir))
    try:
        outputs, stats = ray.get(host.run.remote(prompts, max_tokens), timeout=600)
        assert outputs == expected
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        ray.get(host.shutdown.remote(), timeout=120)
    finally:
        ray.kill(host)


def test_gemma3_kv_moves_between_tp2_and_single_device(
    serve_cluster: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Disaggregation across TP sizes on Gemma 3's groups: a TP=2 engine's exports (every
    group's blocks, both ranks' heads, model layer order) decode on a single device, and a
    single device's exports decode on TP=2; tokens are transformers'."""
    from dataclasses import replace

    from tests.integration.test_tensor_parallel import _decode_imports, _prefill_exports

    model_dir = make_tiny_gemma3("gemma3", tmp_path_factory.mktemp("gemma-tp-kv") / "gemma3")
    prompts, max_tokens = _workload()
    expected = dict(zip(map(str, range(len(prompts))), hf_greedy(model_dir, prompts, max_tokens)))
    config = replace(_config(model_dir), cache=CacheConfig(block_size=16, num_blocks_override=256))
    single_config = replace(config, model=replace(config.model, tensor_parallel_size=1))
    host = GemmaTPHost.remote(config)
    try:
        exports = ray.get(host.prefill_exports.remote(prompts), timeout=600)
        single = build_engine(single_config)
        assert single.kv.layout.num_groups == 3
        assert _decode_imports(single, prompts, max_tokens, exports) == expected  # TP=2 -> TP=1
        local_exports = _prefill_exports(single, prompts)
        assert ray.get(host.decode_imports.remote(prompts, max_tokens, local_exports), timeout=600) == expected
        ray.get(host.shutdown.remote(), timeout=120)
    finally:
        ray.kill(host)
