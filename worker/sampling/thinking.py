"""A request's thinking budget as the engine enforces it (SamplingParams.thinking): count
the tokens produced inside the reasoning section and, once the budget is spent, force the
section's end marker token by token; the answer then continues unconstrained.

Phases of one request's `ThinkingState`:

    before   not in the section yet: an output that opens with the start marker enters
             it (the think parser, router/frontend/reasoning/think.py, reads a section
             only at the output's start)
    inside   each token counts against the budget; the end marker produced by the model
             ends the section (done)
    forcing  the budget is spent: the next tokens are the end marker's, one a step
    done     the section is over (or never opened): no constraint

Invariants: `spent` <= budget.max_tokens; in `forcing`, `pos` indexes the end marker's
next token; the state advances exactly once per appended output token
(worker/scheduling/stop_check.py), so it describes token_ids as they stand. The sampler
(worker/sampling/sampler.py) reads `forced_token` for every row of a step and applies the
forced rows in one masked fill for the batch.
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceT

from worker.sampling_params import ThinkingBudget

BEFORE, INSIDE, FORCING, DONE = "before", "inside", "forcing", "done"


class ThinkingState:
    __slots__ = ("budget", "phase", "spent", "pos")

    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self.phase = BEFORE
        self.spent = 0
        self.pos = 0
        if budget.starts_inside:
            self._enter()

    @classmethod
    def replayed(cls, budget: ThinkingBudget, output: SequenceT[int]) -> ThinkingState:
        """The state after `output` (a migrated request's tokens produced before it moved)."""
        state, tokens = cls(budget), []
        for token_id in output:
            tokens.append(token_id)
            state.advance(tokens, 0)
        return state

    def _enter(self) -> None:
        self.phase = INSIDE
        if self.spent >= self.budget.max_tokens:
            self.phase, self.pos = FORCING, 0

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """The request's tokens (prompt, then output) just grew by one output token. Reads
        at most a marker's length of their tail."""
        phase = self.phase
        if phase == DONE:
            return
        if phase == BEFORE:
            start = self.budget.start_token_ids
            num_output = len(token_ids) - num_prompt_tokens
            if num_output == len(start) and tuple(token_ids[num_prompt_tokens:]) == start:
                self._enter()
            elif num_output >= len(start):  # the output opened with something else
                self.phase = DONE
            return
        if phase == FORCING:
            self.pos += 1
            if self.pos == len(self.budget.end_token_ids):
                self.phase = DONE
            return
        end = self.budget.end_token_ids
        if len(token_ids) - num_prompt_tokens >= len(end) and tuple(token_ids[-len(end):]) == end:
            self.phase = DONE
            return
        self.spent += 1
        if self.spent >= self.budget.max_tokens:
            self.phase, self.pos = FORCING, 0

    def forced_token(self) -> int | None:
        """The token the next step must produce, or None for a free choice."""
        return self.budget.end_token_ids[self.pos] if self.phase == FORCING else None

    def may_force_next(self) -> bool:
        """Could the step after the next token be forced? A step launched before that token
        is known (worker/scheduling/async_scheduler.py's launch ahead) must not carry a row
        for which this holds: its forced token depends on the token not yet seen."""
        if self.phase == FORCING:
            return True
        if self.phase == INSIDE:
            return self.spent + 1 >= self.budget.max_tokens
        return self.phase == BEFORE and self.budget.max_tokens == 0
