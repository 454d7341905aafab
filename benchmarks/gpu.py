"""kvserve on a GPU: decode throughput against the HBM roofline, and side by side with
transformers' static (`generate`) and continuous (`generate_batch`) batching.

    python -m benchmarks.gpu [--tiny] [--hbm-gbps 4800] [--requests N] [--concurrency C]

Model: Llama-3-8B-shaped (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate
14336, vocab 128256), random bf16 weights built on the device with transformers (no
download), saved once as safetensors so that kvserve loads it through its own loader and
both systems run the SAME weights; the transformers model stays in memory for the peers.
`--tiny` (automatic without CUDA) shrinks the model, batches, context and workload so the
whole script runs end to end on a CPU in a minute or two; its numbers only show the
script works (the roofline of a CPU is not the H200's).

Reported, in one run:
1. decode tokens/s at batch 1, 64, 256 with ~1k context, against the roofline of
   benchmarks/roofline.py, as a percentage: every prompt prefilled first, then only steps
   in which every row decodes are timed (benchmarks/decode_window.py), through the serial
   loop and the overlapped launch-ahead loop; each window's fewest rows are reported;
2. TTFT of a 512-token prompt on an idle engine (median of a few);
3. one seeded mixed workload (cluster/workload/token_prompts.py) through kvserve and through the
   peers (benchmarks/hf_peers.py, the same code benchmarks/engine.py uses): useful output
   tokens/s and kvserve/peer ratios;
4. the scheduler's share of kvserve step time over that workload: time in
   Scheduler.schedule + Scheduler.update over the engine's step time (both counted by
   the engine itself: Engine.counters.schedule_time_s, .step_time_s).
   hf_cb runs transformers' continuous batching at its own defaults (on CUDA it decides
   CUDA graphs and async batching itself), hf_cb_matched at kvserve's 16-token pages
   with both off; both are reported.
The LAST line: RESULT roofline_pct_b<N>=<p> per batch (the loop the worker serves with:
launch-ahead where the runner overlaps the device, else serial), rows_min_b<N>=<rows>
(the fewest rows in any timed step of either loop), vs_hf_static=<x> vs_hf_cb=<y>
vs_hf_cb_matched=<z> sched_pct=<s>, then serial_pct_b<N> and ahead_pct_b<N>.
`--decode-only` runs the decode windows alone (what CI runs with `--tiny`).
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from worker.engine.build import build_engine

from benchmarks.decode_window import DecodeWindow, ahead_engine, decode_window, prefill_steps_bound
from benchmarks.hf_peers import PeerRun, cb_num_blocks, cb_page_size, continuous_batching_generate, static_generate
from benchmarks.roofline import H200_HBM_BYTES_PER_S, ModelShape, decode_floor_s, roofline_pct
from cluster.workload.token_prompts import Request, WorkloadSpec, describe, make_workload

LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
)
COMMON = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Settings:
    shape: dict[str, Any]
    device: str
    dtype: torch.dtype
    decode_batches: tuple[int, ...]
    context_len: int
    decode_steps: int
    ttft_prompt_len: int
    workload: WorkloadSpec
    concurrency: int
    max_num_batched_tokens: int


def settings(tiny: bool, requests: int | None, concurrency: int | None, seed: int) -> Settings:
    if tiny:
        return Settings(
            TINY | COMMON, "cuda" if torch.cuda.is_available() else "cpu", torch.float32,
            decode_batches=(1, 4, 8), context_len=64, decode_steps=8, ttft_prompt_len=128,
            workload=WorkloadSpec(num_requests=requests or 12, seed=seed, vocab_size=TINY["vocab_size"],
                                  prompt_min=8, prompt_max=48, output_mean=12.0, output_cap=24),
            concurrency=concurrency or 4, max_num_batched_tokens=256,
        )
    return Settings(
        LLAMA3_8B | COMMON, "cuda", torch.bfloat16,
        decode_batches=(1, 64, 256), context_len=1024, decode_steps=32, ttft_prompt_len=512,
        workload=WorkloadSpec(num_requests=requests or 256, seed=seed, vocab_size=LLAMA3_8B["vocab_size"]),
        concurrency=concurrency or 128, max_num_batched_tokens=8192,
    )


# ----------------------------------------------------------------------------- the model


def build_checkpoint(cfg: Settings, out: Path) -> Any:
    """A random Llama built on the device (default dtype set so no fp32 copy is made),
    saved to `out` as safetensors; returns the transformers model (kept for the peers)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)
    try:
        with torch.device(cfg.device):
            model = LlamaForCausalLM(LlamaConfig(**cfg.shape, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(previous)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out, safe_serialization=True)
    return model.eval()


def model_shape(hf_model: Any, dtype: torch.dtype) -> ModelShape:
    c = hf_model.config
    elem = torch.empty((), dtype=dtype).element_size()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return ModelShape(
        num_params=sum(p.numel() for p in hf_model.parameters()),
        embedding_params=0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size,
        hidden_size=c.hidden_size, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
        head_dim=head_dim, dtype_bytes=elem, kv_dtype_bytes=elem,
    )


def make_engine(cfg: Settings, model_dir: Path, backend: str, max_model_len: int) -> Any:
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.engine.core import Engine

    dtype = "bfloat16" if cfg.dtype == torch.bfloat16 else "float32"
    return build_engine(EngineConfig(
        ModelConfig(model=str(model_dir), dtype=dtype, device=cfg.device, attention_backend=backend),
        CacheConfig(kv_cache_bytes=64 * 1024**2),  # CPU budget; on CUDA sized from free memory
        SchedulerConfig(max_num_seqs=max(max(cfg.decode_batches), cfg.concurrency),
                        max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=max_model_len),
    ))


# ----------------------------------------------------------------------------- kvserve runs


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _drain(engine: Any) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"kvserve failed {out.request_id}: {out.error}")
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def decode_windows(engine: Any, cfg: Settings) -> dict[int, dict[str, DecodeWindow]]:
    """Every batch through both loops (benchmarks/decode_window.py: every timed step holds
    the batch); the serial loop first, as the launch-ahead engine may share its runner."""
    windows: dict[int, dict[str, DecodeWindow]] = {b: {} for b in cfg.decode_batches}
    for b in cfg.decode_batches:
        windows[b]["serial"] = decode_window(engine, b, cfg.context_len, cfg.shape["vocab_size"], cfg.decode_steps,
                                             "serial", tag=f"serial{b}", seed=b)
    ahead = ahead_engine(engine)
    for b in cfg.decode_batches:
        windows[b]["ahead"] = decode_window(ahead, b, cfg.context_len, cfg.shape["vocab_size"], cfg.decode_steps,
                                            "ahead", tag=f"ahead{b}", seed=1000 + b)
    engine.reset_prefix_cache()  # the ahead engine may have written over its cached blocks
    return windows


def ttft_s(engine: Any, cfg: Settings, repeats: int = 3) -> float:
    from worker.api import SamplingParams

    times = []
    for r in range(repeats):
        prompt = [3 + (r * 7919 + i * 31) % (cfg.shape["vocab_size"] - 3) for i in range(cfg.ttft_prompt_len)]
        start = time.perf_counter()
        engine.add_request(f"ttft-{r}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while not any(out.new_token_ids for out in engine.step()):
            pass
        times.append(time.perf_counter() - start)
        _drain(engine)
    return statistics.median(times)


def run_workload_kvserve(engine: Any, requests: list[Request], concurrency: int) -> tuple[PeerRun, float]:
    """(the run, scheduler share of step time) over the mixed workload, all submitted at t=0."""
    from worker.api import SamplingParams

    # The same concurrency as the peers' batch (the engine was built with room for the
    # largest decode batch); the scheduler reads its limits from this config every step.
    engine.scheduler.config = replace(engine.scheduler.config, max_num_seqs=concurrency)
    step0, sched0 = engine.counters.step_time_s, engine.counters.schedule_time_s  # the engine's own clocks
    start, cpu_start = time.perf_counter(), time.process_time()
    for r in requests:
        engine.add_request(r.request_id, r.prompt_token_ids,
                           SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    tokens = _drain(engine)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    sched_share = (engine.counters.schedule_time_s - sched0) / (engine.counters.step_time_s - step0)
    out = [tokens[r.request_id] for r in requests]
    generated = sum(len(t) for t in out)
    return PeerRun(out, generated, wall, cpu, f"max_num_seqs {concurrency}"), sched_share


# ----------------------------------------------------------------------------- report


def decode_table(shape: ModelShape, windows: dict[int, dict[str, DecodeWindow]], bandwidth: float,
                 served: str) -> dict[str, float]:
    """Prints the decode windows against the roofline; returns the RESULT fields. The
    roofline is taken at each window's own mean context; `roofline_pct_b<N>` is the loop
    the worker serves with (`served`), both loops are reported on their own too."""
    print(f"{'batch':>6} {'loop':>7} {'rows min':>9} {'context':>8} {'ms/step':>8} {'tok/s':>12} "
          f"{'floor ms':>9} {'% roofline':>11}")
    fields: dict[str, float] = {}
    for b, by_loop in windows.items():
        for loop, w in by_loop.items():
            pct = roofline_pct(w.tokens_per_s, shape, b, round(w.mean_context), bandwidth)
            floor = decode_floor_s(shape, b, round(w.mean_context), bandwidth)
            print(f"{b:>6} {loop:>7} {w.rows_min:>9} {w.mean_context:>8.0f} {w.step_ms:>8.2f} "
                  f"{w.tokens_per_s:>12.1f} {1000 * floor:>9.3f} {pct:>10.1f}%")
            fields[f"{loop}_pct_b{b}"] = pct
        fields[f"roofline_pct_b{b}"] = fields[f"{served}_pct_b{b}"]
        fields[f"rows_min_b{b}"] = min(w.rows_min for w in by_loop.values())
    return fields


def peers_table(requests: list[Request], kv_run: PeerRun, peers: dict[str, PeerRun], dtype: torch.dtype) -> dict[str, float]:
    """Prints the mixed workload through every system; returns kvserve/peer useful tok/s ratios."""
    useful = sum(r.max_tokens for r in requests)
    print(f"\n{'system':<10} {'useful tok':>10} {'computed':>9} {'wall s':>8} {'useful tok/s':>13} {'kvserve/peer':>13}")
    runs = {"kvserve": kv_run, **peers}
    ratios = {}
    for name, run in runs.items():
        ratios[name] = (useful / kv_run.wall_s) / (useful / run.wall_s)
        print(f"{name:<10} {useful:>10} {run.generated_tokens:>9} {run.wall_s:>8.2f} {useful / run.wall_s:>13.1f} "
              f"{ratios[name]:>13.2f}")
    for name, run in runs.items():
        print(f"note: {name}: {run.note}")
    mismatches = sum(a != b for a, b in zip(kv_run.tokens, peers["hf_static"].tokens))
    print(f"greedy tokens kvserve vs hf_static: {mismatches} of {len(requests)} requests differ "
          f"({'bf16: small differences flip near-tied argmaxes' if dtype == torch.bfloat16 else 'fp32'})")
    return {f"vs_{name}": ratios[name] for name in peers}


def run_peers(cfg: Settings, hf_model: Any, requests: list[Request], max_model_len: int, api: str) -> dict[str, PeerRun]:
    prompts = [r.prompt_token_ids for r in requests]
    max_tokens = [r.max_tokens for r in requests]
    warm = [list(range(3, 35)), list(range(35, 67))]
    peers = {"hf_static": static_generate(hf_model, prompts, max_tokens, cfg.concurrency, warm)}
    # transformers' continuous batching at its own defaults (page size, CUDA graphs, async
    # batching, flash switch: its best settings) and at kvserve's page size without them.
    for name, which in (("hf_cb", "defaults"), ("hf_cb_matched", "matched")):
        peers[name] = continuous_batching_generate(
            hf_model, prompts, max_tokens, cfg.concurrency, cfg.max_num_batched_tokens,
            cb_num_blocks(cfg.concurrency, max_model_len, cb_page_size(which)), settings=which,
            api=api, warmup_prompts=warm,
        )
    return peers


# ----------------------------------------------------------------------------- main


RESULT_ORDER = ("roofline_pct_", "rows_min_", "vs_", "sched_pct", "serial_pct_", "ahead_pct_")


def result_line(fields: dict[str, float]) -> str:
    keys = sorted(fields, key=lambda k: next(i for i, p in enumerate(RESULT_ORDER) if k.startswith(p)))
    return "RESULT " + " ".join(f"{k}={fields[k]:.1f}" if isinstance(fields[k], float) else f"{k}={fields[k]}"
                                for k in keys)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and sizes (automatic without CUDA)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the decode windows (no TTFT, no mixed workload, no transformers peers)")
    parser.add_argument("--hbm-gbps", type=float, default=H200_HBM_BYTES_PER_S / 1e9,
                        help="memory bandwidth for the roofline, GB/s (H200: 4800)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None, help="kvserve max_num_seqs / peers' batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flash", "triton"])
    parser.add_argument("--hf-cb-api", default="manager", choices=["manager", "generate_batch"])
    parser.add_argument("--model-dir", type=Path, default=None, help="where to save the random checkpoint")
    return parser.parse_args(argv)


def max_len_for(cfg: Settings) -> int:
    """Room for a decode window's prompt, its prefill steps, warm, timed and ahead steps."""
    window = cfg.context_len + prefill_steps_bound(max(cfg.decode_batches), cfg.context_len,
                                                   cfg.max_num_batched_tokens) + cfg.decode_steps + 16
    return max(window, cfg.workload.prompt_max + cfg.workload.output_cap + 16, cfg.ttft_prompt_len + 8)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    cfg = settings(tiny, args.requests, args.concurrency, args.seed)
    requests = make_workload(cfg.workload)
    max_model_len = max_len_for(cfg)
    tmp = tempfile.TemporaryDirectory(prefix="kvserve-gpu-bench-")
    model_dir = args.model_dir or Path(tmp.name) / "model"
    t0 = time.perf_counter()
    hf_model = build_checkpoint(cfg, model_dir)
    shape = model_shape(hf_model, cfg.dtype)
    print(f"model: {'tiny' if tiny else 'Llama-3-8B-shaped'}, {shape.num_params / 1e6:.2f}M params, {cfg.dtype}, "
          f"on {cfg.device}; built + saved in {time.perf_counter() - t0:.1f} s")
    sys.stdout.flush()

    engine = make_engine(cfg, model_dir, args.attention_backend, max_model_len)
    served = "ahead" if engine.overlaps_device else "serial"  # what AsyncEngine runs (worker/engine/async_engine.py)
    print(f"attention backend {engine.runner.backend.name}, CUDA graphs {'on' if engine.runner.graphs is not None else 'off'}, "
          f"launches ahead {engine.launches_ahead}, served loop {served}, roofline bandwidth {args.hbm_gbps:.0f} GB/s")
    windows = decode_windows(engine, cfg)
    fields = decode_table(shape, windows, args.hbm_gbps * 1e9, served)
    if not args.decode_only:
        print(f"\nworkload (seed {args.seed}): {describe(requests)}; concurrency {cfg.concurrency}")
        ttft = ttft_s(engine, cfg)
        print(f"TTFT, {cfg.ttft_prompt_len}-token prompt, idle engine: {1000 * ttft:.1f} ms (median of 3)")
        kv_run, sched_share = run_workload_kvserve(engine, requests, cfg.concurrency)
        del engine
        gc.collect()
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
        fields |= peers_table(requests, kv_run, run_peers(cfg, hf_model, requests, max_model_len, args.hf_cb_api),
                              cfg.dtype)
        print(f"scheduler (schedule + update) share of kvserve step time: {100 * sched_share:.1f}%")
        fields["sched_pct"] = 100 * sched_share
    print(result_line(fields))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
