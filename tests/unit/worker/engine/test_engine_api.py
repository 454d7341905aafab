"""The engine API (AsyncEngine over the engine core) on a tiny random Llama: what a request
gets back: seeded sampling independent of the batch, stop strings, logprobs. No Ray.
Abort, bad requests / a failing step and stats are in the test_engine_api_*.py files
beside this one; fixtures and helpers in tests/support/engine_api_helpers.py.
"""
from __future__ import annotations

import asyncio
import math
import random
import string
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from tests.support.engine_api_helpers import (
    all_free,
    await_condition,
    collect,
    random_prompt,
    text_of,
    tokens_of,
)
# pytest fixtures, used by name (async_engine needs engine and tokenizer here too)
from tests.support.engine_api_helpers import async_engine, engine, tokenizer  # noqa: F401
from worker.engine.async_engine import AsyncEngine
from worker.api import SamplingParams


# -- seeded sampling --------------------------------------------------------------------------

async def test_seeded_sampling_independent_of_batch(async_engine: AsyncEngine) -> None:
    rng = random.Random(5)
    prompt_a, prompt_b = random_prompt(rng, 23), random_prompt(rng, 70)
    seeded = [
        ("a7", prompt_a, SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)),
        ("b11", prompt_b, SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)),
        ("a99", prompt_a, SamplingParams(max_tokens=24, temperature=0.8, seed=99, ignore_eos=True)),
    ]

    def others(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
        # Unseeded and seeded neighbours, some of which switch the batch onto the
        # top-k / top-p / min-p paths of the sampler.
        r = random.Random(seed)
        kinds = [
            SamplingParams(max_tokens=r.randint(1, 40), temperature=0.8),
            SamplingParams(max_tokens=r.randint(1, 40), temperature=1.0, top_p=0.9),
            SamplingParams(max_tokens=r.randint(1, 40), temperature=0.5, top_k=5),
            SamplingParams(max_tokens=r.randint(1, 40), temperature=0.8, min_p=0.1, seed=3),
            SamplingParams(max_tokens=r.randint(1, 40), temperature=0.0),
        ]
        return [(f"o{seed}-{i}", random_prompt(r, r.randint(1, 120)), p) for i, p in enumerate(kinds)]

    async def run_together(reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
        streams = [async_engine.generate(p, sp, request_id=rid) for rid, p, sp in reqs]
        results = await asyncio.gather(*(collect(s) for s in streams))
        return {rid: tokens_of(outs) for (rid, _, _), outs in zip(reqs, results)}

    alone = {}
    for req in seeded:
        alone.update(await run_together([req]))
    assert all(len(t) == 24 for t in alone.values())
    # The seed matters (the tiny model's distribution is close to uniform).
    assert alone["a7"] != alone["a99"]

    batched = await run_together(seeded + others(1))
    reordered = await run_together(others(2)[::-1] + seeded[::-1])
    for rid, _, _ in seeded:
        assert batched[rid] == alone[rid], rid
        assert reordered[rid] == alone[rid], rid
    await await_condition(all_free(async_engine), "all blocks free")


# -- stop strings --------------------------------------------------------------------------------

def _pick_stop_string(text: str) -> str:
    """A 3-character ASCII stop string that first occurs a little way into `text`."""
    allowed = set(string.ascii_letters + " ")
    for i in range(4, len(text) - 3):
        s = text[i : i + 3]
        if set(s) <= allowed and s.strip() and text.find(s) == i:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include_stop", [False, True])
async def test_stop_string_ends_request(
    async_engine: AsyncEngine, tokenizer: PreTrainedTokenizerFast, include_stop: bool
) -> None:
    prompt = tokenizer.encode("ba ce di fo gu ha je ki lo mu")
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    full = await collect(async_engine.generate(prompt, greedy))
    full_text = text_of(full)
    assert full_text == tokenizer.decode(tokens_of(full), skip_special_tokens=True)
    assert full[-1].finish_reason == "length"

    stop = _pick_stop_string(full_text)
    params = SamplingParams(
        max_tokens=48, temperature=0.0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=include_stop
    )
    outs = await collect(async_engine.generate(prompt, params))
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == stop
    assert all(not o.finished for o in outs[:-1])
    end = full_text.index(stop) + (len(stop) if include_stop else 0)
    assert text_of(outs) == full_text[:end]
    assert tokens_of(outs) == tokens_of(full)[: len(tokens_of(outs))]
    assert len(tokens_of(outs)) < 48
    # The core does not know stop strings: the stream's end aborts it there.
    await await_condition(all_free(async_engine), "stopped request's blocks freed")


# -- logprobs ---------------------------------------------------------------------------------------

async def test_logprobs(async_engine: AsyncEngine, tiny_llama: Path) -> None:
    rng = random.Random(6)
    prompt = random_prompt(rng, 25)
    requests = [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=5),
        SamplingParams(max_tokens=6, temperature=0.8, seed=1, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=0),
        SamplingParams(max_tokens=6, temperature=0.0),
    ]
    results = await asyncio.gather(*(collect(async_engine.generate(prompt, p)) for p in requests))

    for params, outs in zip(requests, results):
        for out in outs:
            if params.logprobs is None:
                assert out.logprobs is None
                continue
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids) == 1
            lp = out.logprobs[0]
            assert lp.token_id == out.new_token_ids[0]
            assert lp.logprob <= 0.0 and math.isfinite(lp.logprob)
            assert len(lp.top) == params.logprobs
            values = [v for _, v in lp.top]
            assert all(v <= 0.0 for v in values) and values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
            assert len({t for t, _ in lp.top}) == len(lp.top)
            if params.logprobs:
                assert lp.logprob <= values[0] + 1e-6
            if params.greedy and params.logprobs:
                assert lp.top[0][0] == lp.token_id
                assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-6)

    # The first token's top-5 agree with transformers' log-softmax over the prompt.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    values, ids = ref.topk(5)
    top = results[0][0].logprobs[0].top
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
