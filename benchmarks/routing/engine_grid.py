"""Validation 1's calibration grid (benchmarks/routing/validate.py): the plans where the
workload's steps run, when in a run they are measured, and the profile that sets the
workload's rate. The engine's thread count and clock are shared by both sides of a pair.
"""
from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence

from cluster.workload.sim_kinds import SimRequest

Log = Callable[[str], None]

ENGINE_NUM_THREADS = 1  # torch threads: the engine here and the calibration that priced it
# Calibration's grid here: the regime this workload runs in (workload_grid), a few seconds
# instead of the full grid's, whose largest decode point alone prefills 32 prompts of 1,024
# tokens. A fit is only as good as its points near the steps it prices: with the full
# grid's few mixed points, all beside large decode batches, the fit under-priced the steps
# that carry a fresh prompt beside a half-loaded engine's few decodes, and those are the
# steps every TTFT ends with.
ENGINE_DECODE_BATCHES = (1, 2, 4, 8, 16)
ENGINE_DECODE_CONTEXTS = (16, 128, 512)
# Prefill chunks whose contexts (up to 3 chunks before the last) span the workload's
# sequences, not beyond: points far outside the run's regime pull the fit away from it.
ENGINE_PREFILL_CHUNKS = (32, 128, 256)
ENGINE_MIXED_BATCHES = (2, 4, 8)  # the decodes beside a fresh prompt, at half load
ENGINE_PROMPT_QUANTILES = (0.25, 0.5, 0.75, 0.9)  # the prompt lengths the mixed points take
ENGINE_GRID_PASSES = 3  # each point's steps taken at this many moments of the run (GridSpec.passes)
# The moments of a run at which calibrate_beside measures grid plans, each a run of plans
# until the grid has caught up with the run. A real step right after grid plans runs with
# the caches they left (slower than its prediction, like a decode right after a prefill),
# so the fewer moments the fewer such steps; enough of them still spread every kind's
# passes over the run's stretch.
ENGINE_GRID_MOMENTS = 8
# The clock of both sides: the calibration's steps and the real run's (cluster/calibrate.py).
ENGINE_CLOCK = "process"


def workload_grid(requests: Sequence[SimRequest], max_num_batched_tokens: int):  # noqa: ANN201 (GridSpec)
    """The calibration plans of validation 1, where the workload's steps run:
    - decode batches of a half-loaded engine at contexts up to the workload's longest
      sequence (prompt + output): the grouped backend pads a batch's decodes to its longest
      member, so while one long request decodes, every step attends at its length;
    - prefill chunks at those contexts;
    - mixed steps (what every TTFT ends with): the workload's own prompt lengths (its
      quantiles, one chunk at most) beside a few decodes at its 90th-percentile sequence
      length (a handful of decodes, padded to their longest, attend at about that)."""
    from cluster.calibrate import GridSpec

    prompts = sorted(len(r.prompt_token_ids) for r in requests)
    sequences = sorted(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    chunks = sorted({min(max_num_batched_tokens, prompts[round(q * (len(prompts) - 1))])
                     for q in ENGINE_PROMPT_QUANTILES})
    context = sequences[round(0.9 * (len(sequences) - 1))]
    return GridSpec(decode_batches=ENGINE_DECODE_BATCHES,
                    decode_contexts=tuple(sorted({*ENGINE_DECODE_CONTEXTS, sequences[-1]})),
                    prefill_chunks=tuple(sorted({min(max_num_batched_tokens, c) for c in ENGINE_PREFILL_CHUNKS})),
                    mixed=tuple((c, b, context) for c in chunks for b in ENGINE_MIXED_BATCHES),
                    passes=ENGINE_GRID_PASSES)


def engine_profile(profile_path: str | None, spec, log: Log):  # noqa: ANN001, ANN201 (GridSpec; DeviceProfile)
    """The CPU profile that sets the workload's rate: `profile_path` (which then prices every
    pair too), else a calibration now, with the engine's thread count and clock. Now, not a
    committed fit: a shared machine's speed moves from one hour to the next, and a
    calibrated profile is a statement about the machine as it is."""
    from cluster.calibrate import calibrate
    from worker.costs.profiles import load_profile

    if profile_path:
        profile = load_profile(profile_path)
        log(f"validation 1: CPU profile {profile_path} ({profile.source})")
        return profile
    t0 = time.perf_counter()
    profile, report, points = calibrate(None, "cpu-validation", ENGINE_NUM_THREADS, 16, clock=ENGINE_CLOCK,
                                        spec=spec)
    saved = os.path.join(tempfile.gettempdir(), f"kvserve-cpu-validation-{os.getpid()}.json")
    profile.save(saved)
    log(f"validation 1: calibrated a CPU profile for the workload's rate ({len(points)} engine steps, "
        f"{time.perf_counter() - t0:.0f} s, {ENGINE_NUM_THREADS} thread, saved to {saved}): "
        f"{fit_summary(report)}")
    return profile


def fit_summary(report) -> str:  # noqa: ANN001 (worker.costs.fit.FitReport)
    return f"fit error mean {100 * report.mean_rel_error:.1f}%, max {100 * report.max_rel_error:.1f}%"


def grid_moment(run_progress: float, grid_progress: float) -> bool:
    """Whether calibrate_beside measures grid plans now: the grid lags the run by a moment's share."""
    return run_progress - grid_progress >= 1.0 / ENGINE_GRID_MOMENTS
