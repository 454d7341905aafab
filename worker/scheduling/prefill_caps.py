"""What one prompt chunk may put into a step beyond the token budget: the worse bands' share
while a better band is in use (worker/scheduling/band_prefill.py), then, in a step that carries
decodes, the step-time budget (worker/scheduling/step_budget.py). The scheduler calls `start_step`
once per plan, `cap` before it plans a prompt chunk and `planned` for every row it plans.
"""
from __future__ import annotations

from collections import deque

from worker.scheduling.band_prefill import BandPrefillLimit
from worker.sequence import Sequence
from worker.scheduling.step_budget import MIN_PREFILL_TOKENS, Row, StepTimeBudget


class PrefillCaps:
    def __init__(self, band_limit: BandPrefillLimit | None) -> None:
        self.band_limit = band_limit
        self._step_budget: StepTimeBudget | None = None
        # Under a step-time budget: the rows planned so far this step, its decodes first;
        # every prefill row is capped against them as it is planned. None: no step-time
        # budget, or no decode that a prefill could stall.
        self._timed_rows: list[Row] | None = None
        self._prefill_planned = False

    def start_step(self, running: list[Sequence], waiting: deque[Sequence],
                   step_budget: StepTimeBudget | None) -> None:
        if self.band_limit is not None:
            self.band_limit.start_step(running, waiting)
        self._step_budget = step_budget
        self._timed_rows = _decode_rows(running) if step_budget is not None else None
        self._prefill_planned = False

    def cap(self, seq: Sequence, num_new: int, context: int) -> int:
        """The tokens (<= num_new) of `seq`'s prompt chunk at `context` tokens of context
        that this step may take; 0: none. The step's first prefill beside decodes always
        advances by MIN_PREFILL_TOKENS at least, unless the worse bands' share is spent."""
        if self.band_limit is not None:
            num_new = self.band_limit.allowed(seq, num_new)
        if num_new <= 1 or self._timed_rows is None:
            return num_new
        assert self._step_budget is not None
        floor = 0 if self._prefill_planned else MIN_PREFILL_TOKENS
        n = self._step_budget.prefill_tokens(self._timed_rows, context, num_new, floor)
        if n:
            self._timed_rows.append((n, context, True))
            self._prefill_planned = True
        return n

    def planned(self, seq: Sequence, num_new: int) -> None:
        """`seq`'s row of `num_new` tokens went into the plan (before the step computes it).
        Prompt work: a row of a sequence with more than one token left to compute, however
        few `cap` let it take; a decode, or a prompt's very last token alone, is not counted."""
        if self.band_limit is not None and len(seq.token_ids) - seq.num_computed_tokens > 1:
            self.band_limit.spend(seq, num_new)


def _decode_rows(running: list[Sequence]) -> list[Row] | None:
    """The running decodes as cost rows (new tokens, context, samples), or None if none."""
    rows = [(1, s.num_computed_tokens, True) for s in running if len(s.token_ids) - s.num_computed_tokens == 1]
    return rows or None
