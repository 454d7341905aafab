"""When speculative decoding pays, priced by the step-cost model: a decode step of `batch`
rows at context c against a verify step whose rows carry k drafts each.

    expected tokens per verify row   E(k, a) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)
        (a: the chance each draft is accepted given those before it were; the row always
        yields one token of the target's own, so E >= 1, and E = k + 1 at a = 1)
    plain step                       rows (1, c, 1 logits row)       -> batch tokens
    verify step                      rows (1 + k, c, 1 + k logits rows) -> batch * E tokens
    gain(k) = (batch * E / t_verify) / (batch / t_plain) = E * t_plain / t_verify

A gain above 1 means more tokens per second (and a shorter inter-token latency) with
speculation. The weights are read once per step either way, so at small batches t_verify
is close to t_plain and the gain approaches E; as the batch grows the step becomes
compute-bound, t_verify grows with the 1 + k tokens per row, and the gain falls below 1.
The simulator runs the same verify rows on its device (worker/sim/spec.py) with a
workload's acceptance rate, so a capacity plan sees the same trade.
"""
from __future__ import annotations

from worker.costs.cost_model import StepCostModel


def expected_tokens_per_row(acceptance: float, num_tokens: int) -> float:
    """E(k, a): tokens a verify row with k drafts yields on average."""
    if not 0.0 <= acceptance <= 1.0 or num_tokens < 0:
        raise ValueError(f"need 0 <= acceptance <= 1 and num_tokens >= 0, got {acceptance}, {num_tokens}")
    return float(sum(acceptance ** i for i in range(num_tokens + 1)))


def step_times(model: StepCostModel, batch: int, context: int, num_tokens: int) -> tuple[float, float]:
    """(plain decode step, verify step with `num_tokens` drafts a row), in seconds."""
    plain = model.predict_rows([(1, context, 1)] * batch)
    verify = model.predict_rows([(1 + num_tokens, context, 1 + num_tokens)] * batch)
    return plain, verify


def speculation_gain(model: StepCostModel, batch: int, context: int, num_tokens: int, acceptance: float) -> float:
    """Tokens per second with speculation over without (the module docstring's gain)."""
    plain, verify = step_times(model, batch, context, num_tokens)
    return expected_tokens_per_row(acceptance, num_tokens) * plain / verify


def best_num_tokens(model: StepCostModel, batch: int, context: int, acceptance: float,
                    max_tokens: int = 16) -> tuple[int, float]:
    """The draft count (0: do not speculate) with the highest gain, and that gain."""
    best = (0, 1.0)
    for k in range(1, max_tokens + 1):
        gain = speculation_gain(model, batch, context, k, acceptance)
        if gain > best[1]:
            best = (k, gain)
    return best
