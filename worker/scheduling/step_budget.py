"""A step-time budget: an ITL target for steps that mix prefill with decodes.

Chunked prefill (Sarathi-Serve) lets a long prompt join the running decode batch a chunk at
a time, so decodes never stall for a whole prompt. But a chunk's cost grows with its
context: a full-size chunk deep into a long prompt, beside a large batch of long decodes,
makes a step several times as long as a decode step, and every decoding request waits
that long for its next token. A smaller max_num_batched_tokens bounds that step but costs
prefill throughput (TTFT) wherever steps are cheap: a token count cannot tell a chunk at a
short context from one at a long context. A budget in time can, so it adapts per step:

    a step that carries decodes gives each prefill row in turn (a running chunk, then
    admitted prompts) at most the n tokens such that
        predicted(decode rows + earlier prefill rows + (n, its context)) <= max_step_time_s
    (binary search; the step's first prefill never below MIN_PREFILL_TOKENS, so a prompt
    always advances); a step without decodes keeps the whole max_num_batched_tokens (no
    token waits on it).

The prediction is a step-cost model (worker/costs/cost_model.py: the model's shape on a device
profile). The simulated device's is exact. On a real device the profile's level may be off
(spec-sheet profiles are uncalibrated): `observe` keeps a running ratio of measured to
predicted forward time and scales predictions by it, so the budget holds in measured time.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from worker.costs.cost_model import StepCostModel
from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape

if TYPE_CHECKING:
    from worker.config import EngineConfig
    from worker.scheduling.scheduler import SchedulerOutput

Row = tuple[int, int, bool]  # (new tokens, context tokens, samples): the cost model's row


class StepPredictor(Protocol):
    """A step-time prediction (worker/costs/cost_model.py's StepCostModel is one)."""

    def predict_rows(self, rows: list[Row]) -> float: ...

    def predict_beside(self, planned: list[Row]) -> Callable[[Row], float]:
        """predict_rows(planned + [row]) as a function of `row`: the search prices several
        candidate chunks beside the same decodes, which a cost model sums once."""
        ...

MIN_PREFILL_TOKENS = 64  # a prompt always advances: the budget never starves it below this a step
_SEARCH_STEP = 16  # tokens: the binary search stops within this of the largest n that fits
_RATIO_WEIGHT = 0.05  # the running ratio's weight for each new measurement (~20-step memory)


class StepTimeBudget:
    def __init__(self, predictor: StepPredictor, max_step_time_s: float, corrected: bool = False) -> None:
        if max_step_time_s <= 0:
            raise ValueError(f"max_step_time_s must be > 0, got {max_step_time_s}")
        self.predictor = predictor
        self.max_step_time_s = max_step_time_s
        self.corrected = corrected  # measured steps correct the prediction (observe_plan): a real device
        self.ratio = 1.0  # measured / predicted forward time (observe)
        self.num_capped = 0  # prefill rows the budget cut below what the token budget allowed
        self._carried_s = 0.0  # predictions of steps whose time a later reading carries

    def prefill_tokens(self, planned: list[Row], context: int, limit: int, floor: int = MIN_PREFILL_TOKENS) -> int:
        """The most prefill tokens (<= limit) one more row at `context` tokens of context may
        take beside the rows `planned` so far this step (decodes first, then earlier prefill
        rows). `floor`: what it gets even over the target (MIN_PREFILL_TOKENS for a step's
        first prefill, so a prompt always advances; 0 for the ones after it)."""
        floor = min(floor, limit)
        target = self.max_step_time_s / self.ratio
        with_row = self.predictor.predict_beside(planned)
        if with_row((limit, context, True)) <= target:
            return limit
        self.num_capped += 1
        if floor == 0 and with_row((1, context, True)) > target:
            return 0
        lo, hi = max(floor, 1), limit  # fits(lo) holds or is the floor; fits(hi) is false
        while hi - lo > _SEARCH_STEP:
            mid = (lo + hi) // 2
            if with_row((mid, context, True)) <= target:
                lo = mid
            else:
                hi = mid
        return lo

    def observe_plan(self, plan: SchedulerOutput, token_ids: list, measured_s: float) -> None:
        """A step the engine ran; its rows' contexts as they were when it was planned."""
        back = plan.advanced
        drafts = plan.draft_token_ids  # a verify row (serial loop, never advanced) has logits at each token
        self.observe([(n, seq.num_computed_tokens - (n if back else 0),
                       n if drafts and seq.request_id in drafts else t is not None)
                      for seq, n, t in zip(plan.seqs, plan.num_new_tokens, token_ids)], measured_s)

    def observe(self, rows: Sequence[Row], measured_s: float) -> None:
        """A real step's measured forward time against the prediction for its rows. A CUDA
        step that samples nothing may read 0 and carry its time into the next reading
        (worker/runner/forward_timer.py): its prediction is carried with it. The measure is the
        forward's, not the host's, so the target holds device time per step."""
        predicted = self.predictor.predict_rows(list(rows)) + self._carried_s
        if measured_s <= 0:
            self._carried_s = predicted
            return
        self._carried_s = 0.0
        if predicted > 0:
            self.ratio += _RATIO_WEIGHT * (measured_s / predicted - self.ratio)


# ModelConfig.dtype -> bytes per weight; "auto" (absent) takes the model's config.json torch_dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def profile_predictor(config: EngineConfig) -> StepPredictor | None:
    """The prediction for a real device under a step-time budget (None without one): the
    model directory's shape on engine.step_time_profile (h200, h100, a100-80gb, l4, or a
    `kvserve calibrate` JSON). build_engine calls it before any weights load, so a
    missing or unknown profile fails first."""
    if config.scheduler.max_step_time_s is None:
        return None
    if config.model.step_time_profile is None:
        raise ValueError("max_step_time_s on a real device needs engine.step_time_profile: a device "
                         "profile (h200, h100, a100-80gb, l4) or a `kvserve calibrate` JSON")
    shape = load_shape(config.model.model, dtype_bytes=DTYPE_BYTES.get(config.model.dtype))
    return StepCostModel(shape, load_profile(config.model.step_time_profile))


def engine_step_budget(max_step_time_s: float | None, runner: object,
                       predictor: StepPredictor | None) -> StepTimeBudget | None:
    """The engine's budget: `predictor` (a real device's profile, corrected by measured
    steps), else the runner's own exact one (a simulated device's `step_predictor`)."""
    if max_step_time_s is None:
        return None
    if predictor is not None:
        return StepTimeBudget(predictor, max_step_time_s, corrected=True)
    exact: StepPredictor | None = getattr(runner, "step_predictor", None)
    if exact is None:
        raise ValueError("max_step_time_s needs a step-time prediction: a device profile "
                         "(engine.step_time_profile) on a real device")
    return StepTimeBudget(exact, max_step_time_s)
