"""The host path at device speed: how much of the time a step takes is host work the
device waits for, and what rate reaches the caller against the rate the device models.

    python -m benchmarks.hostpath [--quick] [--repeats N] [--prompt-len N] [--serve-proxy]

Two parts. The ENGINE alone, here; then the whole Serve path (benchmarks/hostpath_serve.py:
serving CPU per token, delivered / device rate through HTTP, streamed and not) as
`kvserve serve` runs it by default, through Serve's direct ingress (HAProxy -> ingress
replicas), and with --serve-proxy through Serve's HTTP proxies too (`kvserve serve
--serve-proxy`). One simulated worker engine, built from the config `kvserve serve --device sim:h200
--model-shape llama-3-8b` builds (max_num_seqs 256, time dilation 1: every modelled second
is a wall second), behind its async API (worker/engine/async_engine.py: the step thread, the
inbox, one publication per step to an asyncio loop), with an in-process consumer that only
counts tokens (no tokenizer: detokenization belongs to the Serve path). Two batches, every
request submitted at once, greedy, EOS ignored:

    b64:  64 requests x 256 output tokens      b256: 256 requests x 128 output tokens
    (prompts of --prompt-len distinct token ids, 128 by default: no prefix-cache hits;
    --quick: 64 and 32 output tokens, one repeat)

Per run:
- modelled device rate = output tokens / sum of the modelled step times (the step-cost
  model's figure for each step the engine ran: runner.last_step_s);
- delivered rate = output tokens / wall seconds from submitting the requests to the last
  token reaching the consumer; delivered ratio = delivered / modelled (1.0: the device
  never waited for the host). Wall time: other load on the box lowers it;
- exposed engine host time: the engine thread's CPU time (time.thread_time, read on that
  thread by wrappers around the runner's device calls) spent while no step was on the
  device: from each step's completion (execute or wait returning) to the next step's start
  (execute or launch entered), plus any host work done inside a step's device window
  beyond the window's modelled length (the device finished first and waited). A step
  launched ahead (worker/scheduling/async_scheduler.py) starts before the previous one completes: no gap
  is counted before it, and its window's host work is counted from its launch, which
  overstates it by what ran under the step before. Thread CPU
  time, not wall time: a busy box stretches the wall time of the same work (and the GIL
  handed to the consumer thread adds waiting), but not the CPU time the engine thread
  itself needs. engine_host_pct = that time / the modelled step time, summed over the
  run's steps (a ratio of sums), in percent. The wall-clock counterpart (busy span minus
  the modelled step times) is printed beside it.
Each figure is the median over --repeats runs (3; --quick 1). The machine's load
average is printed before and after.

The LAST line is machine-readable:
    RESULT serve_us_per_token_stream=<us> serve_us_per_token=<us> delivered_ratio_b64=<x>
           delivered_ratio_b256=<x> engine_host_pct_b256=<p> engine_host_pct_b64=<p>
           engine_delivered_ratio_b64=<x> engine_delivered_ratio_b256=<x>
           delivered_vs_engine_b64=<x> delivered_vs_engine_b256=<x>
           [proxy_* with --serve-proxy] [floor_* with --serve-floor]
           [proxy_floor_* with both]
(serve_* over every run's tokens, streamed or not, through the default path (direct
ingress); delivered_ratio_* through it, not streamed, medians, against the device rate of
the run's own steps; delivered_vs_engine_* the same delivered rates against the engine
alone's modelled rate for the batch, which also counts a batch the Serve path spread over
more steps; engine_* the engine alone, medians; proxy_*: the same figures through Serve's
HTTP proxies; floor_*: for a bare Serve app with the same hops and device beside kvserve's,
benchmarks/serve_floor.py, through the default path; proxy_floor_* that floor through
Serve's proxies).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.hostpath_serve import APP_NAME as SERVE_APP
from benchmarks.hostpath_serve import (FLOOR_APP_NAME, by_stream, delivered_ratio, delivered_vs_engine, measure_serve,
                                       per_token_us, result_keys, versus)
from worker.api import SamplingParams
from worker.engine.async_engine import AsyncEngine
from worker.config import EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.engine.build import build_engine

DEVICE = "sim:h200"
MODEL_SHAPE = "llama-3-8b"
MAX_NUM_SEQS = 256
BATCHES = ((64, 256), (256, 128))  # (requests, output tokens each)
QUICK_BATCHES = ((64, 64), (256, 32))


def engine_config() -> EngineConfig:
    """What `kvserve serve --device sim:h200 --model-shape llama-3-8b` gives a worker
    (cluster/config.py), with max_num_seqs 256 and the default time dilation of 1."""
    from worker.default_model import default_model_path

    return EngineConfig(
        model=ModelConfig(model=default_model_path(), device=DEVICE, model_shape=MODEL_SHAPE),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS),
    )


# -- the engine thread's device timeline ------------------------------------------------------
@dataclass
class DeviceStep:
    start_cpu: float  # engine thread CPU seconds when the step went to the device
    start_wall: float
    modelled_s: float = 0.0
    window_cpu: float = 0.0  # host CPU between its start and its wait (its device window)
    end_cpu: float = 0.0  # when its result was back on the host
    end_wall: float = 0.0


@dataclass
class DeviceTimeline:
    """Wraps the runner's device calls (execute; launch and wait where the runner splits
    them) and records, on the engine thread, when each step starts and completes."""

    time_dilation: float
    steps: list[DeviceStep] = field(default_factory=list)

    def attach(self, runner: Any) -> None:
        steps = self.steps
        if hasattr(runner, "execute"):
            execute = runner.execute

            def timed_execute(plan: Any) -> Any:
                step = DeviceStep(time.thread_time(), time.perf_counter())
                result = execute(plan)
                step.end_cpu, step.end_wall = time.thread_time(), time.perf_counter()
                step.window_cpu = step.end_cpu - step.start_cpu
                step.modelled_s = runner.last_step_s
                steps.append(step)
                return result

            runner.execute = timed_execute
        if hasattr(runner, "launch") and hasattr(runner, "wait"):
            launch, wait = runner.launch, runner.wait
            in_flight: dict[int, DeviceStep] = {}

            def timed_launch(plan: Any) -> Any:
                step = DeviceStep(time.thread_time(), time.perf_counter())
                handle = launch(plan)
                step.modelled_s = runner.last_step_s
                in_flight[id(handle)] = step
                return handle

            def timed_wait(handle: Any) -> Any:
                step = in_flight.pop(id(handle))
                step.window_cpu = time.thread_time() - step.start_cpu
                result = wait(handle)
                step.end_cpu, step.end_wall = time.thread_time(), time.perf_counter()
                steps.append(step)
                return result

            runner.launch, runner.wait = timed_launch, timed_wait

    def gap_cpu_s(self) -> float:
        """Engine-thread CPU between one step's completion and the next one's start."""
        steps = self.steps
        return sum(max(b.start_cpu - a.end_cpu, 0.0) for a, b in zip(steps, steps[1:]))

    def overrun_cpu_s(self) -> float:
        """Engine-thread CPU inside steps' device windows beyond the windows' length."""
        return sum(max(s.window_cpu - s.modelled_s * self.time_dilation, 0.0) for s in self.steps)

    def exposed_host_cpu_s(self) -> float:
        """Engine-thread CPU while the device had no step: the gaps, plus host work past a
        step's device window (the device finished first and waited)."""
        return self.gap_cpu_s() + self.overrun_cpu_s()

    def modelled_s(self) -> float:
        return sum(s.modelled_s for s in self.steps)


# -- one measurement ---------------------------------------------------------------------------
@dataclass
class EngineRun:
    num_requests: int
    output_tokens: int
    num_steps: int
    modelled_s: float
    wall_s: float
    busy_wall_s: float  # first step's start to last step's completion
    exposed_host_cpu_s: float
    overrun_cpu_s: float  # the part of exposed_host_cpu_s that overran device windows
    process_cpu_s: float

    @property
    def modelled_tokens_per_s(self) -> float:
        return self.output_tokens / self.modelled_s

    @property
    def delivered_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def delivered_ratio(self) -> float:
        return self.delivered_tokens_per_s / self.modelled_tokens_per_s

    @property
    def host_pct(self) -> float:
        """Exposed engine host CPU over the modelled step time, in percent."""
        return 100.0 * self.exposed_host_cpu_s / self.modelled_s

    @property
    def wall_excess_pct(self) -> float:
        """The wall-clock counterpart: the busy span not covered by modelled step time."""
        return 100.0 * (self.busy_wall_s - self.modelled_s) / self.modelled_s


def prompt(index: int, prompt_len: int) -> list[int]:
    """Distinct prompts (no two share a first block): ids 1..100000 in sequence."""
    return [1 + (index * prompt_len + j) % 100_000 for j in range(prompt_len)]


async def _consume(engine: AsyncEngine, num_requests: int, max_tokens: int, prompt_len: int) -> int:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    async def one(i: int) -> int:
        n = 0
        async for out in engine.generate(prompt(i, prompt_len), params, request_id=f"r{i}"):
            n += len(out.new_token_ids)
        return n

    counts = await asyncio.gather(*(one(i) for i in range(num_requests)))
    return sum(counts)


def measure_engine(num_requests: int, max_tokens: int, prompt_len: int = 128, plan_ahead: bool = True,
                   launch_ahead: bool = True) -> EngineRun:
    """One run of the engine alone at time dilation 1 (see the module docstring).
    `plan_ahead=False`: every plan made after the previous step's tokens are back
    (worker/scheduling/async_scheduler.py off, and so launching ahead); `launch_ahead=False`: every step
    launched after the previous one's tokens are back (worker/scheduling/async_scheduler.py off).
    benchmarks/decode_ahead.py compares the three."""
    config = engine_config()
    core = build_engine(config)
    if not plan_ahead:
        core.scheduler.plan_ahead = lambda: None  # type: ignore[method-assign]
    if not launch_ahead:
        core.scheduler.launch_ahead = lambda: None  # type: ignore[method-assign]
    timeline = DeviceTimeline(config.model.time_dilation)
    timeline.attach(core.runner)
    engine = AsyncEngine(core)  # no tokenizer: the consumer counts token ids

    async def run() -> tuple[int, float]:
        t0 = time.perf_counter()
        tokens = await _consume(engine, num_requests, max_tokens, prompt_len)
        return tokens, time.perf_counter() - t0

    cpu0 = time.process_time()
    try:
        tokens, wall_s = asyncio.run(run())
    finally:
        engine.shutdown()
    process_cpu_s = time.process_time() - cpu0
    steps = timeline.steps
    expected = num_requests * max_tokens
    if tokens != expected:
        raise RuntimeError(f"the consumer got {tokens} tokens, expected {expected}")
    return EngineRun(
        num_requests=num_requests,
        output_tokens=tokens,
        num_steps=len(steps),
        modelled_s=timeline.modelled_s(),
        wall_s=wall_s,
        busy_wall_s=steps[-1].end_wall - steps[0].start_wall,
        exposed_host_cpu_s=timeline.exposed_host_cpu_s(),
        overrun_cpu_s=timeline.overrun_cpu_s(),
        process_cpu_s=process_cpu_s,
    )


@dataclass
class EngineSummary:
    """Medians over repeats of one batch."""

    num_requests: int
    runs: list[EngineRun]

    def median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.runs)


def measure_engine_batch(num_requests: int, max_tokens: int, repeats: int, prompt_len: int) -> EngineSummary:
    runs = []
    for i in range(repeats):
        run = measure_engine(num_requests, max_tokens, prompt_len)
        runs.append(run)
        print(
            f"  b{num_requests} run {i + 1}/{repeats}: {run.output_tokens} tokens in {run.num_steps} steps; "
            f"modelled {run.modelled_tokens_per_s:,.0f} tok/s ({1e3 * run.modelled_s / run.num_steps:.2f} ms/step), "
            f"delivered {run.delivered_tokens_per_s:,.0f} tok/s (ratio {run.delivered_ratio:.3f}); "
            f"exposed engine host CPU {1e6 * run.exposed_host_cpu_s / run.num_steps:.0f} us/step "
            f"({1e6 * run.overrun_cpu_s / run.num_steps:.0f} of it past device windows) "
            f"= {run.host_pct:.2f}% of the modelled step (wall excess {run.wall_excess_pct:.2f}%); "
            f"process CPU {1e6 * run.process_cpu_s / run.output_tokens:.1f} us/token",
            flush=True,
        )
    return EngineSummary(num_requests, runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer output tokens, one repeat")
    p.add_argument("--repeats", type=int, default=None, help="runs per batch (default 3; --quick 1)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--serve-proxy", action="store_true",
                   help="also run the Serve part as `kvserve serve --serve-proxy` runs it (Serve's HTTP proxies "
                        "in front of the ingress replicas, no HAProxy), after the default, and print both")
    p.add_argument("--serve-defaults", action="store_true",
                   help="also run the Serve part with Serve's default settings (RAY_SERVE_THROUGHPUT_OPTIMIZED=0, "
                        "which leaves out direct ingress: Serve's proxies), first, and print kvserve's figures "
                        "against them")
    p.add_argument("--serve-floor", action="store_true",
                   help="also run the Serve part on a bare Serve app with the same hops and device and nothing "
                        "else (benchmarks/serve_floor.py), in turns with kvserve's app on each path measured, and "
                        "print kvserve's figures against it")
    p.add_argument("--write-serving-cost", metavar="PATH", nargs="?", const="cluster/sim/serving_cost.json",
                   help="write the Serve runs' CPU per token, per kind of process, for kvserve simulate's "
                        "serving-layer plan: the default path's, and Serve's proxies' with --serve-proxy "
                        "(default path: cluster/sim/serving_cost.json)")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    batches = QUICK_BATCHES if args.quick else BATCHES
    print(f"machine: {os.cpu_count()} CPUs, load average before {os.getloadavg()}")
    print(f"engine: {DEVICE} {MODEL_SHAPE}, max_num_seqs {MAX_NUM_SEQS}, time dilation 1, "
          f"prompts of {args.prompt_len} tokens, greedy, EOS ignored")
    summaries: dict[int, EngineSummary] = {}
    for num_requests, max_tokens in batches:
        print(f"b{num_requests}: {num_requests} requests x {max_tokens} output tokens", flush=True)
        summaries[num_requests] = measure_engine_batch(num_requests, max_tokens, repeats, args.prompt_len)
    for b, s in summaries.items():
        print(
            f"b{b} (median of {len(s.runs)}): modelled device rate {s.median('modelled_tokens_per_s'):,.0f} tok/s, "
            f"delivered {s.median('delivered_tokens_per_s'):,.0f} tok/s (ratio {s.median('delivered_ratio'):.3f}), "
            f"exposed engine host time {s.median('host_pct'):.2f}% of the modelled step "
            f"(wall clock: {s.median('wall_excess_pct'):.2f}%)"
        )
    print("the whole Serve path (front door -> ingress -> worker), load client in its own process at a lower priority:",
          flush=True)
    baseline = None
    if args.serve_defaults:
        # Direct ingress is part of Serve's throughput-optimized mode: its defaults serve
        # through Serve's proxies.
        print("  with Serve's default settings (RAY_SERVE_THROUGHPUT_OPTIMIZED=0: Serve's proxies):", flush=True)
        baseline = measure_serve(batches, repeats, direct_ingress=False, serve_defaults=True)[SERVE_APP]
    beside = (", beside the floor in turns: a bare Serve app, same hops and device, nothing else "
              "(benchmarks/serve_floor.py):" if args.serve_floor else ":")
    print("  as `kvserve serve` runs Serve (throughput-optimized, direct ingress: HAProxy -> ingress replicas, "
          "cluster/serve_env.py)" + beside, flush=True)
    measured = measure_serve(batches, repeats, direct_ingress=True, floor=args.serve_floor)
    serve_runs, floor = measured[SERVE_APP], measured.get(FLOOR_APP_NAME)
    proxy = proxy_floor = None
    if args.serve_proxy:
        print("  as `kvserve serve --serve-proxy` runs Serve (Serve's HTTP proxy -> ingress replicas)"
              + (", beside the floor in turns:" if args.serve_floor else ":"), flush=True)
        measured = measure_serve(batches, repeats, direct_ingress=False, floor=args.serve_floor)
        proxy, proxy_floor = measured[SERVE_APP], measured.get(FLOOR_APP_NAME)
    print(f"load average after {os.getloadavg()}")
    plain, streamed = by_stream(serve_runs)

    engine_rates = {b: s.median("modelled_tokens_per_s") for b, s in summaries.items()}
    if baseline is not None:
        print(versus("against Serve's defaults", serve_runs, baseline))
    proxy_result = floor_result = ""
    if proxy is not None:
        if baseline is not None:  # the same front door: what Serve's throughput-optimized mode alone changes
            print(versus("Serve's proxies against Serve's defaults", proxy, baseline))
        print(versus("Serve's proxies against the default", proxy, serve_runs))
        proxy_result = result_keys("proxy", proxy, engine_rates)
    if floor is not None:
        print(versus("against the bare Serve floor", serve_runs, floor))
        floor_result = result_keys("floor", floor, engine_rates)
    if proxy is not None and proxy_floor is not None:
        print(versus("Serve's proxies against the bare Serve floor through them", proxy, proxy_floor))
        floor_result += result_keys("proxy_floor", proxy_floor, engine_rates)

    if args.write_serving_cost:
        from cluster.sim.serving_cost import from_runs

        flags = (" --quick" if args.quick else "") + (" --serve-proxy" if proxy is not None else "")
        cost = from_runs(serve_runs, f"python -m benchmarks.hostpath{flags}, {os.cpu_count()} CPUs, "
                                     f"{time.strftime('%Y-%m-%d')}", proxy)
        with open(args.write_serving_cost, "w") as f:
            f.write(cost.to_json())
        print(f"wrote {args.write_serving_cost}")
    b64, b256 = summaries[64], summaries[256]
    vs_engine = {b: delivered_vs_engine(serve_runs, b, engine_rates[b]) for b in (64, 256)}
    print(f"serve: {per_token_us(plain):.0f} us/token not streamed, {per_token_us(streamed):.0f} us/token streamed; "
          f"delivered ratio b64 {delivered_ratio(serve_runs, 64):.3f}, b256 {delivered_ratio(serve_runs, 256):.3f} (medians); "
          f"delivered over the engine alone's rate b64 {vs_engine[64]:.3f}, b256 {vs_engine[256]:.3f}; "
          f"errors {sum(r.errors for r in serve_runs)}")
    print(
        f"RESULT serve_us_per_token_stream={per_token_us(streamed):.0f} serve_us_per_token={per_token_us(plain):.0f} "
        f"delivered_ratio_b64={delivered_ratio(serve_runs, 64):.3f} delivered_ratio_b256={delivered_ratio(serve_runs, 256):.3f} "
        f"engine_host_pct_b256={b256.median('host_pct'):.2f} engine_host_pct_b64={b64.median('host_pct'):.2f} "
        f"engine_delivered_ratio_b64={b64.median('delivered_ratio'):.3f} "
        f"engine_delivered_ratio_b256={b256.median('delivered_ratio'):.3f} "
        f"delivered_vs_engine_b64={vs_engine[64]:.3f} delivered_vs_engine_b256={vs_engine[256]:.3f}"
        f"{proxy_result}{floor_result}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
