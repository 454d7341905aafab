"""Fitting a device profile's free parameters to measured step times.

The free parameters are the ones a spec sheet does not give: the efficiencies (GEMM
FLOPs, attention FLOPs, bandwidth), the four host overheads (per step, per sequence, per
token, per prompt-chunk sequence beyond the per-sequence one) and what a decode step
right after a prompt chunk pays to refill the caches. The peaks stay as given
(spec sheet, or measured on the machine), so a fitted efficiency reads as "the share of
the peak this engine reaches". The fit minimises relative errors (a 2 ms decode step
and a 200 ms prefill count alike) through the cost model's own `predict`, so the fitted
profile is exactly what the simulator will use. The roofline's max() makes the problem
piecewise smooth: several starting points, the best kept. numpy only (no scipy).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from worker.costs.cost_model import StepFeatures, predict
from worker.costs.profiles import DeviceProfile


@dataclass(frozen=True)
class FitReport:
    num_points: int
    mean_rel_error: float
    max_rel_error: float
    rel_errors: tuple[float, ...]  # per point, signed: (predicted - measured) / measured

    def to_dict(self) -> dict[str, float]:
        return {"num_points": self.num_points, "mean_rel_error": self.mean_rel_error,
                "max_rel_error": self.max_rel_error}


# x = [s/FLOP of the GEMMs, s/byte, step s, per-seq s, per-token s, s/FLOP of attention, per-prompt-seq s,
#      after-prompt s]
_ATTENTION = np.array([False, False, True, True])  # aligned with cost_model.COMPONENTS


def _with(base: DeviceProfile, x: np.ndarray, fit_attention: bool) -> DeviceProfile:
    """x -> the profile it describes (attention's own efficiency only when fitted)."""
    attention = float(min(1.0, 1.0 / (x[5] * base.peak_flops))) if fit_attention else None
    return replace(base, flops_efficiency=float(min(1.0, 1.0 / (x[0] * base.peak_flops))),
                   bandwidth_efficiency=float(min(1.0, 1.0 / (x[1] * base.hbm_bandwidth))),
                   step_overhead_s=float(x[2]), per_seq_overhead_s=float(x[3]), per_token_overhead_s=float(x[4]),
                   attention_flops_efficiency=attention, per_prompt_seq_overhead_s=float(x[6]),
                   after_prompt_overhead_s=float(x[7]))


def relative_errors(profile: DeviceProfile, points: Sequence[tuple[StepFeatures, float]]) -> np.ndarray:
    return np.array([(predict(f, profile) - t) / t for f, t in points])


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms  # scale-free columns; x >= 0 is unchanged by a positive scaling
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    for _ in range(10 * n):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            blocked = passive & (z <= tol)
            step = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + step * (z - x)
            passive &= x > tol
    return x / norms


def _arrays(points: Sequence[tuple[StepFeatures, float]]) -> tuple[np.ndarray, ...]:
    flops = np.array([f.flops for f, _ in points], dtype=float)  # (points, components)
    nbytes = np.array([f.bytes for f, _ in points], dtype=float)
    counts = np.array([[1.0, f.num_seqs, f.num_tokens] for f, _ in points])
    prompt_seqs = np.array([f.num_prompt_seqs for f, _ in points], dtype=float)
    after_prompt = np.array([f.follows_prompt and not f.num_prompt_seqs for f, _ in points], dtype=float)
    times = np.array([t for _, t in points], dtype=float)
    return flops, nbytes, counts, prompt_seqs, after_prompt, times


def fit_profile(
    base: DeviceProfile, points: Sequence[tuple[StepFeatures, float]], fit_per_token: bool = True,
    fit_per_prompt_seq: bool = True,
) -> tuple[DeviceProfile, FitReport]:
    """`base`'s peaks with the efficiencies and overheads that best explain `points`
    (features of a step, its measured seconds). `fit_per_token=False` keeps the
    per-token overhead at 0 (a GPU, where host work does not grow with tokens), and
    `fit_per_prompt_seq=False` the per-prompt-sequence one (a backend that attends prompt
    rows and decode rows alike). That one is fitted only when some points carry prompt
    rows and some do not (else it is the step overhead under another name); the
    after-prompt overhead likewise only when some decode-only points follow a prompt
    step and some do not. Attention gets its own efficiency when the points compute attention at all.

    With each component's regime fixed (compute- or memory-bound), the predicted time is
    linear in x = [s/FLOP, s/byte, overheads, attention s/FLOP]: a bounded linear least
    squares (NNLS on x - its lower bound, the peaks). So: fix the regimes from the current
    x, solve, repeat until they settle; from several starting efficiencies; keep the best."""
    if len(points) < 8:
        raise ValueError(f"a fit of up to 8 parameters needs at least 8 measured steps, got {len(points)}")
    flops, nbytes, counts, prompt_seqs, after_prompt, times = _arrays(points)
    if (times <= 0).any():
        raise ValueError("measured step times must be > 0")
    fit_attention = bool(flops[:, _ATTENTION].any())
    fit_prompt = fit_per_prompt_seq and bool(prompt_seqs.any()) and not prompt_seqs.all()
    # Only from decode steps both after a prompt and not (else it is another overhead's share).
    fit_after_prompt = bool(after_prompt.any()) and bool(((prompt_seqs == 0) & (after_prompt == 0)).any())
    lower = np.array([1.0 / base.peak_flops, 1.0 / base.hbm_bandwidth, 0.0, 0.0, 0.0, 1.0 / base.peak_flops, 0.0, 0.0])
    used = np.array([True, True, True, True, fit_per_token, fit_attention, fit_prompt, fit_after_prompt])
    best_x, best_cost = None, np.inf
    for eff_flops in (0.02, 0.2, 0.9):
        for eff_bw in (0.02, 0.2, 0.9):
            for eff_attention in ((0.02, 0.2, 0.9) if fit_attention else (eff_flops,)):
                x = np.array([lower[0] / eff_flops, lower[1] / eff_bw, 0.0, 0.0, 0.0, lower[5] / eff_attention, 0.0, 0.0])
                seen: set[bytes] = set()
                for _ in range(50):
                    per_flop = np.where(_ATTENTION, x[5] if fit_attention else x[0], x[0])
                    compute_bound = flops * per_flop >= nbytes * x[1]
                    key = compute_bound.tobytes()
                    if key in seen:
                        break
                    seen.add(key)
                    gemm = compute_bound & ~_ATTENTION if fit_attention else compute_bound
                    attention = compute_bound & _ATTENTION
                    design = np.column_stack([(flops * gemm).sum(1), (nbytes * ~compute_bound).sum(1), counts,
                                              (flops * attention).sum(1), prompt_seqs, after_prompt])[:, used]
                    weighted = design / times[:, None]  # relative errors
                    y = nnls(weighted, 1.0 - weighted @ lower[used])
                    x = lower.copy()
                    x[used] += y
                    cost = float(np.sum(relative_errors(_with(base, x, fit_attention), points) ** 2))
                    if cost < best_cost:
                        best_x, best_cost = x, cost
    assert best_x is not None
    profile = _with(base, best_x, fit_attention)
    errors = relative_errors(profile, points)
    report = FitReport(len(points), float(np.abs(errors).mean()), float(np.abs(errors).max()),
                       tuple(float(e) for e in errors))
    return profile, report
