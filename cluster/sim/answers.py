"""The answers a simulated engine gives, known before the run: a workload whose client
re-sends each answer in its next turn (an agent's history) re-sends exactly what the
engine will produce, so that part of the history is cached as it would be in reality.

worker/sim/runner.py's SimRunner samples each token as a pure function of the history
(and the request's seed): with the simulator's requests (no seed, ignore_eos, max_tokens
reached), `answer(history, n)` is the n tokens a replica of `device` answers `history`
with, on any replica, whatever else it runs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from worker.api import SamplingParams
from worker.sequence import Sequence

if TYPE_CHECKING:
    from cluster.sim.setup import SimDevice

Answer = Callable[[tuple[int, ...], int], tuple[int, ...]]


def engine_answers(device: SimDevice) -> Answer:
    """The `answer` function of cluster/workload/sim_kinds.py's agentic workload for `device`."""
    runner = device.make_runner(1)

    def answer(history: tuple[int, ...], n: int) -> tuple[int, ...]:
        seq = Sequence("answer", list(history), SamplingParams(max_tokens=n, ignore_eos=True), frozenset(), 0.0)
        for _ in range(n):  # each token depends on the one before (a chain, no tensor op)
            seq.token_ids.append(runner.next_token(seq))
        return tuple(seq.token_ids[len(history):])

    return answer
