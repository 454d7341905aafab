"""Step-time cost of structured outputs: one batch with half its rows under a JSON-schema
grammar vs the same batch unconstrained, alternating, repeated, on the real engine.

The constrained rows' schema (an array of at least 200 short strings) cannot terminate
within max_tokens, and the free rows ignore EOS, so both variants decode the same number
of rows for the same number of steps; only the grammar work differs (mask computation,
overlapped with the forward, the batch mask applied in the sampler, the matcher advance).

    PYTHONPATH=. python -m benchmarks.structured [--batch 16] [--steps 48] [--reps 5]
prints per-rep figures and `RESULT structured_overhead_pct=...`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from worker.api import SamplingParams, StructuredOutput, load_tokenizer
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.default_model import default_model_path
from worker.engine.core import Engine
from worker.engine.build import build_engine

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 200}


def decode_step_s(engine: Engine, prompts: list[list[int]], steps: int, constrained: bool) -> tuple[float, float]:
    """Mean wall time and mean process CPU time (all threads: the mask thread and
    llguidance's included) of the decode steps, after every row's prefill. On a shared,
    oversubscribed machine the CPU time is the steadier measure of the work added."""
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    for i, ids in enumerate(prompts):
        structured = so if constrained and i % 2 == 0 else None
        params = SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=i, ignore_eos=True, structured=structured)
        engine.add_request(f"{constrained}-{i}-{time.perf_counter_ns()}", ids, params)
    while engine.awaiting_grammar:  # compiles (cached after the first rep) are not step time
        engine.step()
    engine.step()  # the prefill
    times, cpu = [], []
    while engine.has_unfinished():
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.mean(times[:-1]), statistics.mean(cpu[:-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    path = default_model_path()
    engine = build_engine(EngineConfig(
        model=ModelConfig(model=str(path), device="cpu", num_threads=args.threads),
        cache=CacheConfig(kv_cache_bytes=64 * 1024**2),
        scheduler=SchedulerConfig(max_num_seqs=args.batch),
    ))
    tok = load_tokenizer(path)
    prompts = [tok(f"Story {i}: the little cat")["input_ids"] for i in range(args.batch)]
    decode_step_s(engine, prompts, 4, True)  # warm-up: compile + cache the grammar, torch kernels
    decode_step_s(engine, prompts, 4, False)
    free, half, free_cpu, half_cpu = [], [], [], []
    for rep in range(args.reps):
        f, fc = decode_step_s(engine, prompts, args.steps, False)
        h, hc = decode_step_s(engine, prompts, args.steps, True)
        free.append(f)
        half.append(h)
        free_cpu.append(fc)
        half_cpu.append(hc)
        print(f"rep {rep}: wall free {f * 1e3:.2f} / half-constrained {h * 1e3:.2f} ms/step ({(h / f - 1) * 100:+.1f}%); "
              f"cpu free {fc * 1e3:.2f} / half-constrained {hc * 1e3:.2f} ms/step ({(hc / fc - 1) * 100:+.1f}%)", flush=True)
    f_med, h_med = statistics.median(free), statistics.median(half)
    fc_med, hc_med = statistics.median(free_cpu), statistics.median(half_cpu)
    print(f"batch={args.batch} steps={args.steps} reps={args.reps} vocab={engine.vocab_size} "
          f"wall: free_median_ms={f_med * 1e3:.3f} half_constrained_median_ms={h_med * 1e3:.3f} "
          f"overhead_pct={(h_med / f_med - 1) * 100:.1f}")
    print(f"RESULT structured_overhead_pct={(hc_med / fc_med - 1) * 100:.1f} "
          f"wall_overhead_pct={(h_med / f_med - 1) * 100:.1f} free_step_cpu_ms={fc_med * 1e3:.3f} "
          f"half_constrained_step_cpu_ms={hc_med * 1e3:.3f} batch={args.batch}")


if __name__ == "__main__":
    main()
