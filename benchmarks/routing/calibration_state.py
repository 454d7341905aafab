"""The calibration's decode points against the same plans run back to back.

    python -m benchmarks.routing.calibration_state

Validation 1's per-step check (validate_steps.py) found the real engine's decode-only steps
running well under the calibrated model's prediction while its steps with a prefill chunk
ran at it. Two causes would read alike: one per-sequence overhead that cannot price a
decode row and a prompt row at once, or decode points measured in a state unlike a live
engine's (the grid prefills a fresh batch before every decode point and times the few
decode steps right after it, between prefill and mixed plans; a live engine runs long
stretches of decode-only steps). This measures the second directly, on validation 1's
grid and clock:
- "grid": each decode point as the calibration measures it, its plans interleaved with
  the grid's prefill and mixed plans (GridSpec.passes, cluster/calibrate.py);
- per plan, one engine run of the same batch decoding WARM_STEPS + STEADY_STEPS steps, and
  in that one run: the mean of the first decode steps after the prefill (as many as a grid
  pass times: what the grid timed before WARMUP_DECODE_STEPS), of the steps a grid pass
  times now (past the warm-up), and of the last STEADY_STEPS (a long decode stretch, as in
  a live run). Ratios within one run see the machine at one moment; the grid's column is
  measured at another, so its ratio also carries the machine's drift.
Then the decode-step time by its index after the prefill, over all plans, relative to the
plan's steady mean; and the mixed points' first step of each pass against their later
ones. Prints RESULT first_over_steady=... warm_over_steady=... grid_over_steady=... (medians
over the plans).
"""
from __future__ import annotations

import math
import statistics
import sys

from benchmarks.routing.engine_grid import ENGINE_CLOCK, ENGINE_NUM_THREADS, workload_grid
from benchmarks.routing.validate import ENGINE_REQUESTS, ENGINE_WORKLOAD
from cluster.calibrate import NUM_DECODE_STEPS, NUM_REPEATS, WARMUP_DECODE_STEPS, start_measurement
from cluster.workload.sim_kinds import make_workload

WARM_STEPS = 12  # decode steps after the prefill before the steady stretch
STEADY_STEPS = 24


def decode_run(grid, batch: int, context: int) -> list[float]:  # noqa: ANN001 (cluster.calibration_grid.Grid)
    """Seconds of each decode step of one batch run long after its prefill."""
    from worker.api import SamplingParams

    engine = grid.engine(batch, max(2048, batch * context))
    params = SamplingParams(max_tokens=WARM_STEPS + STEADY_STEPS + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", grid.prompt(context), params)
    return [t for f, t in grid.steps(engine) if f.num_tokens == batch == f.num_seqs]


def main() -> int:
    kw = {k: v for k, v in ENGINE_WORKLOAD.items() if k != "kind"}
    spec = workload_grid(make_workload(ENGINE_WORKLOAD["kind"], ENGINE_REQUESTS[True], 1.0, 7, **kw), 512)
    measurement = start_measurement(None, ENGINE_NUM_THREADS, 16, ENGINE_CLOCK, spec)
    measurement.finish()
    grid = measurement.grid
    per_pass = math.ceil(NUM_DECODE_STEPS / spec.passes)
    per_mixed = math.ceil(NUM_REPEATS / spec.passes)
    print(f"decode points of validation 1's grid ({spec.passes} passes of {per_pass} steps each, {ENGINE_CLOCK} "
          f"clock) vs the same batch decoding {WARM_STEPS + STEADY_STEPS} steps in one run")
    print(f"{'plan':<22} {'grid ms':>8} {'first ms':>9} {'warm ms':>8} {'steady ms':>10} {'grid/steady':>12} "
          f"{'first/steady':>13} {'warm/steady':>12}")
    grid_ratios, first_ratios, warm_ratios = [], [], []
    by_index: list[list[float]] = [[] for _ in range(WARM_STEPS + STEADY_STEPS)]
    for b in spec.decode_batches:
        for c in spec.decode_contexts:
            label = f"decode b={b} ctx={c}"
            grid_mean = statistics.fmean(t for _, t in grid.samples[label])
            steps = decode_run(grid, b, c)
            first, steady = statistics.fmean(steps[:per_pass]), statistics.fmean(steps[-STEADY_STEPS:])
            warm = statistics.fmean(steps[WARMUP_DECODE_STEPS:WARMUP_DECODE_STEPS + per_pass])
            grid_ratios.append(grid_mean / steady)
            first_ratios.append(first / steady)
            warm_ratios.append(warm / steady)
            for i, t in enumerate(steps):
                by_index[i].append(t / steady)
            print(f"{label:<22} {1e3 * grid_mean:>8.3f} {1e3 * first:>9.3f} {1e3 * warm:>8.3f} {1e3 * steady:>10.3f} "
                  f"{grid_mean / steady:>12.3f} {first / steady:>13.3f} {warm / steady:>12.3f}")
    mixed_ratios = []
    for chunk, b, c in spec.mixed:
        steps = [t for _, t in grid.samples[f"mixed chunk={chunk} + decode b={b} ctx={c}"]]
        first = steps[::per_mixed]  # each pass's first mixed step follows the decodes' prefill
        rest = [t for i, t in enumerate(steps) if i % per_mixed]
        mixed_ratios.append(statistics.fmean(first) / statistics.fmean(rest))
    print(f"mixed points: each pass's first step (right after the decodes' prefill) / its later steps (each after "
          f"a decode step): median {statistics.median(mixed_ratios):.3f} over {len(mixed_ratios)} points "
          f"({min(mixed_ratios):.3f} .. {max(mixed_ratios):.3f})")
    print("decode step time by its index after the prefill, / the plan's steady mean (median over plans): "
          + " ".join(f"{i + 1}:{statistics.median(r):.2f}" for i, r in enumerate(by_index) if r))
    print(f"RESULT first_over_steady={statistics.median(first_ratios):.3f} "
          f"warm_over_steady={statistics.median(warm_ratios):.3f} grid_over_steady={statistics.median(grid_ratios):.3f} "
          f"plans={len(grid_ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
