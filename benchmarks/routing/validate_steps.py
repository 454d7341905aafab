"""Validation 1 (benchmarks/routing/validate.py: the real engine against the simulator on
the CPU) with each real step set against the calibrated cost model's prediction for the
same plan. It tells the two causes of a TTFT error apart: a cost model that mispredicts
some kind of step (one kind's ratio off in every pair), or a machine whose speed moved
between a pair's calibration and its run (every kind's ratio off together, by a different
amount in each pair).

    python -m benchmarks.routing.validate_steps

Per pair, per kind of step (with a prefill chunk / decodes only): steps, median time (on
the validation's clock, validate.ENGINE_CLOCK) of engine.step() and of the runner's execute, the median prediction, and the ratios of
their sums to the predictions' sum. The timing hooks cost a few µs a step; the table's
validation runs without them.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.routing.engine_grid import ENGINE_CLOCK
from benchmarks.routing.validate import Log, validate_engine
from cluster.calibrate import CLOCKS

KINDS = (("with a prefill chunk", True), ("decodes only", False))
GAP_S = 2e-3  # wall time between two steps beyond the loop's own (adding requests): something else ran


@dataclass
class StepRecord:
    """The real steps of one run: (step s, execute s, the plan's features, has a prefill
    chunk) each; `cost` prices them when the run is over (the pair's profile, fitted by a
    calibration measured beside the run)."""

    cost: Any  # StepCostModel
    rows: list[tuple[float, float, Any, bool, bool]] = field(default_factory=list)  # + after a gap


@contextmanager
def step_check(engine: Any, cost: Any, log: Log) -> Iterator[StepRecord]:  # worker.engine.Engine, StepCostModel
    """Times each engine.step() and its runner.execute(plan) while the block runs, then logs
    them against the prediction for each plan's features (read before execute: the plan's
    sequences still hold this step's starting positions), by the `cost` the record holds
    at the block's end."""
    runner, real_execute, real_step = engine.runner, engine.runner.execute, engine.step
    record = StepRecord(cost)
    current: dict[str, Any] = {}
    clock = CLOCKS[ENGINE_CLOCK]
    ended = [time.perf_counter()]  # wall time at the end of the last step

    def execute(plan: Any) -> Any:
        current["features"] = cost.plan_features(plan)
        current["prefill"] = any(n > 1 for n in plan.num_new_tokens)
        t0 = clock()
        out = real_execute(plan)
        current["execute"] = clock() - t0
        return out

    def step() -> Any:
        current.clear()
        gap = time.perf_counter() - ended[0]
        t0 = clock()
        out = real_step()
        ended[0] = time.perf_counter()
        if current:  # a step that ran the model
            record.rows.append((clock() - t0, current["execute"], current["features"], current["prefill"],
                                gap > GAP_S))
        return out

    runner.execute, engine.step = execute, step
    try:
        yield record
    finally:
        runner.execute, engine.step = real_execute, real_step
        log_steps([(t, e, record.cost.predict(f), p, g) for t, e, f, p, g in record.rows], log)


def log_steps(rows: list[tuple[float, float, float, bool, bool]], log: Log) -> None:
    """Each kind's steps against their predictions; then decode-only steps by the step
    before them, and the steps that followed a gap in the loop against the rest."""
    table = np.array([r[:3] for r in rows]).reshape(-1, 3)
    prefill = np.array([r[3] for r in rows], dtype=bool)
    after_gap = np.array([r[4] for r in rows], dtype=bool)
    for name, kind in KINDS:
        t = table[prefill == kind]
        if not len(t):
            continue
        log(f"    steps {name}: {len(t)}, median step {1e3 * np.median(t[:, 0]):.2f} ms, execute "
            f"{1e3 * np.median(t[:, 1]):.2f} ms, predicted {1e3 * np.median(t[:, 2]):.2f} ms; sums: step/predicted "
            f"{t[:, 0].sum() / t[:, 2].sum():.3f}, execute/predicted {t[:, 1].sum() / t[:, 2].sum():.3f}")
    # Decode-only steps by the step before them: a live engine's decode steps mostly follow
    # decode steps; a calibration point's first ones follow its batch's prefill.
    after_chunk = np.concatenate([[False], prefill[:-1]]) & ~prefill
    parts = [(name, table[mask]) for name, mask in (("after a step with a prefill chunk", after_chunk),
                                                      ("after a decode-only step", ~prefill & ~after_chunk))]
    log("    decodes only, " + "; ".join(f"{name}: {len(t)}, step/predicted {t[:, 0].sum() / t[:, 2].sum():.3f}"
                                        for name, t in parts if len(t)))
    # A step after a gap of wall time in the loop: a calibration plan ran between it and the
    # step before (calibrate_beside), or the machine took the core away.
    parts = [(name, table[mask]) for name, mask in ((f"after a gap of over {GAP_S * 1e3:g} ms", after_gap),
                                                      ("the rest", ~after_gap))]
    log("    all steps, " + "; ".join(f"{name}: {len(t)}, step/predicted {t[:, 0].sum() / t[:, 2].sum():.3f}"
                                     for name, t in parts if len(t)))


def main() -> int:
    errors = validate_engine(True, None, lambda line: print(line, flush=True), step_check)
    print(f"RESULT ttft_p50_error_pct={errors['ttft_p50_s']:.1f} ttft_p99_error_pct={errors['ttft_p99_s']:.1f} "
          f"tokens_per_s_error_pct={errors['output_tokens_per_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
