"""Where a decode step's time goes on a GPU, for benchmarks.gpu's model (Llama-3-8B shape,
random bf16 weights, ~1k context).

    python -m benchmarks.gpu_profile [--batches 1,64,256] [--steps 24] [--model-dir DIR] [--tiny]

Per batch, on one engine, every window through benchmarks/decode_window.py (all prompts
prefilled first; every timed step holds exactly the batch, its fewest rows reported):
1. serial: `engine.step()` decode steps, host-timed with the device synced (what
   benchmarks.gpu's serial figure is made of);
2. profiled: another serial window under torch.profiler: the device's busy time per step
   (its kernels' summed time) and the kernels and host ops that take most;
3. ahead: the overlapped loop the worker serves with (step N+1 launched before N's tokens
   are back where the runner supports it), its tokens/s.
The device busy share (kernel time / step wall time) tells a host-bound step from a
device-bound one.
Last line: RESULT rows_min_b<B>=... busy_pct_b<B>=... step_ms_b<B>=... ahead_over_serial_b<B>=...
per batch.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode_window import DecodeWindow, ahead_engine, decode_window
from benchmarks.gpu import build_checkpoint, make_engine, settings

CONTEXT = 1024  # tokens of context per sequence, as benchmarks.gpu decodes at


def profiled_window(engine: Any, batch: int, context: int, vocab: int, steps: int) -> tuple[DecodeWindow, Any]:
    """A serial window with torch.profiler recording its timed steps only."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    window = decode_window(engine, batch, context, vocab, steps, "serial", tag=f"p{batch}", seed=batch + 1,
                           around=lambda: prof)
    return window, prof


def report(serial: DecodeWindow, profiled: DecodeWindow, prof: Any, ahead: DecodeWindow) -> dict[str, float]:
    batch, steps = serial.batch, len(profiled.rows)
    events = prof.key_averages()
    busy_ms = sum(e.self_device_time_total for e in events) / steps / 1e3
    rows_min = min(serial.rows_min, profiled.rows_min, ahead.rows_min)
    print(f"batch {batch} (fewest rows in a timed step: {rows_min}): serial step {serial.step_ms:.2f} ms "
          f"({serial.tokens_per_s:.0f} tok/s); device busy {busy_ms:.2f} ms a step "
          f"({100 * busy_ms / profiled.step_ms:.0f}% of the profiled step, {profiled.step_ms:.2f} ms); "
          f"ahead loop {ahead.step_ms:.2f} ms a step, {ahead.tokens_per_s:.0f} tok/s "
          f"({ahead.tokens_per_s / serial.tokens_per_s:.2f}x serial; launches ahead {ahead.launches_ahead})")
    print(events.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
    return {f"rows_min_b{batch}": rows_min, f"busy_pct_b{batch}": 100 * busy_ms / profiled.step_ms,
            f"step_ms_b{batch}": serial.step_ms, f"ahead_over_serial_b{batch}": ahead.tokens_per_s / serial.tokens_per_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=None, help="comma-separated (default 1,64,256; --tiny 1,4,8)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="a checkpoint benchmarks.gpu --model-dir saved (reused); else one is built")
    p.add_argument("--tiny", action="store_true", help="benchmarks.gpu's tiny model (automatic without CUDA): "
                   "only shows the script works")
    args = p.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    cfg = settings(tiny, None, 256, 0)
    batches = [int(b) for b in (args.batches or ",".join(map(str, cfg.decode_batches))).split(",")]
    context = cfg.context_len if tiny else CONTEXT
    tmp = tempfile.TemporaryDirectory(prefix="kvserve-gpu-profile-")
    model_dir = args.model_dir or Path(tmp.name) / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(cfg, model_dir)  # its transformers copy is dropped: only the saved weights are used
    vocab = cfg.shape["vocab_size"]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    prefill_steps = -(-max(batches) * context // max(1, cfg.max_num_batched_tokens - max(batches))) + 1
    engine = make_engine(cfg, model_dir, "auto", context + prefill_steps + 2 * args.steps + 64)
    print(f"attention backend {engine.runner.backend.name}, CUDA graphs {engine.runner.graphs is not None}",
          flush=True)
    windows = {b: (decode_window(engine, b, context, vocab, args.steps, "serial", tag=f"s{b}", seed=b),
                   *profiled_window(engine, b, context, vocab, args.steps)) for b in batches}
    ahead = ahead_engine(engine)
    results: dict[str, float] = {}
    for b in batches:
        aw = decode_window(ahead, b, context, vocab, args.steps, "ahead", tag=f"a{b}", seed=b + 2)
        results |= report(*windows[b], aw)
        sys.stdout.flush()
    print("RESULT " + " ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.2f}" for k, v in results.items()))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
