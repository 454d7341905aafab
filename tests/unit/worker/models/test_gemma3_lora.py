"""LoRA on Gemma 3: a step mixing the base model and several adapters (attention and MLP
targets, ranks, rsLoRA: tests/support/tiny_lora.py) is token-for-token transformers + peft,
each request against its own adapter, local and global layers alike."""
from __future__ import annotations

import random
from typing import TYPE_CHECKING

from worker.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine

if TYPE_CHECKING:
    import pytest

    from tests.unit.worker.models.conftest import TinyGemma


def test_gemma3_adapters_match_peft(tiny_gemma: TinyGemma, tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.support.tiny_lora import make_mixed_adapters, peft_greedy, run_mixed

    base = tiny_gemma("gemma3")
    paths = make_mixed_adapters(base, tmp_path_factory.mktemp("lora-gemma3"))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    max_tokens = [12] * len(prompts)
    expected = {None: peft_greedy(base, None, prompts, max_tokens)}
    for name, path in paths.items():
        expected[name] = peft_greedy(base, path, prompts, max_tokens)
        assert expected[name] != expected[None], f"adapter {name} does not change outputs: a vacuous test"
    engine = build_engine(EngineConfig(
        ModelConfig(str(base), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks_override=256),
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
        LoRAConfig(max_loras=3, max_lora_rank=16, modules=tuple((n, str(p)) for n, p in paths.items())),
    ))
    names = [None, *paths]
    jobs = [(f"{name}/{i}", name, p, n) for name in names for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    got = run_mixed(engine, jobs)
    for name in names:
        assert [got[f"{name}/{i}"] for i in range(len(prompts))] == expected[name], name
    stats = engine.stats()
    assert stats.kv.free_blocks == stats.kv.total_blocks
