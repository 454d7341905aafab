"""The client's session reaches the engine through the engine API (AsyncEngine.run_into,
the path WorkerReplica takes with GenerateRequest.session_id): the finished turn's blocks
are retained for the session, reported as free, and its next turn hits them. No Ray."""
from __future__ import annotations

import random

from tests.support.engine_api_helpers import all_free, await_condition, random_prompt
# pytest fixtures, used by name (async_engine needs engine and tokenizer here too)
from tests.support.engine_api_helpers import async_engine, engine, tokenizer  # noqa: F401
from worker.api import RequestOutput, SamplingParams
from worker.engine.async_engine import AsyncEngine


async def _turn(ae: AsyncEngine, request_id: str, prompt: list[int],
                session: str | None) -> tuple[list[int], RequestOutput]:
    outs: list[RequestOutput] = []
    await ae.run_into(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), request_id,
                      outs.append, session_id=session)
    return [t for out in outs for t in out.new_token_ids], outs[-1]


async def test_session_turn_is_retained_and_hit_by_the_next(async_engine: AsyncEngine) -> None:
    block = async_engine.engine.kv.block_size
    prompt = random_prompt(random.Random(3), 70)
    answer, _ = await _turn(async_engine, "t1", prompt, "s")
    await await_condition(all_free(async_engine), "the first turn's blocks freed (retained blocks count as free)")
    # Every full block of the prompt and the computed answer (its last token never is).
    assert async_engine.stats().kv.retained_blocks == (len(prompt) + 3) // block
    second = prompt + answer + [5, 6, 7]  # the client re-sends the answer and a tool result
    _, later = await _turn(async_engine, "t2", second, "s")
    assert later.num_cached_tokens == (len(prompt) + 3) // block * block
    assert async_engine.stats().kv.retained_blocks == (len(second) + 3) // block  # the new turn replaced it
    _, other = await _turn(async_engine, "t3", random_prompt(random.Random(4), 40), None)
    assert other.finished and async_engine.stats().kv.retained_blocks == (len(second) + 3) // block
