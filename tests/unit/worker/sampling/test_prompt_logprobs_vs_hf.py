"""Prompt logprobs (vLLM's `prompt_logprobs`) equal transformers' log_softmax of its own
forward over the same prompt (fp32), whether the prompt runs in one step, in chunks of a
tiny token budget, beside other requests, after a prefix-cache hit would have been
possible, or after a preemption."""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from worker.api import RequestError, RequestOutput, SamplingParams, TokenLogprob
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.engine.build import build_engine

if TYPE_CHECKING:
    from tests.conftest import TinyModels

VOCAB = 512  # tests/support/tiny_models.py
BLOCK = 16
TOP_K = 5
# fp32, different kernels (paged attention vs HF's eager): differences are ~1e-6.
ATOL = 1e-4


def _engine(model_dir: Path, max_num_batched_tokens: int = 2048, num_blocks: int = 256) -> Engine:
    return build_engine(
        EngineConfig(
            ModelConfig(str(model_dir), dtype="float32", device="cpu"),
            CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks, enable_prefix_caching=True),
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens),
        )
    )


def _prompts(n: int, seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def _hf_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """(P-1, V): row q is log_softmax of the logits at position q (they predict token q+1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _first_outputs(engine: Engine, prompts: list[list[int]], params: SamplingParams, run_engine: Callable) -> dict[str, RequestOutput]:
    firsts: dict[str, RequestOutput] = {}
    step = engine.step

    def recording_step() -> list[RequestOutput]:
        outs = step()
        for out in outs:
            firsts.setdefault(out.request_id, out)
        return outs

    engine.step = recording_step  # type: ignore[method-assign]
    run_engine(engine, prompts, params)
    return firsts


def _check(entries: list[TokenLogprob | None], prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for q, entry in enumerate(entries[1:]):
        assert entry is not None
        row = reference[q]
        assert entry.token_id == prompt[q + 1]
        assert entry.logprob == pytest.approx(row[prompt[q + 1]].item(), abs=ATOL)
        # The rank-th best value is the token's own (a near-tie may order ties differently).
        assert row.sort(descending=True).values[entry.rank - 1].item() == pytest.approx(entry.logprob, abs=ATOL)
        assert len(entry.top) == k
        expected = row.topk(k)
        for (token_id, logprob), value in zip(entry.top, expected.values.tolist()):
            assert logprob == pytest.approx(value, abs=ATOL)
            assert row[token_id].item() == pytest.approx(value, abs=ATOL)


@pytest.mark.parametrize("budget", [2048, 16, 7], ids=["one-step", "chunked-16", "chunked-7"])
def test_prompt_logprobs_match_hf(tiny_model: TinyModels, run_engine: Callable, budget: int) -> None:
    model_dir = tiny_model("llama")
    prompts = _prompts(3, seed=budget, lengths=[40, 1, 23])
    engine = _engine(model_dir, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_K)
    firsts = _first_outputs(engine, prompts, params, run_engine)
    for i, prompt in enumerate(prompts):
        entries = firsts[str(i)].prompt_logprobs
        assert entries is not None
        _check(entries, prompt, _hf_logprobs(model_dir, prompt) if len(prompt) > 1 else torch.empty(0, VOCAB), TOP_K)


def test_prompt_logprobs_in_slices(tiny_model: TinyModels, run_engine: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's rows are cut into slices of bounded logits (5 rows here): same entries."""
    from worker.sampling import prompt_logprobs
    monkeypatch.setattr(prompt_logprobs, "MAX_SLICE_ELEMENTS", 5 * VOCAB)
    model_dir = tiny_model("llama")
    prompts = _prompts(2, seed=5, lengths=[33, 12])
    engine = _engine(model_dir)
    firsts = _first_outputs(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3), run_engine)
    for i, prompt in enumerate(prompts):
        entries = firsts[str(i)].prompt_logprobs
        assert entries is not None
        _check(entries, prompt, _hf_logprobs(model_dir, prompt), 3)


def test_prompt_logprobs_with_a_cached_prefix(tiny_model: TinyModels, run_engine: Callable) -> None:
    """A second request with the same prompt would hit the prefix cache; it recomputes
    instead (as vLLM), so its entries are complete and exact, and it reports no cached
    tokens, while a plain request after it still hits the cache."""
    model_dir = tiny_model("qwen2")
    prompt = _prompts(1, seed=7, lengths=[50])[0]
    engine = _engine(model_dir, max_num_batched_tokens=24)
    finals: dict[str, RequestOutput] = {}
    run_engine(engine, [prompt], SamplingParams(max_tokens=1, temperature=0.0), ["warm"], finals)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0)
    firsts = _first_outputs(engine, [prompt], params, run_engine)
    out = firsts["0"]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs is not None
    _check(out.prompt_logprobs, prompt, _hf_logprobs(model_dir, prompt), 0)
    run_engine(engine, [prompt], SamplingParams(max_tokens=1, temperature=0.0), ["plain"], finals)
    assert finals["plain"].num_cached_tokens == 48  # three full blocks


def test_prompt_logprobs_only_on_the_first_output_and_mixed_batch(tiny_model: TinyModels, run_engine: Callable) -> None:
    """Requests that did not ask get none; one that asked gets them once, whatever the
    number of outputs."""
    model_dir = tiny_model("llama")
    prompts = _prompts(2, seed=3, lengths=[30, 30])
    engine = _engine(model_dir, max_num_batched_tokens=20)
    seen: dict[str, int] = {"asks": 0, "plain": 0}
    step = engine.step

    def recording_step() -> list[RequestOutput]:
        outs = step()
        for out in outs:
            if out.prompt_logprobs is not None:
                seen[out.request_id] += 1
                assert out.num_output_tokens == 1
        return outs

    engine.step = recording_step  # type: ignore[method-assign]
    asks = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    run_engine(engine, prompts, [asks, plain], ["asks", "plain"])
    assert seen == {"asks": 1, "plain": 0}


def test_prompt_logprobs_after_preemption(tiny_model: TinyModels, run_engine: Callable) -> None:
    """A pool so small that prefills preempt one another: each prompt token still gets
    exactly one exact entry."""
    model_dir = tiny_model("llama")
    prompts = _prompts(3, seed=11, lengths=[60, 55, 50])
    engine = _engine(model_dir, max_num_batched_tokens=16, num_blocks=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1)
    firsts = _first_outputs(engine, prompts, params, run_engine)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        entries = firsts[str(i)].prompt_logprobs
        assert entries is not None
        _check(entries, prompt, _hf_logprobs(model_dir, prompt), 1)


def test_prompt_logprobs_bounds() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_engine_without_support_refuses(tiny_model: TinyModels) -> None:
    engine = _engine(tiny_model("llama"))
    # A runner without the capability (TP, simulated device) refuses with a clear 400.
    engine.runner = _NoPromptLogprobs(engine.runner)  # type: ignore[assignment]
    with pytest.raises(RequestError, match="prompt_logprobs is not supported"):
        engine.add_request("x", [5, 6, 7], SamplingParams(prompt_logprobs=1))


class _NoPromptLogprobs:
    def __init__(self, inner: object) -> None:
        self.num_blocks = inner.num_blocks  # type: ignore[attr-defined]

    def execute(self, plan: object) -> object:
        raise AssertionError("never executed")
