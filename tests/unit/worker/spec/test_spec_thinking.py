"""A row whose thinking budget still counts does not speculate: the budget may force the
end marker at any position, which a verify step would not apply."""
from __future__ import annotations

from worker.sampling.thinking import ThinkingState
from worker.sampling_params import SamplingParams, ThinkingBudget
from worker.sequence import Sequence
from worker.spec.drafts import eligible


def test_only_a_finished_thinking_section_lets_a_row_speculate() -> None:
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0.0))
    assert eligible(seq)
    seq.thinking = ThinkingState(ThinkingBudget(4, start_token_ids=(7,), end_token_ids=(8,), starts_inside=True))
    assert not eligible(seq)
    seq.thinking.phase = "done"
    assert eligible(seq)
