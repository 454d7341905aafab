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
    """The real steps of one run, and where each request joined and got its first token;
    `cost` prices the steps when the run is over (the pair's profile, fitted by a
    calibration measured beside the run)."""

    cost: Any  # StepCostModel
    # (step s, execute s, the plan's (new tokens, context, samples) rows, has a prefill
    # chunk, after a gap)
    rows: list[tuple[float, float, Any, bool, bool]] = field(default_factory=list)
    added: dict[str, int] = field(default_factory=dict)  # request id -> index of the first row after it joined
    first: dict[str, int] = field(default_factory=dict)  # request id -> index of the row of its first token


@contextmanager
def step_check(engine: Any, cost: Any, log: Log) -> Iterator[StepRecord]:  # worker.engine.core.Engine, StepCostModel
    """Times each engine.step() and its runner.execute(plan) while the block runs, then logs
    them against the prediction for each plan's features (read before execute: the plan's
    sequences still hold this step's starting positions), by the `cost` the record holds
    at the block's end."""
    runner, real_execute, real_step, real_add = engine.runner, engine.runner.execute, engine.step, engine.add_request
    record = StepRecord(cost)
    current: dict[str, Any] = {}
    clock = CLOCKS[ENGINE_CLOCK]
    ended = [time.perf_counter()]  # wall time at the end of the last step

    def execute(plan: Any) -> Any:
        current["prefill"] = any(n > 1 for n in plan.num_new_tokens)
        current["rows"] = [(n, seq.num_computed_tokens, seq.num_computed_tokens + n == seq.num_tokens)
                           for seq, n in zip(plan.seqs, plan.num_new_tokens)]
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
            for o in out:
                if o.new_token_ids and o.request_id not in record.first:
                    record.first[o.request_id] = len(record.rows)
            record.rows.append((clock() - t0, current["execute"], current["rows"], current["prefill"],
                                gap > GAP_S))
        return out

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> Any:
        record.added[request_id] = len(record.rows)
        return real_add(request_id, *args, **kwargs)

    runner.execute, engine.step, engine.add_request = execute, step, add_request
    try:
        yield record
    finally:
        runner.execute, engine.step, engine.add_request = real_execute, real_step, real_add
        # Priced once the pair's profile is known, each step after its predecessor's kind.
        after = [False] + [r[3] for r in record.rows[:-1]]
        rows = [(t, e, record.cost.predict(record.cost.rows_features(r, a)), p, g)
                for (t, e, r, p, g), a in zip(record.rows, after)]
        log_steps(rows, log)
        log_ttft_windows(rows, record.added, record.first, log)


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


def log_ttft_windows(rows: list[tuple[float, float, float, bool, bool]], added: dict[str, int],
                     first: dict[str, int], log: Log) -> None:
    """Each request's TTFT window (the steps from the one after it joined to the one that
    gave its first token), real against predicted, and where the difference lies: by the
    kind of step and the step before it."""
    real = np.array([r[0] for r in rows])
    pred = np.array([r[2] for r in rows])
    prefill = np.array([r[3] for r in rows], dtype=bool)
    after_gap = np.array([r[4] for r in rows], dtype=bool)
    after_chunk = np.concatenate([[False], prefill[:-1]])
    kinds = {
        "prefill after decodes": prefill & ~after_chunk,
        "prefill after prefill": prefill & after_chunk,
        "decodes after prefill": ~prefill & after_chunk,
        "decodes after decodes": ~prefill & ~after_chunk,
    }
    excess = {k: 0.0 for k in kinds}
    last = {k: 0.0 for k in kinds}
    ratios, gaps, n = [], 0.0, 0
    for request_id, a in added.items():
        f = first.get(request_id)
        if f is None or f < a:
            continue
        window = slice(a, f + 1)
        ratios.append(real[window].sum() / pred[window].sum())
        gaps += float((real[window] - pred[window])[after_gap[window]].sum())
        for k, mask in kinds.items():
            excess[k] += float((real[window] - pred[window])[mask[window]].sum())
        for k, mask in kinds.items():
            if mask[f]:
                last[k] += 1
        n += 1
    if not n:
        return
    log(f"    TTFT windows ({n} requests): real/predicted median {np.median(ratios):.3f}, "
        f"mean window {1e3 * float(np.mean([real[a:first[r] + 1].sum() for r, a in added.items() if r in first])):.2f} ms; "
        f"excess per request by step kind (ms): "
        + ", ".join(f"{k} {1e3 * v / n:+.2f}" for k, v in excess.items())
        + f"; of it after gaps {1e3 * gaps / n:+.2f}; first-token steps: "
        + ", ".join(f"{k} {int(v)}" for k, v in last.items()))


def main() -> int:
    errors = validate_engine(True, None, lambda line: print(line, flush=True), step_check)
    print(f"RESULT ttft_p50_error_pct={errors['ttft_p50_s']:.1f} ttft_p99_error_pct={errors['ttft_p99_s']:.1f} "
          f"tokens_per_s_error_pct={errors['output_tokens_per_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
