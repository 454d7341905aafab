"""Greedy-only batches take their logits in the model dtype (no fp32 copy of the
(rows, vocab) logits): the argmax is the fp32 upcast's, ties included; any row that needs
more than an argmax keeps the fp32 path. End to end, a bf16 engine's greedy tokens are
the same with and without it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.worker.sampling.test_sampler import CPU, make_seq
from worker.api import SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine
from worker.sampling.sampler import Sampler, argmax_only

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_bf16_argmax_equals_the_fp32_upcasts_with_ties() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 300, generator=g) * 2).to(torch.bfloat16)
    logits[3, 10] = logits[3, 200] = logits[3].max() + 1  # a tie: the first index wins in both
    seqs = [make_seq(GREEDY, request_id=str(i)) for i in range(16)]
    out = Sampler(300, CPU)(logits, seqs)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.token_ids[3] == 10


@pytest.mark.parametrize("params, output", [
    (SamplingParams(temperature=0.7, max_tokens=8), []),
    (SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=8), []),
    (SamplingParams(temperature=0, logit_bias=((5, 2.0),), max_tokens=8), []),
    (SamplingParams(temperature=0, logprobs=2, max_tokens=8), []),
    (SamplingParams(temperature=0, min_tokens=2, max_tokens=8), [7]),
])
def test_rows_that_need_more_than_an_argmax_keep_fp32(params: SamplingParams, output: list[int]) -> None:
    assert argmax_only([make_seq(GREEDY)])
    assert not argmax_only([make_seq(GREEDY), make_seq(params, output=output)])


def test_bf16_engine_greedy_tokens_unchanged_by_model_dtype_logits(tiny_llama: Path) -> None:
    model_dir = tiny_llama
    prompts = [[5, 9, 33, 7] * 5, list(range(3, 30)), [11] * 17]

    def run(keep_dtype: bool) -> tuple[list[list[int]], list[torch.dtype]]:
        engine = build_engine(EngineConfig(
            ModelConfig(str(model_dir), dtype="bfloat16", device="cpu"),
            CacheConfig(block_size=16, num_blocks_override=64),
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        ))
        runner = engine.runner
        runner._logits_in_model_dtype = keep_dtype
        seen: list[torch.dtype] = []
        compute = runner.model.compute_logits

        def spy(hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
            out = compute(hidden, fp32)
            seen.append(out.dtype)
            return out

        runner.model.compute_logits = spy
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
        return [tokens[str(i)] for i in range(len(prompts))], seen

    kept, kept_dtypes = run(True)
    upcast, upcast_dtypes = run(False)
    assert set(kept_dtypes) == {torch.bfloat16} and set(upcast_dtypes) == {torch.float32}
    assert kept == upcast and all(len(t) == 12 for t in kept)
