"""Bad requests and a failing step: invalid sampling parameters and prompts are refused with
the reason, a forward failure fails only the requests in flight, and the engine keeps
serving. No Ray.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.engine_api_helpers import (
    MAX_MODEL_LEN,
    VOCAB,
    FailingForward,
    all_free,
    await_condition,
    collect,
    make_engine,
    random_prompt,
    tokens_of,
)
# pytest fixtures, used by name (async_engine needs engine and tokenizer here too)
from tests.support.engine_api_helpers import async_engine, engine, tokenizer  # noqa: F401
from worker.engine.async_engine import AsyncEngine
from worker.engine.core import Engine
from worker.api import RequestError
from worker.api import SamplingParams, SamplingParamsError


# -- bad requests ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=3.0), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(logprobs=10_000), "logprobs"),
        (dict(stop=("",)), "stop"),
        (dict(stop=tuple(str(i) for i in range(1000))), "stop"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


async def test_invalid_requests_rejected_engine_keeps_serving(async_engine: AsyncEngine) -> None:
    ok = SamplingParams(max_tokens=4, temperature=0.0)
    bad_requests = [
        ([5] * MAX_MODEL_LEN, ok, "max_model_len"),
        ([5] * (MAX_MODEL_LEN + 100), ok, "max_model_len"),
        ([], ok, "empty"),
        ([5, VOCAB], ok, "prompt token ids"),
        ([5, -1], ok, "prompt token ids"),
        ([5, 6], SamplingParams(max_tokens=4, stop_token_ids=(VOCAB + 3,)), "stop_token_ids"),
    ]
    for prompt, params, match in bad_requests:
        with pytest.raises(RequestError, match=match):
            await anext(async_engine.generate(prompt, params))

    # A request id already streaming is refused; the first request is unaffected.
    first = async_engine.generate([7, 8, 9], SamplingParams(max_tokens=20, temperature=0.0), request_id="dup")
    head = await anext(first)
    with pytest.raises(RequestError, match="already in use"):
        await anext(async_engine.generate([7, 8], ok, request_id="dup"))
    rest = await collect(first)
    assert rest[-1].finish_reason == "length" and len(tokens_of([head, *rest])) == 20

    # The longest prompt that fits is served, and so is the next ordinary request.
    longest = await collect(async_engine.generate([5] * (MAX_MODEL_LEN - 1), SamplingParams(max_tokens=8)))
    assert longest[-1].finish_reason == "length" and len(tokens_of(longest)) == 1  # max_model_len
    normal = await collect(async_engine.generate([11, 12, 13], ok))
    assert normal[-1].finish_reason == "length" and len(tokens_of(normal)) == 4
    assert async_engine.is_alive
    await await_condition(all_free(async_engine), "all blocks free")


def test_sync_engine_rejects_bad_requests(engine: Engine, run_engine: Callable) -> None:
    ok = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("long", [5] * MAX_MODEL_LEN, ok)
    engine.add_request("x", [5, 6], ok)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("x", [5, 6], ok)
    assert engine.abort_request("x").finish_reason == "abort"
    assert engine.abort_request("x") is None
    assert len(run_engine(engine, [[5, 6]], ok, request_ids=["y"])["y"]) == 3


# -- a failing step ---------------------------------------------------------------------------------

async def test_failing_step_fails_only_in_flight_requests(
    async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(3)
    victims = [random_prompt(rng, 20), random_prompt(rng, 50)]
    survivor = random_prompt(rng, 30)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = tokens_of(await collect(async_engine.generate(survivor, greedy)))

    model = async_engine.engine.runner.model
    failing = FailingForward(model.forward)
    monkeypatch.setattr(model, "forward", failing)

    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    streams = [async_engine.generate(p, long) for p in victims]
    heads = [await anext(s) for s in streams]  # both are running now
    failing.armed = True
    results = [[h, *await collect(s)] for h, s in zip(heads, streams)]
    assert failing.num_failures == 1
    for outs in results:
        last = outs[-1]
        assert last.finished and last.finish_reason == "error"
        assert last.error and "injected forward failure" in last.error
        assert len(tokens_of(outs)) < 200
    await await_condition(all_free(async_engine), "failed requests' blocks freed")

    assert async_engine.is_alive
    after = await collect(async_engine.generate(survivor, greedy))
    assert tokens_of(after) == expected and after[-1].finish_reason == "length"


def test_failing_step_spares_waiting_requests(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, run_engine: Callable
) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=2)  # the third request has to wait
    rng = random.Random(4)
    prompts = [random_prompt(rng, 20), random_prompt(rng, 33), random_prompt(rng, 17)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = run_engine(engine, prompts[2:], greedy, request_ids=["ref"])["ref"]

    failing = FailingForward(engine.runner.model.forward)
    monkeypatch.setattr(engine.runner.model, "forward", failing)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy)
    first = engine.step()
    assert sorted(o.request_id for o in first) == ["0", "1"]
    assert engine.stats().num_running == 2 and engine.stats().num_waiting == 1
    failing.armed = True
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["0", "1"]
    assert all(o.finished and o.finish_reason == "error" and o.error for o in failed)
    assert set(engine.seqs) == {"2"}
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "2" and out.finish_reason != "error"
            tokens += out.new_token_ids
    assert tokens == expected
    stats = engine.stats()
    assert stats.kv.free_blocks == stats.kv.total_blocks
