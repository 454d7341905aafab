"""The systems benchmarks/engine.py compares, each run on the same workload: kvserve's
engine (with per-step plan and timing records) and the transformers peers
(benchmarks/hf_peers.py) wrapped for the report."""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from worker.engine.build import build_engine

from benchmarks.hf_peers import (
    PeerRun,
    cb_num_blocks,
    cb_page_size,
    continuous_batching_generate,
    load_hf_model,
    reference_generate,
    static_generate,
)
from cluster.workload.token_prompts import Request

CONCURRENCY = 32
MAX_BATCHED_TOKENS = 2048
# Warm-up prompts unlike any workload prompt, so that no prefix cache (kvserve's or
# transformers') carries blocks from the warm-up into the timed run.
WARMUP_PROMPTS = (list(range(3, 35)), list(range(35, 67)))


@dataclass
class SystemResult:
    name: str
    wall_s: float
    cpu_s: float  # process CPU time over the timed region (all threads)
    useful_tokens: int
    generated_tokens: int  # tokens the system computed, discarded ones included
    outputs: dict[str, list[int]]  # request id -> its useful output tokens
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else float("nan")


# ----------------------------------------------------------------------------- kvserve


@dataclass
class StepRecord:
    num_seqs: int
    num_tokens: int
    all_decode: bool
    step_s: float
    forward_s: float


def run_kvserve(
    model_dir: Path, requests: list[Request], threads: int, profile: bool, max_model_len: int
) -> tuple[SystemResult, list[StepRecord], str | None]:
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.engine.core import Engine
    from worker.api import SamplingParams

    engine = build_engine(
        EngineConfig(
            ModelConfig(model=str(model_dir), num_threads=threads),
            CacheConfig(),
            SchedulerConfig(
                max_num_seqs=CONCURRENCY,
                max_num_batched_tokens=MAX_BATCHED_TOKENS,
                max_model_len=max_model_len,
            ),
        )
    )
    torch.set_num_threads(threads)

    # Record each step's plan shape next to the engine's own step / forward timings.
    plans: list[tuple[int, int, bool]] = []
    execute = engine.runner.execute

    def recording_execute(plan):  # type: ignore[no-untyped-def]
        plans.append((len(plan.seqs), plan.num_batched_tokens, all(n == 1 for n in plan.num_new_tokens)))
        return execute(plan)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]

    # Warm-up (untimed): a couple of short requests through prefill and decode.
    for i, prompt in enumerate(WARMUP_PROMPTS):
        engine.add_request(f"warmup-{i}", prompt,
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    plans.clear()
    steps_before = engine.counters.num_steps

    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    records: list[StepRecord] = []
    profiler = cProfile.Profile() if profile else None
    start, cpu_start = time.perf_counter(), time.process_time()
    for r in requests:
        engine.add_request(r.request_id, r.prompt_token_ids,
                           SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    if profiler:
        profiler.enable()
    while engine.has_unfinished():
        step0, fwd0, n0 = engine.counters.step_time_s, engine.counters.forward_time_s, len(plans)
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"kvserve failed {out.request_id}: {out.error}")
            outputs[out.request_id].extend(out.new_token_ids)
        if len(plans) > n0:
            num_seqs, num_tokens, all_decode = plans[-1]
            records.append(StepRecord(num_seqs, num_tokens, all_decode,
                                      engine.counters.step_time_s - step0, engine.counters.forward_time_s - fwd0))
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start

    stats = engine.stats()
    for r in requests:
        if len(outputs[r.request_id]) != r.max_tokens:
            raise RuntimeError(f"kvserve gave {len(outputs[r.request_id])} tokens for {r.request_id}, "
                               f"expected {r.max_tokens}")
    useful = sum(r.max_tokens for r in requests)
    result = SystemResult("kvserve", wall, cpu, useful, useful, outputs)
    result.notes.append(
        f"kvserve: {stats.num_steps - steps_before} steps, {stats.num_preemptions} preemptions, "
        f"forward share of step time {stats.forward_share:.1%} (all steps, warm-up included), "
        f"step time / wall {sum(s.step_s for s in records) / wall:.1%}"
    )
    report = None
    if profiler:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(30)
        buf.write("\n--- by own time ---\n")
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(20)
        report = buf.getvalue()
    return result, records, report


def overhead_at_full_batch(records: list[StepRecord]) -> tuple[float, int, float, str]:
    """(overhead share, number of steps, mean step ms, which steps) over the decode-only
    steps that ran a full batch of CONCURRENCY sequences; falls back to all decode-only
    steps when none did (a workload smaller than the concurrency)."""
    which = f"decode-only steps with {CONCURRENCY} running"
    full = [s for s in records if s.all_decode and s.num_seqs >= CONCURRENCY]
    if not full:
        which = f"no step ran {CONCURRENCY} sequences; all decode-only steps"
        full = [s for s in records if s.all_decode]
    if not full:
        return float("nan"), 0, float("nan"), "no decode-only steps"
    step = sum(s.step_s for s in full)
    fwd = sum(s.forward_s for s in full)
    return (step - fwd) / step, len(full), 1000 * step / len(full), which


# ----------------------------------------------------------------------------- transformers
# The peers themselves are benchmarks/hf_peers.py; these wrap them for the report
# (fp32 on CPU, the workload's Requests, the same concurrency and token budget).


def _peer_result(name: str, requests: list[Request], run: PeerRun, notes: list[str]) -> SystemResult:
    outputs = {r.request_id: tokens for r, tokens in zip(requests, run.tokens)}
    useful = sum(r.max_tokens for r in requests)
    return SystemResult(name, run.wall_s, run.cpu_s, useful, run.generated_tokens, outputs, notes)


def run_hf_static(model_dir: Path, requests: list[Request]) -> SystemResult:
    model = load_hf_model(model_dir, "sdpa")
    run = static_generate(model, [r.prompt_token_ids for r in requests], [r.max_tokens for r in requests],
                          CONCURRENCY, WARMUP_PROMPTS)
    return _peer_result("hf_static", requests, run, [f"hf_static: {run.note}"])


def run_hf_cb(model_dir: Path, requests: list[Request], attn: str, api: str, max_model_len: int,
              settings: str) -> SystemResult:
    """transformers' continuous batching at `settings` (hf_peers.CB_SETTINGS); the system is
    named hf_cb for its own defaults, hf_cb_matched for kvserve's page size without graphs."""
    name = "hf_cb" if settings == "defaults" else f"hf_cb_{settings}"
    model = load_hf_model(model_dir, attn)
    # The same KV capacity as kvserve's default 256 MiB pool for this model shape is far
    # more than 32 in-flight requests need; size it for them.
    num_blocks = cb_num_blocks(CONCURRENCY, max_model_len, cb_page_size(settings))
    run = continuous_batching_generate(
        model, [r.prompt_token_ids for r in requests], [r.max_tokens for r in requests],
        max_requests_per_batch=CONCURRENCY, max_batch_tokens=MAX_BATCHED_TOKENS, num_blocks=num_blocks,
        settings=settings, api=api, warmup_prompts=WARMUP_PROMPTS,
    )
    note = f"{name}: {run.note}; loaded with attention {attn!r}, {num_blocks} pages"
    return _peer_result(name, requests, run, [note])


def hf_reference(model_dir: Path, requests: list[Request]) -> dict[str, list[int]]:
    """Per-request greedy `generate` (no padding): the reference when hf_static is not run."""
    model = load_hf_model(model_dir, "sdpa")
    tokens = reference_generate(model, [r.prompt_token_ids for r in requests], [r.max_tokens for r in requests])
    return {r.request_id: t for r, t in zip(requests, tokens)}
