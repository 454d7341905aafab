"""A real pretrained model from a .gguf file: kvserve's engine against transformers' own
GGUF loading (`from_pretrained(dir, gguf_file=...)`), greedy, token for token, fp32 on CPU.

The model is SmolLM2-135M-Instruct (Q4_1; see tests/support/real_models.py). Both sides dequantize
the same file; kvserve reads it with the `gguf` package itself (worker/model/gguf_checkpoint.py),
including undoing llama.cpp's Q/K row permutation, and takes its config, tokenizer and
chat template from the file. Kept small for 2 CPU cores: three chat prompts, 16 tokens each.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.api import SamplingParams
from worker.engine.build import build_engine

pytestmark = pytest.mark.gguf

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
]
MAX_TOKENS = 16
NUM_BLOCKS, BLOCK = 64, 16


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    out = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


@pytest.fixture(scope="module")
def hf_outputs(gguf_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model.eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                pad_token_id=model.config.pad_token_id,
            )
        outs.append(gen[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module")
def engine(gguf_path: Path) -> Engine:
    # 32-token steps: each ~40-token chat prompt is prefilled in two chunks.
    return build_engine(EngineConfig(
        ModelConfig(str(gguf_path), dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK, num_blocks_override=NUM_BLOCKS),
        SchedulerConfig(max_num_batched_tokens=32),
    ))


def test_config_and_chat_template_come_from_the_file(engine: Engine, tokenizer: Any, prompts: list[list[int]]) -> None:
    arch = engine.runner.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.vocab_size) == (30, 576, 9, 3, 49152)
    # max_model_len defaults to the model's context length (8192), capped by the KV pool.
    assert engine.max_model_len == NUM_BLOCKS * BLOCK < 8192
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids
    for prompt, question in zip(prompts, QUESTIONS):  # the file's ChatML template
        text = tokenizer.decode(prompt)
        assert text.startswith("<|im_start|>system\n") and text.endswith(f"{question}<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_matches_transformers_gguf_loading(
    engine: Engine, prompts: list[list[int]], hf_outputs: list[list[int]], tokenizer: Any, run_engine: Callable
) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    got = run_engine(engine, prompts, params)  # together: batched decodes, chunked prefills
    assert [got[str(i)] for i in range(len(prompts))] == hf_outputs
    # A real model: the answer is about the question (not what a random model would say).
    assert "Paris" in tokenizer.decode(hf_outputs[0])
