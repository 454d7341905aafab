"""The floor's stand-in device (benchmarks/serve_floor.py) plans steps as kvserve's
scheduler does at its defaults: decodes first, prompt chunks in the rest of the budget."""
from __future__ import annotations

import asyncio

from benchmarks.serve_floor import _Active, _Device


def test_decodes_first_then_prompt_chunks_in_arrival_order() -> None:
    device = _Device()
    running = [_Active(max_tokens=8, prompt_len=100, computed=100, produced=1) for _ in range(3)]
    long_prompt, short_prompt = _Active(max_tokens=8, prompt_len=2000), _Active(max_tokens=8, prompt_len=500)
    device.active = [running[0], long_prompt, running[1], short_prompt, running[2]]
    plan = device._plan()
    budget = device.token_budget
    assert [(r, n) for r, n in plan] == [
        (running[0], 1), (running[1], 1), (running[2], 1),
        (long_prompt, 2000), (short_prompt, budget - 3 - 2000),
    ]


def test_a_prompt_samples_once_its_last_chunk_ran() -> None:
    device = _Device()
    prompt_len = device.token_budget + 10  # two chunks
    request = _Active(max_tokens=2, prompt_len=prompt_len)
    steps: list[list[tuple[int, int, bool]]] = []
    predict = device.cost.predict_rows

    def recording(rows: list[tuple[int, int, bool]]) -> float:
        steps.append(list(rows))
        return predict(rows) / 1000  # a thousandth of the modelled time: a fast test

    device.cost.predict_rows = recording  # type: ignore[method-assign]

    async def run() -> None:
        device.add(request)
        await device._loop_task

    asyncio.run(run())
    assert steps == [
        [(device.token_budget, 0, False)],  # first chunk: nothing sampled
        [(10, device.token_budget, True)],  # last chunk: the first token
        [(1, prompt_len + 1, True)],  # one decode: the second and last token
    ]
    assert request.produced == 2 and device.active == []
