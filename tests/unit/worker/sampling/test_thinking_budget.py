"""The thinking budget (SamplingParams.thinking, worker/sampling/thinking.py) on a tiny
random Llama: greedy tokens before the budget are the unconstrained ones, then the end
marker is forced, then the answer continues as transformers' greedy continues that text;
the forced rows are applied per row in a mixed batch, for sampled rows too; no forcing
when the section never opens or the model closes it first. No Ray.
"""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tests.support.engine_api_helpers import collect, random_prompt, tokens_of
# pytest fixtures, used by name
from tests.support.engine_api_helpers import async_engine, engine, tokenizer  # noqa: F401
from tests.support.tiny_models import hf_greedy
from worker.api import SamplingParams, SamplingParamsError, ThinkingBudget
from worker.engine.async_engine import AsyncEngine
from worker.sampling.thinking import DONE, FORCING, INSIDE, ThinkingState

MAX_TOKENS = 24
BUDGET = 6


async def _run(ae: AsyncEngine, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    streams = [ae.generate(prompt, params, request_id=rid) for rid, prompt, params in reqs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    return {rid: tokens_of(outs) for (rid, _, _), outs in zip(reqs, results)}


def _greedy(budget: ThinkingBudget | None = None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, thinking=budget)


def _unused(tokens: list[int], n: int) -> tuple[int, ...]:
    """`n` token ids (>= 3: no special token) that `tokens` never contains."""
    return tuple(t for t in range(3, 512) if t not in tokens)[:n]


async def test_budget_forces_the_end_marker_then_answer_continues(async_engine: AsyncEngine, tiny_llama: Path) -> None:
    prompt = random_prompt(random.Random(3), 21)
    free = (await _run(async_engine, [("free", prompt, _greedy())]))["free"]
    end = _unused(free, 2)
    inside = ThinkingBudget(BUDGET, start_token_ids=_unused(free, 3)[2:], end_token_ids=end, starts_inside=True)
    opens = ThinkingBudget(BUDGET, start_token_ids=tuple(free[:2]), end_token_ids=end)
    never = ThinkingBudget(BUDGET, start_token_ids=_unused(free, 3)[2:], end_token_ids=end)
    closes = ThinkingBudget(BUDGET, start_token_ids=end, end_token_ids=(free[2],), starts_inside=True)
    got = await _run(async_engine, [("free2", prompt, _greedy()), ("inside", prompt, _greedy(inside)),
                                    ("opens", prompt, _greedy(opens)), ("never", prompt, _greedy(never)),
                                    ("closes", prompt, _greedy(closes))])
    assert got["free2"] == free  # the unconstrained row beside forced ones is untouched
    assert got["never"] == free and got["closes"] == free
    # Inside from the start: BUDGET free tokens, the marker, then greedy from there on.
    head = free[:BUDGET] + list(end)
    assert got["inside"][:len(head)] == head
    rest = MAX_TOKENS - len(head)
    assert got["inside"][len(head):] == hf_greedy(tiny_llama, [prompt + head], [rest])[0]
    # Opened by the output's first tokens: the budget counts after them.
    head = free[:2 + BUDGET] + list(end)
    assert got["opens"][:len(head)] == head
    assert got["opens"][len(head):] == hf_greedy(tiny_llama, [prompt + head], [MAX_TOKENS - len(head)])[0]


async def test_sampled_rows_and_zero_budget_are_forced(async_engine: AsyncEngine) -> None:
    prompt = random_prompt(random.Random(4), 17)
    end = (400, 401, 402)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True,
                             thinking=ThinkingBudget(4, (399,), end, starts_inside=True))
    zero = _greedy(ThinkingBudget(0, (399,), end, starts_inside=True), max_tokens=5)
    got = await _run(async_engine, [("sampled", prompt, sampled), ("zero", prompt, zero)])
    assert got["sampled"][4:7] == list(end)
    assert got["zero"][:3] == list(end)


def test_state_counts_forces_and_replays() -> None:
    budget = ThinkingBudget(2, (7,), (8, 9), starts_inside=False)
    state = ThinkingState(budget)
    tokens = [1, 1]  # a two-token prompt
    for token, phase, forced in ((7, INSIDE, None), (5, INSIDE, None), (6, FORCING, 8), (8, FORCING, 9), (9, DONE, None)):
        assert not (state.forced_token() is not None and state.forced_token() != token)
        tokens.append(token)
        state.advance(tokens, 2)
        assert (state.phase, state.forced_token()) == (phase, forced)
    assert not state.may_force_next()
    replayed = ThinkingState.replayed(budget, [7, 5])
    assert replayed.phase == INSIDE and replayed.spent == 1 and replayed.may_force_next()
    assert ThinkingState.replayed(budget, [5]).phase == DONE  # the output opened with an answer
    natural = ThinkingState.replayed(ThinkingBudget(9, (7,), (8, 9), starts_inside=True), [3, 8, 9])
    assert natural.phase == DONE and natural.spent == 2


def test_bad_budgets_are_refused() -> None:
    for bad in ({"max_tokens": -1}, {"end_token_ids": ()}, {"start_token_ids": (-1,)}, {"end_token_ids": tuple(range(17))}):
        kwargs = {"max_tokens": 4, "start_token_ids": (1,), "end_token_ids": (2,)} | bad
        with pytest.raises(SamplingParamsError):
            ThinkingBudget(**kwargs)  # type: ignore[arg-type]
