"""Greedy outputs of the engine are token-for-token those of transformers' `generate`
(fp32, one request at a time) on tiny random Llama-family models, however the engine
batches, chunks, caches or preempts.

One fixed random prompt set is shared by every case so that each family's reference is
computed once per session (see `hf_reference` in conftest).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from kv.cache_manager import cdiv
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.api import RequestOutput
from worker.api import SamplingParams
from worker.engine.build import build_engine

if TYPE_CHECKING:
    from tests.conftest import HFReference, TinyModels

VOCAB = 512  # tests/support/tiny_models.py
BLOCK = 16
FAMILIES = ["llama", "qwen2", "qwen3"]
PREFIX_LEN = 48  # three full blocks shared by the prefix group


def _prompt_set() -> tuple[list[list[int]], list[int], list[int]]:
    """32 prompts of 1..120 tokens with 1..64 output tokens each. The last 8 share a
    48-token prefix. Lengths at and around block boundaries are always present."""
    rng = random.Random(1234)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]  # 0..2 are pad/bos/eos

    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 120, 119, 64, 100] + [rng.randint(1, 120) for _ in range(12)]
    prompts = [tokens(n) for n in lengths]
    prefix = tokens(PREFIX_LEN)
    group = list(range(len(prompts), len(prompts) + 8))
    prompts += [prefix + tokens(rng.randint(1, 120 - PREFIX_LEN)) for _ in group]
    max_tokens = [rng.randint(1, 64) for _ in prompts]
    max_tokens[0] = max_tokens[8] = 64  # the shortest and the longest prompt run long
    max_tokens[1] = 1
    return prompts, max_tokens, group


PROMPTS, MAX_TOKENS, PREFIX_GROUP = _prompt_set()
ALL = list(range(len(PROMPTS)))
# A few long prompts and a short one for the tiny token budget (kept small: many steps).
CHUNKED = [8, 9, 11, 0, 7, 24, 27]


def _engine(
    model_dir: Path,
    num_blocks: int = 512,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    enable_prefix_caching: bool = True,
    device: str = "cpu",
    attention_backend: str = "auto",
) -> Engine:
    return build_engine(
        EngineConfig(
            ModelConfig(str(model_dir), dtype="float32", device=device, attention_backend=attention_backend),
            CacheConfig(
                block_size=BLOCK,
                num_blocks_override=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
            ),
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        )
    )


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _expected(hf_reference: HFReference, family: str, indices: list[int]) -> dict[str, list[int]]:
    """Reference outputs keyed by request id (the prompt index as a string)."""
    refs = hf_reference(family, PROMPTS, MAX_TOKENS)  # the whole set, once per family
    return {str(i): refs[i] for i in indices}


def _run(
    run_engine: Callable[..., dict[str, list[int]]],
    engine: Engine,
    indices: list[int],
    prefix: str = "",
    final_outputs: dict[str, RequestOutput] | None = None,
) -> dict[str, list[int]]:
    """Run PROMPTS[indices] together; results keyed by the prompt index as a string."""
    out = run_engine(
        engine,
        [PROMPTS[i] for i in indices],
        [_greedy(MAX_TOKENS[i]) for i in indices],
        request_ids=[f"{prefix}{i}" for i in indices],
        final_outputs=final_outputs,
    )
    return {rid[len(prefix):]: toks for rid, toks in out.items()}


def _assert_free(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.kv.free_blocks == stats.kv.total_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0


# -- (a) one request alone ----------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_single_request(
    family: str, tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_model(family))
    for i in (8, 0):  # the longest prompt, then a one-token prompt; 64 tokens each
        prompt, n = PROMPTS[i], MAX_TOKENS[i]
        (expected,) = hf_reference(family, [prompt], [n])
        assert run_engine(engine, [prompt], _greedy(n)) == {"0": expected}
        _assert_free(engine)


# -- (b) continuous batching ----------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_mixed_lengths(
    family: str, tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_model(family))
    finals: dict[str, RequestOutput] = {}
    assert _run(run_engine, engine, ALL, final_outputs=finals) == _expected(hf_reference, family, ALL)
    for i in ALL:
        out = finals[str(i)]
        assert out.num_prompt_tokens == len(PROMPTS[i])
        assert out.finish_reason in ("stop", "length")
        assert (out.finish_reason == "length") == (out.num_output_tokens == MAX_TOKENS[i])
    _assert_free(engine)


# -- (c) chunked prefill ----------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_tiny_budget(
    family: str, tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    # 7 tokens per step: never a multiple of the block size, so chunks straddle blocks,
    # and decodes of running requests share the budget with prompt chunks.
    engine = _engine(tiny_model(family), max_num_batched_tokens=7)
    assert _run(run_engine, engine, CHUNKED) == _expected(hf_reference, family, CHUNKED)
    # A 120-token prompt needs >= 18 steps to prefill: chunking really happened.
    assert engine.stats().num_steps >= cdiv(sum(len(PROMPTS[i]) for i in CHUNKED), 7)
    _assert_free(engine)


# -- (d) prefix cache ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits(
    family: str, tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    engine = _engine(tiny_model(family))
    expected = _expected(hf_reference, family, ALL)
    leader, rest = PREFIX_GROUP[0], PREFIX_GROUP[1:]

    # 1. The group's leader alone: caches the shared prefix (and its own blocks).
    finals: dict[str, RequestOutput] = {}
    assert _run(run_engine, engine, [leader], "a", finals) == {str(leader): expected[str(leader)]}
    assert finals[f"a{leader}"].num_cached_tokens == 0
    assert engine.stats().kv.prefix_cache_hits == 0

    # 2. The rest of the group together: each reuses the three shared prefix blocks.
    finals.clear()
    assert _run(run_engine, engine, rest, "b", finals) == {str(i): expected[str(i)] for i in rest}
    for i in rest:
        assert finals[f"b{i}"].num_cached_tokens == PREFIX_LEN
    assert engine.stats().kv.prefix_cache_hits == PREFIX_LEN * len(rest)

    # 3. The whole group again plus continuations (prompt + the first half of its own
    #    greedy output): every full block is cached now, including blocks whose KV was
    #    written by decode steps. Greedy is self-consistent, so a continuation's
    #    expected output is the rest of the reference.
    prompts, params, ids, want = [], [], [], {}
    for i in PREFIX_GROUP:
        ref = expected[str(i)]
        prompts.append(PROMPTS[i]); params.append(_greedy(MAX_TOKENS[i])); ids.append(f"c{i}")
        want[f"c{i}"] = ref
        k = len(ref) // 2
        if k > 0 and len(ref) - k > 0:
            prompts.append(PROMPTS[i] + ref[:k]); params.append(_greedy(MAX_TOKENS[i] - k))
            ids.append(f"d{i}"); want[f"d{i}"] = ref[k:]
    finals.clear()
    hits_before = engine.stats().kv.prefix_cache_hits
    assert run_engine(engine, prompts, params, request_ids=ids, final_outputs=finals) == want
    for rid, prompt in zip(ids, prompts):
        # Every full block but the one holding the last prompt token was cached.
        assert finals[rid].num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK, rid
        assert finals[rid].num_cached_tokens > 0
    stats = engine.stats()
    assert stats.kv.prefix_cache_hits > hits_before > 0
    assert stats.kv.prefix_cache_hits <= stats.kv.prefix_cache_queries
    _assert_free(engine)


# -- (e) preemption -------------------------------------------------------------------------------

# The whole set needs 207 blocks at its peak; 40 hold the biggest request three times
# over, so several run at once and the youngest is preempted (recomputed) again and again.
PREEMPT_POOL = 40


@pytest.mark.parametrize(
    "family,enable_prefix_caching",
    [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", True)],
)
def test_preemption_small_pool(
    family: str,
    enable_prefix_caching: bool,
    tiny_model: TinyModels,
    hf_reference: HFReference,
    run_engine: Callable,
) -> None:
    engine = _engine(tiny_model(family), num_blocks=PREEMPT_POOL, enable_prefix_caching=enable_prefix_caching)
    assert 3 * max(cdiv(len(p) + n, BLOCK) for p, n in zip(PROMPTS, MAX_TOKENS)) <= PREEMPT_POOL
    assert _run(run_engine, engine, ALL) == _expected(hf_reference, family, ALL)
    assert engine.stats().num_preemptions > 0
    _assert_free(engine)


# -- everything at once ---------------------------------------------------------------------------

def test_chunked_prefill_preemption_and_prefix_cache_together(
    tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    """A small budget and a small pool: prompt chunks, recomputation after preemption
    (partly from the prefix cache) and shared-prefix hits interleave in one run."""
    engine = _engine(tiny_model("llama"), num_blocks=PREEMPT_POOL, max_num_batched_tokens=24)
    assert _run(run_engine, engine, ALL) == _expected(hf_reference, "llama", ALL)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv.prefix_cache_hits > 0
    _assert_free(engine)


# -- on a GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_cuda_batched_chunked_and_cached(
    family: str, backend: str, tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    """The CUDA runner (its decode steps replayed as CUDA graphs, each attention backend)
    against the same CPU reference: the whole set at once (mixed lengths, shared
    prefixes), then the long prompts under a small token budget (prompt chunks)."""
    engine = _engine(tiny_model(family), device="cuda", attention_backend=backend)
    assert _run(run_engine, engine, ALL) == _expected(hf_reference, family, ALL)
    _assert_free(engine)
    engine = _engine(tiny_model(family), device="cuda", attention_backend=backend, max_num_batched_tokens=24)
    assert _run(run_engine, engine, CHUNKED, prefix="c") == _expected(hf_reference, family, CHUNKED)
    _assert_free(engine)
