"""Where a decode step's time goes on a GPU, for benchmarks.gpu's model (Llama-3-8B shape,
random bf16 weights, ~1k context).

    python -m benchmarks.gpu_profile [--batches 1,64,256] [--steps 24]

Per batch, on one engine:
1. serial: `engine.step()` decode steps, each timed on the host with the device synced
   after it (what benchmarks.gpu's decode figure is made of);
2. profiled: the same steps under torch.profiler: the device's busy time per step (its
   kernels' summed time) and the kernels and host ops that take most;
3. overlapped: the same batch as requests through AsyncEngine (the worker's loop: step
   N+1 planned and launched while step N runs), its delivered tokens/s.
The device busy share (kernel time / step wall time) tells a host-bound step from a
device-bound one; the roofline floor is benchmarks/roofline.py's.
Last line: RESULT busy_pct_b<B>=... step_ms_b<B>=... overlapped_over_serial_b<B>=... per batch.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import _sync, build_checkpoint, make_engine, settings

CONTEXT = 1024  # tokens of context per sequence, as benchmarks.gpu decodes at


def _prompt(gen: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (CONTEXT,), generator=gen).tolist()



def serial_steps(engine: Any, batch: int, steps: int, vocab: int, tag: str, device: str) -> tuple[list[float], Any]:
    """Host-timed decode steps of `batch` sequences, then `steps` more under the profiler."""
    from worker.api import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=2 * steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", _prompt(gen, vocab), params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.seqs.values()):
        engine.step()
    engine.step()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(device)
    for request_id in list(engine.seqs):
        engine.abort_request(request_id)
    return times, prof


def overlapped_tokens_per_s(engine: Any, batch: int, steps: int, vocab: int, tag: str) -> float:
    """The same batch through AsyncEngine's loop: delivered tokens/s over the decode
    steps (from the moment every request has its first token)."""
    from worker.api import SamplingParams
    from worker.engine.async_engine import AsyncEngine

    async def run() -> float:
        ae = AsyncEngine(engine)
        gen = torch.Generator().manual_seed(batch + 1)
        # Long enough that the first request still decodes `steps` steps after the last
        # one's prompt is in (prompts go in at max_num_batched_tokens a step).
        prefill_steps = -(-batch * CONTEXT // engine.scheduler.config.max_num_batched_tokens) + 2
        params = SamplingParams(max_tokens=prefill_steps + steps + 1, temperature=0, ignore_eos=True)
        first: dict[int, float] = {}
        arrivals: list[tuple[float, int]] = []  # (when, tokens) of every output

        async def one(i: int) -> None:
            async for out in ae.generate(_prompt(gen, vocab), params, f"{tag}-{i}"):
                now = time.perf_counter()
                if out.new_token_ids:
                    first.setdefault(i, now)
                    arrivals.append((now, len(out.new_token_ids)))

        try:
            await asyncio.gather(*(one(i) for i in range(batch)))
        finally:
            ae.shutdown()
        start = max(first.values())  # every request decoding from here on
        late = [(t, n) for t, n in arrivals if t > start]
        return sum(n for _, n in late) / (max(t for t, _ in late) - start)

    return asyncio.run(run())


def report(batch: int, times: list[float], prof: Any, steps: int, overlapped: float) -> dict[str, float]:
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events) / steps
    step_ms = 1e3 * statistics.median(times)
    serial = batch / statistics.median(times)
    print(f"batch {batch}: serial step {step_ms:.2f} ms median ({serial:.0f} tok/s); device busy "
          f"{busy_us / 1e3:.2f} ms a step ({100 * busy_us / 1e3 / step_ms:.0f}% of the step); overlapped loop "
          f"{overlapped:.0f} tok/s ({overlapped / serial:.2f}x serial)")
    print(events.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
    return {f"busy_pct_b{batch}": 100 * busy_us / 1e3 / step_ms, f"step_ms_b{batch}": step_ms,
            f"overlapped_over_serial_b{batch}": overlapped / serial}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--tiny", action="store_true", help="benchmarks.gpu's tiny model (automatic without CUDA): "
                   "only shows the script works")
    args = p.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    cfg = settings(tiny, None, 256, 0)
    tmp = tempfile.TemporaryDirectory(prefix="kvserve-gpu-profile-")
    model_dir = Path(tmp.name) / "model"
    build_checkpoint(cfg, model_dir)  # its transformers copy is dropped: only the saved weights are used
    vocab = cfg.shape["vocab_size"]
    gc.collect()
    torch.cuda.empty_cache()
    engine = make_engine(cfg, model_dir, "auto", CONTEXT + 4 * args.steps + 128)
    print(f"attention backend {engine.runner.backend.name}, CUDA graphs {engine.runner.graphs is not None}",
          flush=True)
    results: dict[str, float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        times, prof = serial_steps(engine, batch, args.steps, vocab, f"s{batch}", cfg.device)
        overlapped = overlapped_tokens_per_s(engine, batch, args.steps, vocab, f"o{batch}")
        results |= report(batch, times, prof, args.steps, overlapped)
        sys.stdout.flush()
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in results.items()))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
