"""Aborting a request and leaving its stream early (aclose, cancel, drop): the stream ends,
the engine frees the request's blocks and keeps serving. No Ray.

Block release happens on the step thread after the caller's stream has ended: observed
with await_condition (tests/support/engine_api_helpers.py), not sleeps.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from tests.support.engine_api_helpers import all_free, await_condition, collect, random_prompt, tokens_of
# pytest fixtures, used by name (async_engine needs engine and tokenizer here too)
from tests.support.engine_api_helpers import async_engine, engine, tokenizer  # noqa: F401
from worker.engine.async_engine import AsyncEngine
from worker.api import RequestOutput
from worker.api import SamplingParams


# -- abort and leaving early -----------------------------------------------------------------------

async def test_abort_frees_blocks_and_ends_stream(async_engine: AsyncEngine) -> None:
    prompt = random_prompt(random.Random(1), 40)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = async_engine.generate(prompt, params, request_id="victim")
    outs = [await anext(stream), await anext(stream)]
    assert async_engine.stats().kv.free_blocks < async_engine.stats().kv.total_blocks
    # The step in flight may still finish; the abort is applied right after it.
    num_generated_at_abort = async_engine.engine.counters.num_generated_tokens
    async_engine.abort("victim")
    outs += [out async for out in stream]
    last = outs[-1]
    assert last.finished and last.finish_reason == "abort"
    assert not any(o.finished for o in outs[:-1])
    assert last.num_output_tokens == len(tokens_of(outs)) < 200
    assert last.num_output_tokens <= num_generated_at_abort + 2
    # Freed before the abort output was even sent; stats() catches up one loop later.
    await await_condition(all_free(async_engine), "aborted request's blocks freed")
    assert async_engine.engine.seqs == {}
    async_engine.abort("victim")  # aborting again (or an unknown id) is a no-op
    async_engine.abort("never-existed")
    # And the engine keeps serving.
    again = await collect(async_engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0)))
    assert again[-1].finish_reason == "length" and len(tokens_of(again)) == 5


@pytest.mark.parametrize("how", ["aclose", "cancel", "drop"])
async def test_leaving_stream_early_aborts(async_engine: AsyncEngine, how: str) -> None:
    prompt = random_prompt(random.Random(2), 30)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    got_first = asyncio.Event()

    async def consume(stream: AsyncIterator[RequestOutput]) -> None:
        async for _ in stream:
            got_first.set()

    if how == "aclose":
        stream = async_engine.generate(prompt, params, request_id="leaver")
        await anext(stream)
        await stream.aclose()
    elif how == "cancel":
        task = asyncio.create_task(consume(async_engine.generate(prompt, params, request_id="leaver")))
        await got_first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:  # break out of `async for` and drop the generator: the loop's finaliser closes it
        stream = async_engine.generate(prompt, params, request_id="leaver")
        async for _ in stream:
            break
        del stream

    await await_condition(all_free(async_engine), f"blocks freed after {how}")
    await await_condition(lambda: "leaver" not in async_engine.engine.seqs, "request removed")
    assert async_engine.stats().num_generated_tokens < 200
    # The id can be used again, and the engine serves it normally.
    outs = await collect(async_engine.generate(prompt, SamplingParams(max_tokens=3), request_id="leaver"))
    assert outs[-1].finish_reason == "length"
