"""Gemma 3 text is token-for-token transformers' greedy `generate` (fp32) on tiny random
checkpoints (tests/support/tiny_gemma.py): alone, in mixed batches with the prefix cache,
with chunked prefill, under a tight KV pool with preemptions, past the sliding window
(24, shorter than most prompts), while its local layers give their blocks back.

Runs the prompt set and helpers of tests/unit/worker/models/test_engine_vs_hf.py.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from kv.cache_manager import cdiv
from tests.support.tiny_gemma import GEMMA_WINDOW
from tests.unit.worker.models.test_engine_vs_hf import (
    ALL, BLOCK, CHUNKED, MAX_TOKENS, PREFIX_GROUP, PREFIX_LEN, PROMPTS, _assert_free, _engine, _greedy,
)
from worker.model.gemma3 import Gemma3Arch
from worker.model_config import load_hf_config

if TYPE_CHECKING:
    from tests.unit.worker.models.conftest import GemmaReference, TinyGemma

VARIANTS = ["gemma3", "gemma3_capped"]


def _expected(ref: GemmaReference, variant: str, indices: list[int]) -> dict[str, list[int]]:
    refs = ref(variant, PROMPTS, MAX_TOKENS)
    return {str(i): refs[i] for i in indices}


def _run(run_engine: Callable, engine: object, indices: list[int]) -> dict[str, list[int]]:
    return run_engine(engine, [PROMPTS[i] for i in indices], [_greedy(MAX_TOKENS[i]) for i in indices],
                      request_ids=[str(i) for i in indices])


def test_arch_reads_layer_kinds_and_their_rope(tiny_gemma: TinyGemma) -> None:
    arch = Gemma3Arch.from_hf_config(load_hf_config(tiny_gemma("gemma3")))
    w = GEMMA_WINDOW
    assert arch.sliding_windows == (w, w, None, w, w, None)
    assert arch.query_pre_attn_scalar == 16 and arch.tie_word_embeddings
    capped = Gemma3Arch.from_hf_config(load_hf_config(tiny_gemma("gemma3_capped")))
    assert capped.sliding_windows == (w,) * 5 + (None,)
    assert capped.final_logit_softcapping == 4.0 and not capped.tie_word_embeddings


@pytest.mark.parametrize("variant", VARIANTS)
def test_single_requests_cross_the_window(
    variant: str, tiny_gemma: TinyGemma, gemma_reference: GemmaReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_gemma(variant))
    for i in (8, 0):  # a 120-token prompt (5 windows), a 1-token prompt decoding 64 past it
        (expected,) = gemma_reference(variant, [PROMPTS[i]], [MAX_TOKENS[i]])
        assert run_engine(engine, [PROMPTS[i]], _greedy(MAX_TOKENS[i])) == {"0": expected}
    _assert_free(engine)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixed_batch_with_prefix_cache(
    variant: str, tiny_gemma: TinyGemma, gemma_reference: GemmaReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_gemma(variant))
    assert _run(run_engine, engine, ALL) == _expected(gemma_reference, variant, ALL)
    _assert_free(engine)


@pytest.mark.parametrize("variant", VARIANTS)
def test_shared_prefix_hits_in_every_group(
    variant: str, tiny_gemma: TinyGemma, gemma_reference: GemmaReference, run_engine: Callable
) -> None:
    """One request of the shared-prefix group first; the others then start from its cached
    48-token prefix: global blocks from the start, local ones inside the window."""
    engine = _engine(tiny_gemma(variant))
    first, rest = PREFIX_GROUP[0], PREFIX_GROUP[1:]
    assert _run(run_engine, engine, [first]) == _expected(gemma_reference, variant, [first])
    assert _run(run_engine, engine, rest) == _expected(gemma_reference, variant, rest)
    assert engine.stats().kv.prefix_cache_hits >= len(rest) * PREFIX_LEN // BLOCK * BLOCK
    _assert_free(engine)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_across_the_window(
    variant: str, tiny_gemma: TinyGemma, gemma_reference: GemmaReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_gemma(variant), max_num_batched_tokens=7)
    assert _run(run_engine, engine, CHUNKED) == _expected(gemma_reference, variant, CHUNKED)
    assert engine.stats().num_steps >= cdiv(sum(len(PROMPTS[i]) for i in CHUNKED), 7)
    _assert_free(engine)


@pytest.mark.parametrize("variant,num_blocks,prefix_caching", [
    ("gemma3", 80, True), ("gemma3", 80, False), ("gemma3_capped", 150, True),
])
def test_tight_pool_preempts_and_stays_exact(
    variant: str, num_blocks: int, prefix_caching: bool, tiny_gemma: TinyGemma,
    gemma_reference: GemmaReference, run_engine: Callable,
) -> None:
    engine = _engine(tiny_gemma(variant), num_blocks=num_blocks, enable_prefix_caching=prefix_caching)
    # the biggest request fits twice over: several run at once, the youngest is preempted
    biggest = max(engine.kv.max_blocks_for(len(p) + n, 2048) for p, n in zip(PROMPTS, MAX_TOKENS))
    assert 2 * biggest <= num_blocks
    assert _run(run_engine, engine, ALL) == _expected(gemma_reference, variant, ALL)
    assert engine.stats().num_preemptions > 0
    _assert_free(engine)


def test_chunks_preemption_and_prefix_cache_together(
    tiny_gemma: TinyGemma, gemma_reference: GemmaReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_gemma("gemma3"), num_blocks=50, max_num_batched_tokens=24)
    assert _run(run_engine, engine, ALL) == _expected(gemma_reference, "gemma3", ALL)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv.prefix_cache_hits > 0
    _assert_free(engine)


def test_local_layers_hold_only_the_window(
    tiny_gemma: TinyGemma, gemma_reference: GemmaReference
) -> None:
    """A long request: its global group holds every block, each local group about
    window / block_size + 1 blocks at any step."""
    engine = _engine(tiny_gemma("gemma3"), max_num_batched_tokens=16)
    prompt, n = PROMPTS[8], MAX_TOKENS[8]
    engine.add_request("long", prompt, _greedy(n))
    groups = engine.kv.groups
    sliding = [gi for gi, g in enumerate(groups) if g.sliding_window is not None]
    assert len(sliding) == 2 and groups[0].sliding_window is None
    bound = cdiv(GEMMA_WINDOW - 1, BLOCK) + 2
    most, tokens = 0, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        seq = engine.seqs.get("long")
        if seq is None or not engine.kv.tables("long")[0]:
            continue
        held = engine.kv.num_held_blocks("long")
        assert held[0] == cdiv(seq.num_computed_tokens + 1, BLOCK) or held[0] >= cdiv(seq.num_computed_tokens, BLOCK)
        most = max(most, *(held[g] for g in sliding))
        assert all(held[g] <= bound for g in sliding), held
    assert most >= cdiv(GEMMA_WINDOW, BLOCK)  # it did hold its window
    assert tokens == gemma_reference("gemma3", [prompt], [n])[0]
    _assert_free(engine)


def test_without_the_window_outputs_differ(gemma_reference: GemmaReference) -> None:
    """The same weights with every layer global give other tokens: the window matters."""
    i = 8
    assert gemma_reference("gemma3", [PROMPTS[i]], [MAX_TOKENS[i]]) != gemma_reference(
        "gemma3_full", [PROMPTS[i]], [MAX_TOKENS[i]])
