"""LoRA on the MoE families' attention projections: a step mixing the base model and an
adapter is token-for-token transformers + peft (Qwen3-MoE with qkv/o biases, gpt-oss with
sinks and biases); an adapter on MLP projections is refused at load with a clear error
(experts are not Linear modules PEFT can target, and a sparse model takes attention
adapters only)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from worker.api import LoRAAdapterError
from worker.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.engine.build import build_engine

if TYPE_CHECKING:
    from tests.unit.worker.models.conftest import TinyMoEModels

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _engine(model_dir: Path, modules: dict[str, Path]) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks_override=128),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        LoRAConfig(max_loras=2, max_lora_rank=16, modules=tuple((n, str(p)) for n, p in modules.items())),
    ))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_attention_adapter_matches_peft_in_a_mixed_batch(
    family: str, tiny_moe: TinyMoEModels, tmp_path: Path
) -> None:
    from tests.support.tiny_lora import make_tiny_adapter, peft_greedy, run_mixed

    base = tiny_moe(family)
    adapter = make_tiny_adapter(base, tmp_path / "r8", 8, ATTENTION, seed=3)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    max_tokens = [10] * len(prompts)
    expected = {None: peft_greedy(base, None, prompts, max_tokens), "r8": peft_greedy(base, adapter, prompts, max_tokens)}
    assert expected["r8"] != expected[None], "the adapter does not change outputs: a vacuous test"
    jobs = [(f"{name}/{i}", name, p, n) for name in (None, "r8") for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    got = run_mixed(_engine(base, {"r8": adapter}), jobs)
    for name in (None, "r8"):
        assert [got[f"{name}/{i}"] for i in range(len(prompts))] == expected[name], name


def test_mlp_adapter_is_refused(tiny_moe: TinyMoEModels, tmp_path: Path) -> None:
    """PEFT targets `down_proj` in Qwen3-MoE's dense layer (mlp_only_layers) and in the
    experts (as parameters); the engine takes attention targets only on a sparse model
    and says so."""
    from tests.support.tiny_lora import make_tiny_adapter
    from worker.lora.model_lora import adapter_loader
    from worker.model.registry import arch_for
    from worker.model_config import load_hf_config

    base = tiny_moe("qwen3_moe")
    adapter = make_tiny_adapter(base, tmp_path / "mlp", 4, ("down_proj", "q_proj"))
    load = adapter_loader(arch_for(load_hf_config(base)), 16)
    with pytest.raises(LoRAAdapterError, match="target module '(down_proj|experts)' is not supported for this model"):
        load("mlp", str(adapter))
