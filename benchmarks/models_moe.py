"""The CPU engine against transformers' static generation on a Qwen3-MoE model of ~31M
active parameters: benchmarks/models.py's `moe_engine_vs_hf_static=` figure.

Method: benchmarks/engine.py's, on benchmarks/bench_moe_model.py's checkpoint. One seeded
workload (cluster/workload/token_prompts.py), concurrency 32, all requests at t = 0, greedy with EOS
ignored, torch.set_num_threads(threads) for both sides; kvserve runs through
engine_systems.run_kvserve (a fresh engine each time, so no prefix cache carries over
from one repeat to the next), transformers through engine_systems.run_hf_static
(`generate` in groups of 32, left padding; tokens past a request's max_tokens are
discarded). Useful tokens = the sum of max_tokens; the timed region runs from the first
submission to the last token (loading and warm-up outside it).

Side by side: the two sides alternate, kvserve first in even repeats and hf_static first
in odd ones, so drift in a shared machine's load favours neither. The figure is the ratio
of the two sides' useful tokens/s, each summed over its repeats (total useful tokens over
total timed seconds); each repeat's own ratio is reported too, and the same ratio from
process CPU seconds (benchmarks/engine.py's "(by cpu s)"), which other load on a shared
machine moves less.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.engine_systems import SystemResult, run_hf_static, run_kvserve
from cluster.workload.token_prompts import Request, WorkloadSpec, describe, make_workload

SIDES = ("kvserve", "hf_static")


@dataclass
class MoEComparison:
    """Every timed run of each side, in the order they ran."""

    runs: dict[str, list[SystemResult]] = field(default_factory=lambda: {s: [] for s in SIDES})
    order: list[str] = field(default_factory=list)
    mismatched_requests: int = 0  # kvserve's tokens unlike hf_static's (first repeat)

    def tokens_per_s(self, side: str) -> float:
        runs = self.runs[side]
        wall = sum(r.wall_s for r in runs)
        return sum(r.useful_tokens for r in runs) / wall if wall > 0 else float("nan")

    def cpu_tokens_per_s(self, side: str) -> float:
        """Useful tokens per process CPU second: less sensitive than wall time to other
        load on a shared CPU (reported beside the figure, never instead of it)."""
        runs = self.runs[side]
        cpu = sum(r.cpu_s for r in runs)
        return sum(r.useful_tokens for r in runs) / cpu if cpu > 0 else float("nan")

    @property
    def ratio(self) -> float:
        return self.tokens_per_s("kvserve") / self.tokens_per_s("hf_static")

    def repeat_ratios(self) -> list[float]:
        return [k.tokens_per_s / h.tokens_per_s for k, h in zip(self.runs["kvserve"], self.runs["hf_static"])]


def moe_workload(model_dir: Path, num_requests: int, seed: int = 0) -> list[Request]:
    config = json.loads((model_dir / "config.json").read_text())
    special = frozenset(v for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                        if isinstance(v := config.get(k), int))
    return make_workload(WorkloadSpec(num_requests=num_requests, seed=seed, vocab_size=config["vocab_size"],
                                      avoid_token_ids=special))


def moe_engine_vs_hf_static(
    model_dir: Path,
    num_requests: int,
    repeats: int,
    threads: int = 2,
    log: Callable[[str], None] = print,
) -> MoEComparison:
    """Alternating timed runs of kvserve and hf_static on one workload (see the module doc)."""
    requests = moe_workload(model_dir, num_requests)
    spec = WorkloadSpec()
    max_model_len = spec.prompt_max + spec.output_cap + 16
    log(f"moe workload: {describe(requests)}; concurrency 32, {repeats} repeats per side, torch threads {threads}")
    result = MoEComparison()
    for repeat in range(repeats):
        for side in (SIDES if repeat % 2 == 0 else SIDES[::-1]):
            torch.set_num_threads(threads)
            start = time.perf_counter()
            if side == "kvserve":
                run, _, _ = run_kvserve(model_dir, requests, threads, False, max_model_len)
            else:
                run = run_hf_static(model_dir, requests)
            result.runs[side].append(run)
            result.order.append(side)
            log(f"  repeat {repeat} {side:<9} {run.useful_tokens} useful tokens in {run.wall_s:7.2f} s timed "
                f"({run.tokens_per_s:6.1f} tok/s, cpu {run.cpu_s:7.2f} s; {time.perf_counter() - start:6.1f} s "
                f"with load/warm-up)")
    torch.set_num_threads(threads)
    kv, hf = result.runs["kvserve"][0].outputs, result.runs["hf_static"][0].outputs
    result.mismatched_requests = sum(1 for r in requests if kv[r.request_id] != hf[r.request_id])
    for note in result.runs["kvserve"][0].notes + result.runs["hf_static"][0].notes:
        log("  note: " + note)
    return result
