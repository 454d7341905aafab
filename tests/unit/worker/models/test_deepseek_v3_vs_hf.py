"""Greedy outputs of the engine on tiny random DeepSeek-V3 checkpoints are token for token
those of transformers' `generate` (fp32, one request at a time): alone, in mixed batches,
with chunked prefill, under a tight KV pool with preemptions, with prefix-cache hits.

Variants (tests/support/tiny_deepseek.py): ds_qlora (q_lora_rank set, first_k_dense_replace
1, n_group 4 / topk_group 2, interleaved RoPE), ds_qproj (q_proj, every layer MoE,
rotate-half RoPE), ds_flat (one group, norm_topk_prob off, two shared experts, attention
biases, tied head), ds_yarn (YaRN RoPE with mscale_all_dim in the softmax scale).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kv.cache_manager import cdiv
from tests.support.tiny_deepseek import VOCAB, DeepseekReference
from worker.api import RequestOutput, SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.engine.build import build_engine

BLOCK = 16
PREFIX_LEN = 32  # two full blocks shared by the prefix group
VARIANTS = ["ds_qlora", "ds_qproj", "ds_flat", "ds_yarn"]


def _prompt_set() -> tuple[list[list[int]], list[int], list[int]]:
    """14 prompts of 1..90 tokens with 1..24 output tokens; the last 4 share a prefix."""
    rng = random.Random(4321)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]  # 0..2 are pad/bos/eos

    prompts = [tokens(n) for n in (1, 2, 15, 16, 17, 33, 90, 64, 47, 8)]
    prefix = tokens(PREFIX_LEN)
    group = list(range(len(prompts), len(prompts) + 4))
    prompts += [prefix + tokens(rng.randint(1, 40)) for _ in group]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    max_tokens[0] = max_tokens[6] = 24  # the shortest and the longest prompt run long
    return prompts, max_tokens, group


PROMPTS, MAX_TOKENS, PREFIX_GROUP = _prompt_set()
ALL = list(range(len(PROMPTS)))
CHUNKED = [6, 7, 0, 5, 12]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeepseekReference]:
    yield DeepseekReference(tmp_path_factory.mktemp("tiny-deepseek"))


def _engine(model_dir: Path, num_blocks: int = 256, max_num_batched_tokens: int = 1024,
            enable_prefix_caching: bool = True, device: str = "cpu") -> Engine:
    return build_engine(
        EngineConfig(
            ModelConfig(str(model_dir), dtype="float32", device=device),
            CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks, enable_prefix_caching=enable_prefix_caching),
            SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=max_num_batched_tokens),
        )
    )


def _run(run_engine: Callable, engine: Engine, indices: list[int], prefix: str = "",
         finals: dict[str, RequestOutput] | None = None) -> dict[str, list[int]]:
    out = run_engine(
        engine, [PROMPTS[i] for i in indices],
        [SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0) for i in indices],
        request_ids=[f"{prefix}{i}" for i in indices], final_outputs=finals,
    )
    return {rid[len(prefix):]: toks for rid, toks in out.items()}


def _expected(reference: DeepseekReference, variant: str, indices: list[int]) -> dict[str, list[int]]:
    refs = reference.greedy(variant, [PROMPTS[i] for i in indices], [MAX_TOKENS[i] for i in indices])
    return {str(i): ref for i, ref in zip(indices, refs)}


def _assert_free(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.kv.free_blocks == stats.kv.total_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_alone(variant: str, reference: DeepseekReference, run_engine: Callable) -> None:
    engine = _engine(reference.checkpoint(variant))
    for i in (6, 0):  # the longest prompt, then a one-token prompt
        assert _run(run_engine, engine, [i]) == _expected(reference, variant, [i])
        _assert_free(engine)


@pytest.mark.parametrize("variant", ["ds_qlora", "ds_qproj", "ds_yarn"])
def test_mixed_batch(variant: str, reference: DeepseekReference, run_engine: Callable) -> None:
    """Every prompt at once: decodes (absorbed) and prefills (expanded) share steps, and
    the MoE layers route the whole flat batch together."""
    engine = _engine(reference.checkpoint(variant))
    assert _run(run_engine, engine, ALL) == _expected(reference, variant, ALL)
    _assert_free(engine)


@pytest.mark.parametrize("variant", ["ds_qlora", "ds_flat"])
def test_chunked_prefill(variant: str, reference: DeepseekReference, run_engine: Callable) -> None:
    """7 tokens per step: chunks straddle blocks and attend to cached latent context."""
    engine = _engine(reference.checkpoint(variant), max_num_batched_tokens=7)
    assert _run(run_engine, engine, CHUNKED) == _expected(reference, variant, CHUNKED)
    assert engine.stats().num_steps >= cdiv(sum(len(PROMPTS[i]) for i in CHUNKED), 7)
    _assert_free(engine)


@pytest.mark.parametrize("variant,enable_prefix_caching", [("ds_qlora", True), ("ds_qproj", False)])
def test_tight_pool_preempts(variant: str, enable_prefix_caching: bool, reference: DeepseekReference,
                             run_engine: Callable) -> None:
    """A pool of 18 blocks holds the biggest request about three times: the youngest
    running requests are preempted and recomputed, over and over."""
    num_blocks = 18
    assert 2 * max(cdiv(len(p) + n, BLOCK) for p, n in zip(PROMPTS, MAX_TOKENS)) <= num_blocks
    engine = _engine(reference.checkpoint(variant), num_blocks=num_blocks,
                     enable_prefix_caching=enable_prefix_caching)
    assert _run(run_engine, engine, ALL) == _expected(reference, variant, ALL)
    assert engine.stats().num_preemptions > 0
    _assert_free(engine)


def test_prefix_cache_hits(reference: DeepseekReference, run_engine: Callable) -> None:
    """Latent blocks written by one request are read by the next ones with the prefix."""
    variant = "ds_qlora"
    engine = _engine(reference.checkpoint(variant))
    expected = _expected(reference, variant, PREFIX_GROUP)
    leader, rest = PREFIX_GROUP[0], PREFIX_GROUP[1:]
    assert _run(run_engine, engine, [leader], "a") == {str(leader): expected[str(leader)]}
    finals: dict[str, RequestOutput] = {}
    assert _run(run_engine, engine, rest, "b", finals) == {str(i): expected[str(i)] for i in rest}
    assert all(finals[f"b{i}"].num_cached_tokens == PREFIX_LEN for i in rest)
    _assert_free(engine)


def test_chunks_preemption_and_prefix_cache_together(reference: DeepseekReference, run_engine: Callable) -> None:
    variant = "ds_qproj"
    engine = _engine(reference.checkpoint(variant), num_blocks=18, max_num_batched_tokens=24)
    assert _run(run_engine, engine, ALL) == _expected(reference, variant, ALL)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv.prefix_cache_hits > 0
    _assert_free(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["ds_qlora", "ds_qproj"])
def test_on_cuda_mixed_and_chunked(variant: str, reference: DeepseekReference, run_engine: Callable) -> None:
    """The CUDA runner (MLA's torch path, the routed experts on the fused-MoE kernel)
    against the same CPU reference: every prompt at once, then small prompt chunks."""
    engine = _engine(reference.checkpoint(variant), device="cuda")
    assert _run(run_engine, engine, ALL) == _expected(reference, variant, ALL)
    _assert_free(engine)
    engine = _engine(reference.checkpoint(variant), device="cuda", max_num_batched_tokens=24)
    assert _run(run_engine, engine, CHUNKED, prefix="c") == _expected(reference, variant, CHUNKED)
    _assert_free(engine)
