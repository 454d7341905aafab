"""LoRA on multi-head latent attention (DeepSeek-V3): a step mixing the base model and an
adapter on every MLA attention target is token-for-token transformers + peft, with the
query through q_a_proj/q_b_proj and straight through q_proj; kv_b_proj (absorbed into the
query and output in decode) is refused at load with the targets this model takes."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from worker.api import LoRAAdapterError
from worker.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine
from worker.engine.core import Engine

TARGETS = {
    "ds_qlora": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"),
    "ds_qproj": ("q_proj", "kv_a_proj_with_mqa", "o_proj"),
}


def _engine(model_dir: Path, modules: dict[str, Path], num_blocks: int = 128) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks_override=num_blocks),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        LoRAConfig(max_loras=2, max_lora_rank=16, modules=tuple((n, str(p)) for n, p in modules.items())),
    ))


@pytest.mark.parametrize("variant", sorted(TARGETS))
def test_mla_adapter_matches_peft_in_a_mixed_batch(variant: str, tmp_path: Path) -> None:
    from tests.support.tiny_deepseek import make_tiny_deepseek
    from tests.support.tiny_lora import make_tiny_adapter, peft_greedy, run_mixed

    base = make_tiny_deepseek(variant, tmp_path / "base")
    adapter = make_tiny_adapter(base, tmp_path / "r8", 8, TARGETS[variant], seed=3)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    max_tokens = [10] * len(prompts)
    expected = {None: peft_greedy(base, None, prompts, max_tokens), "r8": peft_greedy(base, adapter, prompts, max_tokens)}
    assert expected["r8"] != expected[None], "the adapter does not change outputs: a vacuous test"
    jobs = [(f"{name}/{i}", name, p, n) for name in (None, "r8") for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    got = run_mixed(_engine(base, {"r8": adapter}), jobs)
    for name in (None, "r8"):
        assert [got[f"{name}/{i}"] for i in range(len(prompts))] == expected[name], name


def test_adapter_does_not_reuse_the_base_models_latent_blocks(tmp_path: Path) -> None:
    """The adapter writes other latent rows (its kv_a_proj_with_mqa delta), so a prompt
    cached under the base model must not be a prefix hit under the adapter, and back."""
    from tests.support.tiny_deepseek import make_tiny_deepseek
    from tests.support.tiny_lora import make_tiny_adapter, peft_greedy, run_mixed

    base = make_tiny_deepseek("ds_qproj", tmp_path / "base")
    adapter = make_tiny_adapter(base, tmp_path / "kv", 8, ("kv_a_proj_with_mqa",), seed=4)
    prompt = [random.Random(9).randrange(3, 512) for _ in range(48)]
    engine = _engine(base, {"kv": adapter})
    first = run_mixed(engine, [("base", None, prompt, 6)])
    second = run_mixed(engine, [("kv", "kv", prompt, 6)])
    assert first["base"] == peft_greedy(base, None, [prompt], [6])[0]
    assert second["kv"] == peft_greedy(base, adapter, [prompt], [6])[0]
    assert second["kv"] != first["base"]


def test_kv_b_proj_adapter_is_refused(tmp_path: Path) -> None:
    from tests.support.tiny_deepseek import make_tiny_deepseek
    from tests.support.tiny_lora import make_tiny_adapter
    from worker.lora.model_lora import adapter_loader
    from worker.model.registry import arch_for
    from worker.model_config import load_hf_config

    base = make_tiny_deepseek("ds_qlora", tmp_path / "base")
    adapter = make_tiny_adapter(base, tmp_path / "kvb", 4, ("kv_b_proj", "o_proj"))
    load = adapter_loader(arch_for(load_hf_config(base)), 16)
    with pytest.raises(LoRAAdapterError, match=r"target module 'kv_b_proj' is not supported for this model "
                                               r"\(kv_a_proj_with_mqa, o_proj, q_a_proj, q_b_proj\)"):
        load("kvb", str(adapter))
