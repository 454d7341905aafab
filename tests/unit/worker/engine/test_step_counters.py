"""The engine's running totals (worker/engine/step_meters.py StepCounters), on a clock the test sets."""
from __future__ import annotations

import pytest

from worker.engine import step_meters
from worker.engine.step_meters import RATE_WINDOW_S, StepCounters


def test_totals_shares_and_the_rate_window(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(step_meters.time, "monotonic", lambda: now[0])
    counters = StepCounters()
    assert (counters.tokens_per_s, counters.forward_share, counters.scheduler_share) == (0.0, 0.0, 0.0)
    for tokens in (8, 4, 4):  # one step a second
        counters.account(tokens, step_s=0.5, forward_s=0.4)
        now[0] += 1.0
    assert (counters.num_steps, counters.num_generated_tokens) == (3, 16)
    assert counters.forward_share == pytest.approx(0.8)
    # The window's first step opens it: 4 + 4 tokens over the 2 s since.
    assert counters.tokens_per_s == pytest.approx(4.0)
    now[0] += RATE_WINDOW_S
    counters.account(6, step_s=0.5, forward_s=0.4)  # the older steps leave the window
    assert counters.tokens_per_s == 0.0  # one step in the window: no span yet
    assert counters.timed(lambda a, b: a + b, 2, 3) == 5
    assert 0.0 < counters.schedule_time_s and counters.scheduler_share < 1.0
