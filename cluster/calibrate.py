"""`kvserve calibrate`: fit a device profile of this machine from the real engine's steps.

    kvserve calibrate                                   # the embedded model, on this CPU
    kvserve calibrate --model DIR --out my-cpu.json

1. Measures the machine's peaks the way the engine sees them (torch, the engine's threads):
   FP32 matmul FLOP/s and memory copy bandwidth.
2. Runs the real engine (ModelRunner on CPU, the real scheduler) over a grid of plans:
   decode batches (batch sizes x context lengths), chunked prefills (chunk sizes x
   the contexts the chunks of a longer prompt reach), and mixed steps (a fresh prompt's
   chunk joining a running decode batch: what a loaded engine runs whenever a request
   arrives, and what its TTFT is made of). How one point's steps are run and timed (the
   engine loop's turn, warm-up steps, aged KV pools, the mean of its steps):
   cluster/calibration_grid.py. The plans run in turns of decode, prefill and mixed, and a
   caller can run them one at a time (Measurement) and in several passes (GridSpec.passes).
3. Fits the profile's efficiencies and overheads (worker/costs/fit.py), prints the fit
   error (mean and max relative error over the grid), writes the profile JSON.
Prefix caching is off so each plan is exactly what was asked for.

The clock: by default the process's CPU time, with one torch thread. On a machine shared
with other work (a small CI or development machine running several Ray clusters at once)
wall time measures the contention, not the device; CPU time of a single-threaded engine is
what its wall time would be on a core of its own. `--clock wall` for a dedicated machine.
CPU time still moves with other load (cold caches, a shared core); a comparison with a run
measures the grid beside that run (benchmarks/routing/validate.py's calibrate_beside).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# start_measurement reads the per-point step counts through this module's names (tests
# shrink them here); age_pool is re-exported: the benchmarks take it from here.
from cluster.calibration_grid import (  # noqa: F401
    NUM_DECODE_STEPS,
    NUM_REPEATS,
    PREFILL_CHUNKS_PER_PROMPT,
    WARMUP_DECODE_STEPS,
    Grid,
    Point,
    age_pool,
    mean_point,
    measure_peaks,
)
from worker.costs.cost_model import StepCostModel
from worker.costs.fit import FitReport, fit_profile
from worker.costs.profiles import PROFILES_DIR, DeviceProfile

DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (16, 256, 1024)
PREFILL_CHUNKS = (32, 128, 512)
# Mixed steps: (prompt chunk, decode batch, decode context). Pure decode and pure prefill
# points alone fit a profile that prices mixed steps fast, and every TTFT of a loaded
# engine ends with one, so the simulated TTFT would run under the real one.
MIXED = ((32, 4, 128), (128, 16, 128), (512, 4, 128))
CLOCKS = {"process": time.process_time, "wall": time.perf_counter}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("calibrate", help="fit a simulated-device profile of this machine (worker/sim/)")
    parser.add_argument("--model", metavar="DIR", help="model directory (default: the embedded kvserve-tiny)")
    parser.add_argument("--name", default="cpu-calibrated", help="the profile's name")
    parser.add_argument("--out", metavar="FILE", help=f"profile JSON to write (default: {PROFILES_DIR}/<name>.json)")
    parser.add_argument("--num-threads", type=int, default=1, metavar="N", help="torch CPU threads (default 1)")
    parser.add_argument("--clock", choices=CLOCKS, default="process",
                        help="process: the engine's own CPU time (a busy machine does not inflate it; equal to "
                             "wall time on an idle core with one thread); wall: elapsed time")
    parser.add_argument("--block-size", type=int, default=16)
    parser.set_defaults(func=run_calibrate)



@dataclass(frozen=True)
class GridSpec:
    """The plans calibration runs: decode batches x contexts, prefill chunks (each at the
    contexts a prompt of PREFILL_CHUNKS_PER_PROMPT chunks reaches), mixed steps (chunk,
    decode batch, decode context)."""

    decode_batches: tuple[int, ...] = DECODE_BATCHES
    decode_contexts: tuple[int, ...] = DECODE_CONTEXTS
    prefill_chunks: tuple[int, ...] = PREFILL_CHUNKS
    mixed: tuple[tuple[int, int, int], ...] = MIXED
    # Passes over the grid, each with its share of every point's steps (pooled): a point
    # measured in one burst takes the machine's speed of that moment, and on a shared
    # machine the moments of two points differ more than the points do.
    passes: int = 1


class Measurement:
    """A calibration grid under way: `measure_next()` runs one more of its plans (a decode
    point, a chunk size's prefill points, a mixed point), so that a caller can spread the
    grid over the same stretch of time as a run the profile will price (the validation
    interleaves it with the real engine's steps: whatever the machine's load does to the
    process clock in that stretch, it does to both). The plans alternate kinds, so every
    kind is sampled across the whole stretch, and with GridSpec.passes > 1 the grid runs
    that many times, each point's steps pooled over its passes."""

    def __init__(self, grid: Grid, tasks: list[Callable[[], list[Point]]], context: dict[str, Any]) -> None:
        self.grid = grid
        self.tasks = tasks
        self.context = context
        self.num_done = 0

    @property
    def points(self) -> list[Point]:
        """One per point measured so far, each over the steps of all its passes so far."""
        return [mean_point(label, steps) for label, steps in self.grid.samples.items()]

    @property
    def done(self) -> bool:
        return self.num_done == len(self.tasks)

    @property
    def progress(self) -> float:
        return self.num_done / len(self.tasks)

    def measure_next(self) -> None:
        self.tasks[self.num_done]()
        self.num_done += 1

    def finish(self) -> list[Point]:
        while not self.done:
            self.measure_next()
        return self.points


def _one(measure: Callable[..., Point], *args: int) -> list[Point]:
    return [measure(*args)]


def _alternating(*kinds: list[Callable[[], list[Point]]]) -> list[Callable[[], list[Point]]]:
    """One of each kind in turn, then the longer kinds' rest."""
    return [task for group in itertools.zip_longest(*kinds) for task in group if task is not None]


def start_measurement(model: str | None, num_threads: int | None, block_size: int, clock: str,
                      spec: GridSpec | None = None) -> Measurement:
    """Load the model, measure the peaks, warm up; the grid's plans are left to run."""
    import torch

    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.default_model import DEFAULT_MODEL_NAME, default_model_path
    from worker.model_path import resolve_model_path
    from worker.model_config import load_hf_config
    from worker.runner.model_runner import ModelRunner
    from worker.costs.shapes import load_shape

    spec = spec or GridSpec(DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_CHUNKS, MIXED)  # read now: tests shrink the grid
    path = resolve_model_path(model or default_model_path())
    max_context = max(spec.decode_contexts) + WARMUP_DECODE_STEPS + NUM_DECODE_STEPS + 1
    mixed_growth = WARMUP_DECODE_STEPS + 2 * NUM_REPEATS + 4  # a mixed point's decodes' tokens past their prompt
    kv_tokens = max([max(spec.decode_batches) * max_context, *(b * (c + mixed_growth) for _, b, c in spec.mixed)])
    kv_tokens += max(spec.prefill_chunks + tuple(p for p, _, _ in spec.mixed)) * PREFILL_CHUNKS_PER_PROMPT
    shape = load_shape(str(path), dtype_bytes=4)  # the engine runs FP32 on CPU
    config = EngineConfig(
        model=ModelConfig(model=str(path), device="cpu", dtype="float32", num_threads=num_threads),
        cache=CacheConfig(block_size=block_size, kv_cache_bytes=2 * kv_tokens * shape.kv_bytes_per_token(),
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_model_len=max(
            max_context, max(spec.prefill_chunks) * PREFILL_CHUNKS_PER_PROMPT + 2,
            *(c + mixed_growth + 2 for _, _, c in spec.mixed))),
    )
    hf_config = load_hf_config(path)
    runner = ModelRunner(config, hf_config, config.scheduler.max_model_len)
    peak_flops, bandwidth = measure_peaks(CLOCKS[clock])
    base = DeviceProfile(name="cpu", hbm_bandwidth=bandwidth, peak_flops=peak_flops,
                         memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                         padded_decode_attention=not runner.backend.varlen)
    grid = Grid(config, runner, StepCostModel(shape, base), hf_config.vocab_size, CLOCKS[clock])
    grid.decode(spec.decode_batches[-1], spec.decode_contexts[0])  # warm-up: one-off costs (allocations, kernels)
    grid.prefill(spec.prefill_chunks[0])
    grid.samples.clear()
    num_steps, repeats = (math.ceil(n / spec.passes) for n in (NUM_DECODE_STEPS, NUM_REPEATS))
    tasks = spec.passes * _alternating(
        [functools.partial(_one, grid.decode, b, c, num_steps) for b in spec.decode_batches
         for c in spec.decode_contexts],
        [functools.partial(grid.prefill, chunk, repeats) for chunk in spec.prefill_chunks],
        [functools.partial(grid.mixed, *m, repeats) for m in spec.mixed],
    )
    context = {
        "model": model or DEFAULT_MODEL_NAME, "dtype_bytes": shape.dtype_bytes, "block_size": block_size,
        "num_threads": torch.get_num_threads(), "clock": clock, "measured_peak_flops": peak_flops,
        "measured_bandwidth": bandwidth, "machine": _machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return Measurement(grid, tasks, {"base": base, **context})


def measure(model: str | None, num_threads: int | None, block_size: int, clock: str,
            spec: GridSpec | None = None) -> tuple[list[Point], dict[str, Any]]:
    """Run the grid; the points and what they were measured on."""
    measurement = start_measurement(model, num_threads, block_size, clock, spec)
    return measurement.finish(), measurement.context


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}"


def calibrate(
    model: str | None, name: str, num_threads: int | None, block_size: int, clock: str = "process",
    spec: GridSpec | None = None,
) -> tuple[DeviceProfile, FitReport, list[Point]]:
    """Measure and fit (no file written). `num_threads` None: torch's default thread count.
    A run this profile is compared with (validation) should use the same model, dtype
    (FP32 on CPU), num_threads and clock: with the "process" clock and N threads a step
    costs the CPU time of all N, which is its wall time only when N == 1 on an idle core."""
    measurement = start_measurement(model, num_threads, block_size, clock, spec)
    measurement.finish()
    return fit_measurement(measurement, name)


def fit_measurement(measurement: Measurement, name: str) -> tuple[DeviceProfile, FitReport, list[Point]]:
    """The profile that a finished measurement's points fit."""
    points, context = measurement.points, dict(measurement.context)
    base: DeviceProfile = context.pop("base")
    fitted, report = fit_profile(replace(base, name=name), [(p.features, p.seconds) for p in points])
    fitted = replace(
        fitted, calibrated=True,
        source=f"kvserve calibrate on this machine ({context['machine']}, {context['num_threads']} threads, "
               f"{context['clock']} clock): "
               f"measured FP32 matmul and copy peaks, fitted over {len(points)} engine steps",
        fit={**context, **report.to_dict()},
    )
    return fitted, report, points


def run_calibrate(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    profile, report, points = calibrate(args.model, args.name, args.num_threads, args.block_size, args.clock)
    print(f"{'point':<32} {'measured ms':>12} {'model ms':>10} {'error':>8}")
    for point, error in zip(points, report.rel_errors):
        print(f"{point.label:<32} {point.seconds * 1e3:>12.2f} {point.seconds * (1 + error) * 1e3:>10.2f} {error:>+8.1%}")
    print(f"peaks: {profile.peak_flops / 1e9:.1f} GFLOP/s, {profile.hbm_bandwidth / 1e9:.1f} GB/s; fitted: "
          f"flops_efficiency={profile.flops_efficiency:.3f} attention_efficiency={profile.attention_efficiency:.3f} "
          f"bandwidth_efficiency={profile.bandwidth_efficiency:.3f} "
          f"step_overhead={profile.step_overhead_s * 1e3:.3f} ms per_seq={profile.per_seq_overhead_s * 1e6:.1f} us "
          f"per_token={profile.per_token_overhead_s * 1e6:.2f} us "
          f"per_prompt_seq={profile.per_prompt_seq_overhead_s * 1e6:.1f} us")
    out = Path(args.out) if args.out else PROFILES_DIR / f"{args.name}.json"
    profile.save(out)
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    print(f"RESULT fit_mean_rel_error_pct={report.mean_rel_error * 100:.2f} "
          f"fit_max_rel_error_pct={report.max_rel_error * 100:.2f} points={report.num_points}")
    return 0
