"""Greedy outputs of the engine on the mixture-of-experts families (Qwen3-MoE, Mixtral,
gpt-oss; every switch of tests/support/tiny_moe.py) are token-for-token transformers'
`generate`, alone and batched, with chunked prefill, under a tight KV pool with
preemptions, past the sliding window.

Runs a subset of test_engine_vs_hf.py's prompt set (mixed lengths 1..120, a shared-prefix
group) with its helpers: each family's reference is computed once per session.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from kv.cache_manager import cdiv
from tests.support.tiny_models import SLIDING_WINDOW
from tests.unit.worker.models.test_engine_vs_hf import (
    BLOCK, MAX_TOKENS, PREFIX_GROUP, PREFIX_LEN, PROMPTS, _assert_free, _engine, _greedy,
)
from worker.api import RequestOutput

if TYPE_CHECKING:
    from tests.conftest import HFReference
    from tests.unit.worker.models.conftest import TinyMoEModels

FAMILIES = ["qwen3_moe", "qwen3_moe_norm", "qwen3_moe_fused", "mixtral", "mixtral_swa", "gpt_oss"]
# 16 of the 32 prompts: lengths at block boundaries, the longest, a 1-token prompt, and
# four of the shared-prefix group (so the batch hits the prefix cache).
BATCH = [0, 1, 2, 3, 4, 7, 8, 9, 11, 14, 17, 21, *PREFIX_GROUP[:4]]
CHUNKED = [8, 9, 0, 7]
# Peak need of BATCH together is far above this; the largest request fits three times.
PREEMPT_POOL = 36


def _expected(moe_reference: HFReference, family: str, indices: list[int]) -> dict[str, list[int]]:
    refs = moe_reference(family, [PROMPTS[i] for i in BATCH], [MAX_TOKENS[i] for i in BATCH])
    by_index = dict(zip(BATCH, refs))
    return {str(i): by_index[i] for i in indices}


def _run(
    run_engine: Callable, engine: object, indices: list[int], final_outputs: dict[str, RequestOutput] | None = None
) -> dict[str, list[int]]:
    return run_engine(
        engine, [PROMPTS[i] for i in indices], [_greedy(MAX_TOKENS[i]) for i in indices],
        request_ids=[str(i) for i in indices], final_outputs=final_outputs,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_single_requests(
    family: str, tiny_moe: TinyMoEModels, moe_reference: HFReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_moe(family))
    for i in (8, 0):  # the longest prompt, then a one-token prompt; 64 tokens each
        assert _run(run_engine, engine, [i]) == _expected(moe_reference, family, [i])
    _assert_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_with_prefix_cache(
    family: str, tiny_moe: TinyMoEModels, moe_reference: HFReference, run_engine: Callable
) -> None:
    """The batch without three of the prefix group, then those three: they reuse the
    prefix blocks their group's leader left in the cache."""
    engine = _engine(tiny_moe(family))
    later = PREFIX_GROUP[1:4]
    first = [i for i in BATCH if i not in later]
    assert _run(run_engine, engine, first) == _expected(moe_reference, family, first)
    finals: dict[str, RequestOutput] = {}
    assert _run(run_engine, engine, later, finals) == _expected(moe_reference, family, later)
    assert all(finals[str(i)].num_cached_tokens >= PREFIX_LEN for i in later)
    _assert_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_tiny_budget(
    family: str, tiny_moe: TinyMoEModels, moe_reference: HFReference, run_engine: Callable
) -> None:
    # 7 tokens a step: chunks straddle blocks (and the window), decodes share the budget.
    engine = _engine(tiny_moe(family), max_num_batched_tokens=7)
    assert _run(run_engine, engine, CHUNKED) == _expected(moe_reference, family, CHUNKED)
    assert engine.stats().num_steps >= cdiv(sum(len(PROMPTS[i]) for i in CHUNKED), 7)
    _assert_free(engine)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral_swa", "gpt_oss"])
def test_preemption_small_pool_with_chunks(
    family: str, tiny_moe: TinyMoEModels, moe_reference: HFReference, run_engine: Callable
) -> None:
    # Every layer of mixtral_swa slides: a sequence holds only its window's blocks
    # (kv/kv_groups.py), so a pool of a few windows is the tight one there.
    pool = 12 if family == "mixtral_swa" else PREEMPT_POOL
    engine = _engine(tiny_moe(family), num_blocks=pool, max_num_batched_tokens=40)
    assert 2 * max(engine.kv.max_blocks_for(len(PROMPTS[i]) + MAX_TOKENS[i], 40) for i in BATCH) <= pool
    assert _run(run_engine, engine, BATCH) == _expected(moe_reference, family, BATCH)
    assert engine.stats().num_preemptions > 0
    _assert_free(engine)


def test_prompts_cross_the_window() -> None:
    """gpt-oss and mixtral_swa slide over SLIDING_WINDOW: most prompts, and every chunked
    one with its output, are longer than it."""
    assert sum(len(PROMPTS[i]) > SLIDING_WINDOW for i in BATCH) > len(BATCH) // 2
    assert all(len(PROMPTS[i]) + MAX_TOKENS[i] > SLIDING_WINDOW for i in CHUNKED)


def test_switches_change_the_outputs(tiny_moe: TinyMoEModels, tmp_path: Path) -> None:
    """The switches the tests above vary change the reference: gpt-oss without its sinks,
    without its window, and Qwen3-MoE with the other norm_topk_prob give other tokens
    for the same weights, so matching transformers tests each of them."""
    from transformers import AutoModelForCausalLM

    prompt = torch.tensor([PROMPTS[8]])

    def greedy(model: torch.nn.Module) -> list[int]:
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                                 do_sample=False, pad_token_id=0)
        return out[0, prompt.shape[1]:].tolist()

    gpt = AutoModelForCausalLM.from_pretrained(tiny_moe("gpt_oss"), dtype=torch.float32).eval()
    base = greedy(gpt)
    for layer in gpt.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    assert greedy(gpt) != base
    no_window = AutoModelForCausalLM.from_pretrained(tiny_moe("gpt_oss"), dtype=torch.float32, sliding_window=4096)
    assert greedy(no_window.eval()) != base
    qwen = AutoModelForCausalLM.from_pretrained(tiny_moe("qwen3_moe"), dtype=torch.float32).eval()
    flipped = AutoModelForCausalLM.from_pretrained(tiny_moe("qwen3_moe"), dtype=torch.float32, norm_topk_prob=True)
    assert greedy(qwen) != greedy(flipped.eval())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_on_cuda_fused_moe_and_sinks(
    family: str, backend: str, tiny_moe: TinyMoEModels, moe_reference: HFReference, run_engine: Callable
) -> None:
    """The CUDA runner: the Triton fused-MoE kernel, sinks in each backend, CUDA graphs."""
    engine = _engine(tiny_moe(family), device="cuda", attention_backend=backend)
    assert _run(run_engine, engine, BATCH) == _expected(moe_reference, family, BATCH)
    _assert_free(engine)
    engine = _engine(tiny_moe(family), device="cuda", attention_backend=backend, max_num_batched_tokens=24)
    assert _run(run_engine, engine, CHUNKED) == _expected(moe_reference, family, CHUNKED)
    _assert_free(engine)
