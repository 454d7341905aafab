"""Calibration's measuring: the machine's peaks, and the real engine's steps timed per
plan shape (a point). `kvserve calibrate` (cluster/calibrate.py) picks the points and fits
a profile to them; this module says how one point is measured.

Each step's time is what one turn of the engine loop costs (Engine.step plus the stats
snapshot AsyncEngine takes after it), so the fitted overheads cover the engine's host work
too; each plan's features come from the cost model reading the plan the runner executes.
Decode and mixed points are timed once their batch has decoded a few untimed steps past its
prefill (the state a live engine's steps run in: after decode steps), and each plan's KV
blocks come from an aged pool (`age_pool`: in no order, as a pool that has served a while
hands them out; a fresh pool's blocks in id order make the CPU backend's paged-KV gathers
cheaper than a live engine's). A point's time is the mean of its steps (`mean_point`).
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from worker.costs.cost_model import StepCostModel, StepFeatures

PREFILL_CHUNKS_PER_PROMPT = 4  # chunk contexts 0, P, 2P, 3P
NUM_DECODE_STEPS = 12  # per decode point (mean taken)
# Untimed decode steps between a batch's prefill and the steps a decode or mixed point
# times. The first decode steps after a prefill run with the caches and allocator state the
# prefill's activations left (they settle within about this many steps), while a live
# engine's decode and mixed steps mostly follow decode steps: timed right after the
# prefill, decode points priced a live run's decode-only steps well above what they took
# (benchmarks/routing/calibration_state.py measures the settling).
WARMUP_DECODE_STEPS = 6
NUM_REPEATS = 7  # per prefill point (mean taken)


@dataclass(frozen=True)
class Point:
    """One plan shape's measurement: a representative step's features and the mean step
    time (`mean_point`)."""

    label: str
    features: StepFeatures
    seconds: float


# -- the machine's peaks ------------------------------------------------------------------
def measure_peaks(clock: Callable[[], float] = time.perf_counter, repeats: int = 5) -> tuple[float, float]:
    """(FP32 matmul FLOP/s, copy bandwidth in bytes/s), best of `repeats`."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src, dst = torch.randn(32 * 1024**2), torch.empty(32 * 1024**2)
    flops = bandwidth = 0.0
    for _ in range(repeats):
        t = clock()
        torch.mm(a, b)
        flops = max(flops, 2 * 1024**3 / max(clock() - t, 1e-9))
        t = clock()
        dst.copy_(src)
        bandwidth = max(bandwidth, 2 * src.numel() * 4 / max(clock() - t, 1e-9))  # read + write
    return flops, bandwidth


# -- running the engine over the grid ------------------------------------------------------
def age_pool(pool: Any, seed: int = 0) -> None:  # kv.block_pool.BlockPool
    """Put every free block of `pool` in its free queue in a seeded random order: the state
    of a pool that has served a while (requests end in any order, and free their blocks
    as they end), not a fresh one's id order, whose consecutive blocks a CPU's paged-KV
    gathers read faster than a live engine's."""
    blocks = pool.allocate(pool.num_free_blocks)
    random.Random(seed).shuffle(blocks)
    pool.free(blocks)


class _RecordingRunner:
    """The real runner; remembers the features of the plan it last executed (and whether
    the plan before it had prompt rows: the grid's engines share this one runner)."""

    def __init__(self, runner: Any, cost: StepCostModel) -> None:
        self.runner = runner
        self.cost = cost
        self.num_blocks = runner.num_blocks
        self.last: StepFeatures | None = None

    def execute(self, plan: Any) -> Any:
        follows_prompt = self.last is not None and self.last.num_prompt_seqs > 0
        self.last = self.cost.plan_features(plan, follows_prompt)  # before the update advances the plan
        return self.runner.execute(plan)


class Grid:
    """The grid's points, measured on one loaded runner: fresh engines, distinct prompts,
    and every timed step kept by the point's label."""

    def __init__(self, config: Any, runner: Any, cost: StepCostModel, vocab_size: int, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.recorder = _RecordingRunner(runner, cost)
        self.vocab_size = vocab_size
        self.num_prompts = 0
        # Every timed step of each point, by label in first-measured order: a point measured
        # in several passes pools its passes' steps.
        self.samples: dict[str, list[tuple[StepFeatures, float]]] = {}

    def engine(self, max_num_seqs: int, max_num_batched_tokens: int, aged: bool = True) -> Any:
        """A fresh engine (scheduler, KV bookkeeping) on the one loaded runner, its block
        pool aged (`age_pool`) unless `aged` is False."""
        from worker.engine.core import Engine

        scheduler = replace(self.config.scheduler, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        engine = Engine(scheduler, self.config.cache, self.recorder, self.vocab_size)
        if aged:
            age_pool(engine.kv.pool, self.num_prompts)
        return engine

    def prompt(self, length: int) -> list[int]:
        self.num_prompts += 1  # distinct prompts (prefix caching is off anyway)
        return [(self.num_prompts * 7919 + i * 31) % (self.vocab_size - 3) + 3 for i in range(length)]

    def steps(self, engine: Any) -> list[tuple[StepFeatures, float]]:
        out = []
        while engine.has_unfinished():
            out.append(self.one_step(engine))
        return out

    def one_step(self, engine: Any) -> tuple[StepFeatures, float]:
        t = self.clock()
        engine.step()
        engine.stats()  # AsyncEngine takes this snapshot after every step
        elapsed = self.clock() - t
        assert self.recorder.last is not None
        return self.recorder.last, elapsed

    def point(self, label: str, steps: list[tuple[StepFeatures, float]]) -> Point:
        self.samples.setdefault(label, []).extend(steps)
        return mean_point(label, steps)

    def decode(self, batch: int, context: int, num_steps: int = NUM_DECODE_STEPS, aged: bool = True) -> Point:
        """`aged` False: on a fresh pool (benchmarks.routing.pool_order's comparison)."""
        from worker.api import SamplingParams

        engine = self.engine(batch, max(2048, batch * context), aged)  # every prompt in one step
        params = SamplingParams(max_tokens=WARMUP_DECODE_STEPS + num_steps + 1, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{i}", self.prompt(context), params)
        steps = [s for s in self.steps(engine) if s[0].num_tokens == batch == s[0].num_seqs]
        label = f"decode b={batch} ctx={context}" + ("" if aged else " fresh pool")
        return self.point(label, steps[WARMUP_DECODE_STEPS:])

    def prefill(self, chunk: int, repeats: int = NUM_REPEATS) -> list[Point]:
        from worker.api import SamplingParams

        runs = []
        for _ in range(repeats):
            engine = self.engine(1, chunk)
            engine.add_request("p", self.prompt(chunk * PREFILL_CHUNKS_PER_PROMPT), SamplingParams(max_tokens=1, temperature=0.0))
            runs.append(self.steps(engine))
        return [self.point(f"prefill chunk={chunk} ctx={k * chunk}", [run[k] for run in runs])
                for k in range(PREFILL_CHUNKS_PER_PROMPT)]

    def mixed(self, chunk: int, batch: int, context: int, repeats: int = NUM_REPEATS) -> list[Point]:
        """A fresh prompt of `chunk` tokens joining `batch` running decodes of `context`
        tokens, `repeats` times (each prompt answers in one token and leaves; a decode
        step between them keeps the decodes' contexts within a few tokens): the mixed
        point, and the point of the decode steps right after it (the caches the prompt
        took are refilled there: DeviceProfile.after_prompt_overhead_s)."""
        from worker.api import SamplingParams

        engine = self.engine(batch + 1, max(2048, batch * context, batch + chunk))
        decode = SamplingParams(max_tokens=WARMUP_DECODE_STEPS + 2 * repeats + 4, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{i}", self.prompt(context), decode)
        engine.step()  # the decodes' prompts (a prefill point of its own, not this one)
        for _ in range(WARMUP_DECODE_STEPS):  # a live engine's fresh prompt joins decodes past their prefill
            self.one_step(engine)
        mixed, after = [], []
        for k in range(repeats):
            engine.add_request(f"p{k}", self.prompt(chunk), SamplingParams(max_tokens=1, temperature=0.0))
            mixed.append(self.one_step(engine))
            after.append(self.one_step(engine))
        steps = [s for s in mixed if s[0].num_seqs == batch + 1 and s[0].num_tokens == batch + chunk]
        decodes = [s for s in after if s[0].follows_prompt and s[0].num_seqs == batch == s[0].num_tokens]
        return [self.point(f"mixed chunk={chunk} + decode b={batch} ctx={context}", steps),
                self.point(f"decode b={batch} ctx={context} after chunk={chunk}", decodes)]


def mean_point(label: str, steps: list[tuple[StepFeatures, float]]) -> Point:
    """The point's time is its steps' mean: a run's time is the sum of its steps, so the
    expected step time is what prices it. A median drops the slow tail (steps that other
    work on the machine left with cold caches) which a run on the same machine pays in
    full. Its features are the median step's (a decode point's steps differ by a token of
    context each)."""
    if not steps:
        raise RuntimeError(f"calibration point {label!r} produced no step of its shape")
    ordered = sorted(steps, key=lambda s: s[1])
    features, _ = ordered[len(ordered) // 2]
    return Point(label, features, statistics.fmean(t for _, t in steps))
