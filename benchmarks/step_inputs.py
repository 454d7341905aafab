"""Host time to build a step's inputs: the per-step padded block tables against the
persistent ones (worker/runner/block_table.py), side by side, on the host.

    python -m benchmarks.step_inputs [--batch 256] [--context 8192] [--steps 64] [--repeats 5]

A decode-only batch of `--batch` rows, each with `--context` tokens already computed
(block_size 16), steps forward one token per row per step; every block_size steps each
row's table gains a block. Each side builds the step's host batch and the varlen
metadata a flash or triton backend reads (worker/runner/inputs.py host_batch and
attention_metadata; on this CPU the "device" is the host, so the copies are memcpys and
the figure is the host work, which is what the persistent tables cut). Sides alternate
within each repeat; the figure is the median over repeats of the mean microseconds per
step. Last line:

    RESULT step_inputs_us_padded=<p> step_inputs_us_persistent=<q> persistent_vs_padded=<q/p>
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker.runner.block_table import PersistentBlockTable
from worker.runner.inputs import attention_metadata, host_batch
from worker.sampling_params import SamplingParams
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence

BLOCK = 16


def _rows(batch: int, context: int) -> tuple[list[Sequence], list[list[int]]]:
    seqs = [Sequence(f"r{i}", [1] * (context + 1), SamplingParams()) for i in range(batch)]
    for seq in seqs:
        seq.num_computed_tokens = context
    per = -(-(context + 1) // BLOCK)
    tables = [list(range(i * (per + 64), i * (per + 64) + per)) for i in range(batch)]
    return seqs, tables


def _run(batch: int, context: int, steps: int, persistent: bool) -> float:
    """Mean microseconds per step of host_batch + attention_metadata."""
    seqs, tables = _rows(batch, context)
    max_blocks = -(-(context + steps + 1) // BLOCK) + 1
    store = PersistentBlockTable(2 * batch, max_blocks, torch.device("cpu")) if persistent else None
    order = list(range(batch))
    cpu = torch.device("cpu")
    total = 0.0
    for _ in range(steps):
        plan = SchedulerOutput(seqs=seqs, num_new_tokens=[1] * batch, block_ids=tables)
        t0 = time.perf_counter()
        b = host_batch(plan, order, BLOCK, 1, store)
        attention_metadata(b, BLOCK, 1, cpu, varlen=True)
        total += time.perf_counter() - t0
        for seq, table in zip(seqs, tables):  # the step's token lands; a block when one fills
            seq.token_ids.append(1)
            seq.num_computed_tokens += 1
            if seq.num_tokens > len(table) * BLOCK:
                table.append(table[-1] + 1)
    return total / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    padded: list[float] = []
    persistent: list[float] = []
    for r in range(args.repeats):
        sides = [(False, padded), (True, persistent)]
        for is_persistent, out in sides if r % 2 == 0 else sides[::-1]:
            out.append(_run(args.batch, args.context, args.steps, is_persistent))
        print(f"repeat {r}: padded {padded[-1]:8.1f} us/step   persistent {persistent[-1]:8.1f} us/step", flush=True)
    p, q = statistics.median(padded), statistics.median(persistent)
    print(f"batch {args.batch}, context {args.context}, {args.steps} steps x {args.repeats} repeats, block_size {BLOCK}")
    print(f"RESULT step_inputs_us_padded={p:.1f} step_inputs_us_persistent={q:.1f} persistent_vs_padded={q / p:.3f}")


if __name__ == "__main__":
    main()
