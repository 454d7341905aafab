"""Greedy outputs with n-gram speculative decoding are token for token transformers' (and
so the engine's without it), however the engine batches, chunks, caches or preempts, and
the lookahead leaves no block behind.

The prompts repeat spans of themselves and the tiny random models fall into loops, so
drafts are proposed and accepted often (each test checks they were), and rejected often.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from worker.api import RequestOutput, SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from worker.engine.build import build_engine
from worker.engine.core import Engine

if TYPE_CHECKING:
    from tests.conftest import HFReference, TinyModels

VOCAB = 512
BLOCK = 16


def _prompt_set() -> tuple[list[list[int]], list[int]]:
    """20 prompts of 1..130 tokens, most ending in a copy of an earlier span of their own;
    the last 6 share a 32-token prefix. 1..48 output tokens each."""
    rng = random.Random(4321)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prompts = [[5], tokens(2), tokens(15)]
    for n in [16, 17, 31, 33, 40, 60, 64, 70, 90]:
        base = tokens(n)
        start = rng.randrange(0, n // 2 + 1)
        prompts.append(base + base[start:start + rng.randint(1, n // 2 + 1)])
    prompts += [tokens(rng.randint(1, 40)) for _ in range(2)]
    prefix = tokens(32)
    prompts += [prefix + tokens(rng.randint(1, 40)) + prefix[:rng.randint(1, 20)] for _ in range(6)]
    max_tokens = [rng.randint(1, 48) for _ in prompts]
    max_tokens[0] = max_tokens[5] = 48
    return prompts, max_tokens


PROMPTS, MAX_TOKENS = _prompt_set()
ALL = list(range(len(PROMPTS)))


def _engine(model_dir: Path, num_tokens: int = 4, num_blocks: int = 512, max_num_batched_tokens: int = 2048,
            enable_prefix_caching: bool = True, spec: bool = True) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks, enable_prefix_caching=enable_prefix_caching),
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=max_num_batched_tokens),
        speculative=SpeculativeConfig(method="ngram", num_tokens=num_tokens) if spec else SpeculativeConfig(),
    ))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def _check(engine: Engine, run_engine: Callable, hf_reference: HFReference, family: str, indices: list[int],
           prefix: str = "") -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    out = run_engine(engine, [PROMPTS[i] for i in indices], [_greedy(MAX_TOKENS[i]) for i in indices],
                     request_ids=[f"{prefix}{i}" for i in indices], final_outputs=finals)
    refs = hf_reference(family, [PROMPTS[i] for i in indices], [MAX_TOKENS[i] for i in indices])
    assert out == {f"{prefix}{i}": ref for i, ref in zip(indices, refs)}
    for i in indices:  # usage counts every token once, drafts or not
        assert finals[f"{prefix}{i}"].num_output_tokens == len(out[f"{prefix}{i}"])
    return finals


def _assert_spec_ran(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.num_verify_rows > 0 and stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0
    assert stats.num_generated_tokens > stats.num_steps  # several tokens in some steps


def _assert_free(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.kv.free_blocks == stats.kv.total_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral_swa"])
def test_batched_greedy_matches_hf(family: str, tiny_model: TinyModels, hf_reference: HFReference,
                                   run_engine: Callable) -> None:
    """Every prompt at once: prompts prefill while others decode with and without drafts."""
    engine = _engine(tiny_model(family))
    _check(engine, run_engine, hf_reference, family, ALL)
    _assert_spec_ran(engine)
    _assert_free(engine)


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_one_request_at_a_time(num_tokens: int, tiny_model: TinyModels, hf_reference: HFReference,
                               run_engine: Callable) -> None:
    engine = _engine(tiny_model("llama"), num_tokens=num_tokens)
    for i in (5, 0, 11):
        _check(engine, run_engine, hf_reference, "llama", [i], prefix=f"r{i}-")
        _assert_free(engine)
    _assert_spec_ran(engine)


def test_chunked_prefill_tiny_budget(tiny_model: TinyModels, hf_reference: HFReference,
                                     run_engine: Callable) -> None:
    """7 tokens a step: drafts compete with prompt chunks for the budget (a verify row
    takes what is left, down to no drafts at all)."""
    engine = _engine(tiny_model("llama"), max_num_batched_tokens=7)
    _check(engine, run_engine, hf_reference, "llama", [3, 8, 11, 0, 14])
    _assert_spec_ran(engine)
    _assert_free(engine)


def test_small_pool_preempts_and_lookahead_yields(tiny_model: TinyModels, hf_reference: HFReference,
                                                  run_engine: Callable) -> None:
    """A pool too small for the batch: lookahead never preempts (it shrinks to the table),
    plain decodes do; outputs stay exact and every block comes back."""
    engine = _engine(tiny_model("llama"), num_blocks=30, max_num_batched_tokens=64)
    _check(engine, run_engine, hf_reference, "llama", ALL)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    _assert_spec_ran(engine)
    _assert_free(engine)


def test_prefix_cache_holds_only_verified_tokens(tiny_model: TinyModels, hf_reference: HFReference,
                                                 run_engine: Callable) -> None:
    """Blocks written by verify steps enter the prefix cache only over verified tokens: a
    continuation (prompt + the first part of its own output) hits those blocks and still
    matches transformers."""
    engine = _engine(tiny_model("qwen2"))
    leaders = [5, 10, 14]
    _check(engine, run_engine, hf_reference, "qwen2", leaders, prefix="a")
    _assert_spec_ran(engine)
    refs = hf_reference("qwen2", [PROMPTS[i] for i in leaders], [MAX_TOKENS[i] for i in leaders])
    prompts, params, want = [], [], {}
    for i, ref in zip(leaders, refs):
        k = len(ref) * 3 // 4
        prompts.append(PROMPTS[i] + ref[:k])
        params.append(_greedy(MAX_TOKENS[i] - k))
        want[f"c{i}"] = ref[k:]
    finals: dict[str, RequestOutput] = {}
    got = run_engine(engine, prompts, params, request_ids=list(want), final_outputs=finals)
    assert got == want
    for rid, prompt in zip(want, prompts):
        assert finals[rid].num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK > len(PROMPTS[int(rid[1:])]) - BLOCK
    _assert_free(engine)


def test_same_outputs_without_prefix_caching_and_with_speculation_off(
        tiny_model: TinyModels, run_engine: Callable) -> None:
    """The engine without speculation is the reference here; no prefix cache either."""
    model = tiny_model("qwen3")
    params = [_greedy(MAX_TOKENS[i]) for i in ALL]
    prompts = [PROMPTS[i] for i in ALL]
    on = _engine(model, enable_prefix_caching=False)
    off = _engine(model, enable_prefix_caching=False, spec=False)
    assert run_engine(on, prompts, params) == run_engine(off, prompts, params)
    _assert_spec_ran(on)
    assert off.stats().num_verify_rows == 0
    assert on.stats().num_steps < off.stats().num_steps


def test_mixed_batch_of_rows_that_speculate_and_rows_that_cannot(
        tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable) -> None:
    """One batch: plain greedy rows (speculate), greedy rows asking for logprobs (do not:
    still transformers' tokens), rows with a repetition penalty (do not: the plain engine's
    tokens), seeded sampled rows (speculate through rejection sampling: the same tokens on
    every run) and prompts still prefilling beside them."""
    model = tiny_model("llama")
    kinds = [
        lambda n: _greedy(n),
        lambda n: SamplingParams(max_tokens=n, temperature=0.0, logprobs=2),
        lambda n: SamplingParams(max_tokens=n, temperature=0.0, repetition_penalty=1.3),
        lambda n: SamplingParams(max_tokens=n, temperature=0.9, top_k=20, seed=7),
    ]
    params = [kinds[i % 4](MAX_TOKENS[i]) for i in ALL]
    prompts = [PROMPTS[i] for i in ALL]
    runs = []
    for spec in (True, True, False):
        engine = _engine(model, spec=spec, max_num_batched_tokens=48)
        runs.append(run_engine(engine, prompts, params))
        if spec:
            _assert_spec_ran(engine)
            _assert_free(engine)
    refs = hf_reference("llama", prompts, [MAX_TOKENS[i] for i in ALL])
    for i in ALL:
        if i % 4 in (0, 1):
            assert runs[0][str(i)] == refs[i]
        elif i % 4 == 2:
            assert runs[0][str(i)] == runs[2][str(i)]
        else:
            assert runs[0][str(i)] == runs[1][str(i)]
            assert len(runs[0][str(i)]) == MAX_TOKENS[i]
