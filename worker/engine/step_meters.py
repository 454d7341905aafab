"""What the engine measures of its steps. Its running totals (StepCounters: steps, tokens,
where step time went, tokens per second), and two measurements for its routing-stats
report (worker/serving/routing_report.py): how long outputs turn out to be, and how fast this
device prefills. Torch-free, O(1) per record, no allocation beyond a bounded deque.

    mean_output_tokens = mean num_output_tokens of the last `window` requests that finished
                         normally ("stop" / "length"; aborts and errors say nothing about
                         how long an answer is); 0.0 until one has
    prefill_tokens_per_s = sum(prefill tokens) / sum(device seconds) over the last `window`
                         steps that carried prefill AND filled the token budget; 0.0 until
                         `min_steps` such steps were seen

Why only budget-full steps: a step that carries a few prefill tokens beside a full decode
batch is limited by how little was queued, not by the device; counting it would make a
lightly loaded replica look slow at prefill, and the router would release its prefix
affinity for nothing (router/routing/scoring.py within_target). A full step is what the device does
while it has a backlog, which is exactly the rate the router divides a backlog by.

Why a long window (256 full steps, seconds of a busy device): decode-heavy moments (many
long-context decodes beside each chunk) pull a short window's figure far below the
device's prefill rate, and a router reading those dips releases prefix affinity in bursts,
which costs the TTFT the release is meant to protect. A long window follows the workload,
not its moments.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from worker.sequence import Sequence

T = TypeVar("T")

# The window of StepCounters.tokens_per_s.
RATE_WINDOW_S = 5.0


class StepCounters:
    """The engine's totals since it started, and its recent generation rate."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_generated_tokens = 0
        # Requests handed to the engine, and their prompt tokens: the SLO planner's arrival
        # counts (cluster/planner/), read as differences between reports.
        self.num_arrived = 0
        self.num_arrived_prompt_tokens = 0
        self.step_time_s = 0.0
        self.forward_time_s = 0.0
        self.schedule_time_s = 0.0  # in Scheduler.schedule + Scheduler.update (CPU work)
        self._recent: deque[tuple[float, int]] = deque()  # (time.monotonic(), tokens)
        # The tokens in `_recent`, kept as steps enter and leave: the engine reports its
        # stats every step, and the window holds hundreds of steps.
        self._recent_tokens = 0

    def timed(self, fn: Callable[..., T], *args: object) -> T:
        """Scheduler work, counted in scheduler_share."""
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.schedule_time_s += time.perf_counter() - t

    def account(self, num_tokens: int, step_s: float, forward_s: float) -> None:
        """One step that ran: `num_tokens` generated in `step_s`, `forward_s` of it the model."""
        self.num_steps += 1
        self.num_generated_tokens += num_tokens
        self.step_time_s += step_s
        self.forward_time_s += forward_s
        now = time.monotonic()
        recent = self._recent
        recent.append((now, num_tokens))
        self._recent_tokens += num_tokens
        while now - recent[0][0] > RATE_WINDOW_S:
            self._recent_tokens -= recent.popleft()[1]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S (the first step in the
        window opens it: its tokens came before)."""
        recent = self._recent
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        return (self._recent_tokens - recent[0][1]) / span if span > 0 else 0.0

    @property
    def forward_share(self) -> float:
        return self.forward_time_s / self.step_time_s if self.step_time_s else 0.0

    @property
    def scheduler_share(self) -> float:
        return self.schedule_time_s / self.step_time_s if self.step_time_s else 0.0


# Finish reasons that tell how long an answer runs (not "abort" / "error").
NORMAL_FINISH_REASONS = frozenset({"stop", "length"})


class OutputLengthTracker:
    """Mean output length of the last `window` normal finishes (running sum: O(1) each)."""

    def __init__(self, window: int = 256) -> None:
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        self._lengths: deque[int] = deque(maxlen=window)
        self._sum = 0

    def record(self, num_output_tokens: int) -> None:
        if len(self._lengths) == self._lengths.maxlen:
            self._sum -= self._lengths[0]  # about to fall out of the window
        self._lengths.append(num_output_tokens)
        self._sum += num_output_tokens

    def observe(self, seq: Sequence) -> None:
        """A finished sequence (the engine passes each as its last output is built): its
        length counts when it finished normally."""
        if seq.finish_reason in NORMAL_FINISH_REASONS:
            self.record(seq.num_output_tokens)

    @property
    def count(self) -> int:
        return len(self._lengths)

    @property
    def mean(self) -> float:
        return self._sum / len(self._lengths) if self._lengths else 0.0


class PrefillRateMeter:
    """Measured prefill throughput in device seconds (see the module docstring).

    `time_dilation`: a simulated device under Serve stretches each step's wall time by it
    (worker/sim/runner.py); dividing it back out keeps the figure in the device's modelled
    time, the time the router's parameters are in (a wall-clock rate would be 20x too low
    at dilation 20). Real runners have none (1)."""

    def __init__(self, token_budget: int, time_dilation: float = 1.0, window: int = 256, min_steps: int = 16) -> None:
        if token_budget <= 0 or time_dilation <= 0 or window <= 0 or not 0 < min_steps <= window:
            raise ValueError("token_budget, time_dilation, window must be > 0 and 0 < min_steps <= window")
        self.token_budget = token_budget
        self.time_dilation = time_dilation
        self.min_steps = min_steps
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)  # (prefill tokens, device s)
        self._tokens = 0
        self._seconds = 0.0

    def record(self, num_new_tokens: list[int], forward_s: float) -> None:
        """One executed step: its plan's tokens per row and its RunnerOutput.forward_s. Two C
        loops over the row list (sum, count), nothing per row in Python."""
        batched = sum(num_new_tokens)
        if batched < self.token_budget or forward_s <= 0:
            return
        # Rows of one token are decodes (a one-token prompt chunk is rare and would only
        # make the figure a token lower).
        prefill = batched - num_new_tokens.count(1)
        if prefill <= 0:
            return
        steps = self._steps
        if len(steps) == steps.maxlen:
            old_tokens, old_s = steps[0]
            self._tokens -= old_tokens
            self._seconds -= old_s
        seconds = forward_s / self.time_dilation
        steps.append((prefill, seconds))
        self._tokens += prefill
        self._seconds += seconds

    @property
    def tokens_per_s(self) -> float:
        if len(self._steps) < self.min_steps or self._seconds <= 0:
            return 0.0
        return self._tokens / self._seconds
