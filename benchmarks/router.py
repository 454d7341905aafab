"""KV-headroom routing vs Serve's default router, side by side on one seeded workload.

    python -m benchmarks.router [--num-requests 96] [--rate 8] [--seed 0] [--repeats 3] ...

Starts a local Ray + Serve, deploys 2 real-engine worker replicas (the default model,
worker.replica.WorkerReplica, options from cluster/app.py's `worker_options`) once with
the KV-headroom router and once with Serve's default power-of-two router, and replays the
same workload against each through a DeploymentHandle from this process (the role the
ingress plays in the real app; the router runs here). The pair of runs is repeated
(--repeats, default 3), each run on a fresh deployment, and the order of the two sides
alternates (headroom first in even repeats, default first in odd ones) so that drift in the
machine's load and warm caches favour neither; the report gives every run, then the median
and the spread (min-max) over the repeats.

The workload is built to make routing matter on a small machine:
  * small KV pools (--num-blocks per replica), so a replica can run out of blocks and
    preempt, which is what headroom routing is meant to avoid;
  * a few shared "system prompt" prefixes, so prefix affinity can save prefill and blocks;
  * prompt and output lengths from benchmarks.workload (long-tailed outputs), greedy with
    EOS ignored (every system produces exactly max_tokens per request);
  * open-loop Poisson arrivals at --rate requests/s (seeded).

Prints p50/p99 TTFT, output tokens/s, preemptions, prefix-cache hit tokens and errors for
every run, and as the last line (ratios per repeat, from the two runs of that repeat; then
the median and the min and max over the repeats; preemptions: medians):

    RESULT ttft_p99_ratio=<median default/headroom> ttft_p99_ratio_min=.. ttft_p99_ratio_max=..
           throughput_ratio=<median headroom/default> throughput_ratio_min=.. throughput_ratio_max=..
           preemptions_headroom=<n> preemptions_default=<m> repeats=<r>

Whether routing can matter shows in the preemptions and TTFT: a run where neither side
preempts and TTFT p50 is a few tens of ms was an idle system, where no router can help.

Numbers on a shared 2-core CPU box are noisy; this is a benchmark, not a test (no
assertions on timing).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workload import Request, WorkloadSpec, make_workload

ROUTERS = ("kv_headroom", "pow2")


@dataclass(frozen=True)
class BenchSpec:
    num_requests: int = 96
    rate: float = 8.0  # requests per second (Poisson)
    seed: int = 0
    num_prefixes: int = 4
    prefix_len: int = 96
    suffix_min: int = 8
    suffix_max: int = 160
    output_mean: float = 32.0
    output_cap: int = 128
    num_blocks: int = 48  # per replica (x block_size 16 tokens)
    max_num_seqs: int = 16
    stats_period_s: float = 0.5
    num_replicas: int = 2
    repeats: int = 3  # pairs of runs; the order of the two sides alternates


@dataclass
class TimedRequest:
    request: Request
    arrival_s: float  # offset from the start of the run


@dataclass
class RunResult:
    router: str
    ttft_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    wall_s: float = 0.0
    num_errors: int = 0
    num_preemptions: int = 0
    prefix_cache_hits: int = 0
    per_replica: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def pct(self, q: float) -> float:
        if not self.ttft_s:
            return math.nan
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def run_order(repeat: int) -> tuple[str, ...]:
    """kv_headroom first in even repeats, pow2 first in odd ones."""
    return ROUTERS if repeat % 2 == 0 else ROUTERS[::-1]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the finite values; nan for none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    return statistics.median(finite), min(finite), max(finite)


def pair_ratios(headroom: RunResult, default: RunResult) -> tuple[float, float]:
    """(TTFT p99 default/headroom, throughput headroom/default) of one repeat: > 1 favours headroom."""
    ttft = default.pct(0.99) / headroom.pct(0.99) if headroom.pct(0.99) > 0 else math.nan
    tput = headroom.tokens_per_s / default.tokens_per_s if default.tokens_per_s > 0 else math.nan
    return ttft, tput


def result_line(runs: list[dict[str, RunResult]]) -> str:
    """The RESULT line over the repeats (each a {router: RunResult} pair)."""
    ratios = [pair_ratios(r["kv_headroom"], r["pow2"]) for r in runs]
    ttft = spread([t for t, _ in ratios])
    tput = spread([x for _, x in ratios])
    pre_head = spread([float(r["kv_headroom"].num_preemptions) for r in runs])[0]
    pre_default = spread([float(r["pow2"].num_preemptions) for r in runs])[0]
    return (
        f"RESULT ttft_p99_ratio={ttft[0]:.3f} ttft_p99_ratio_min={ttft[1]:.3f} ttft_p99_ratio_max={ttft[2]:.3f} "
        f"throughput_ratio={tput[0]:.3f} throughput_ratio_min={tput[1]:.3f} throughput_ratio_max={tput[2]:.3f} "
        f"preemptions_headroom={pre_head:g} preemptions_default={pre_default:g} repeats={len(runs)}"
    )


def make_bench_workload(spec: BenchSpec, vocab_size: int, special_ids: frozenset[int]) -> list[TimedRequest]:
    """Shared prefixes + benchmarks.workload suffixes/outputs + Poisson arrival times."""
    rng = random.Random(spec.seed)
    first_id = 3
    pool = [t for t in range(first_id, vocab_size) if t not in special_ids]
    prefixes = [[rng.choice(pool) for _ in range(spec.prefix_len)] for _ in range(spec.num_prefixes)]
    base = make_workload(
        WorkloadSpec(
            num_requests=spec.num_requests,
            seed=spec.seed,
            vocab_size=vocab_size,
            first_token_id=first_id,
            prompt_min=spec.suffix_min,
            prompt_max=spec.suffix_max,
            output_mean=spec.output_mean,
            output_cap=spec.output_cap,
            avoid_token_ids=special_ids,
        )
    )
    out = []
    t = 0.0
    for req in base:
        t += rng.expovariate(spec.rate)
        prefix = prefixes[rng.randrange(spec.num_prefixes)]
        out.append(TimedRequest(Request(req.request_id, prefix + req.prompt_token_ids, req.max_tokens), t))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(spec: BenchSpec, router: str) -> Any:
    from cluster.config import KVServeConfig

    return KVServeConfig.from_dict(
        {
            "engine": {
                "num_blocks": spec.num_blocks,
                "max_num_seqs": spec.max_num_seqs,
                "device": "cpu",
                "num_threads": 1,
            },
            "workers": {"num_replicas": spec.num_replicas, "num_cpus": 1, "max_ongoing_requests": 256},
            # One period for Serve's reports and the router's staleness (cluster/app.py derives both).
            "routing": {"router": router, "stats_period_s": spec.stats_period_s},
        }
    )


async def _one(handle: Any, timed: TimedRequest, start: float, result: RunResult) -> None:
    from worker.api import GenerateRequest, SamplingParams

    delay = start + timed.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)  # open-loop arrival schedule (not synchronisation)
    req = timed.request
    params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    submitted = time.monotonic()
    first: float | None = None
    num_tokens = 0
    try:
        stream = handle.options(stream=True).generate.remote(GenerateRequest(req.request_id, req.prompt_token_ids, params))
        async for out in stream:
            if out.error or out.finish_reason == "error":
                raise RuntimeError(out.error or "engine error")
            if out.new_token_ids and first is None:
                first = time.monotonic()
            num_tokens += len(out.new_token_ids)
    except Exception as e:  # counted, not fatal: the benchmark reports errors
        result.num_errors += 1
        print(f"  error on {req.request_id}: {type(e).__name__}: {e}", file=sys.stderr)
        return
    if first is not None:
        result.ttft_s.append(first - submitted)
    result.num_output_tokens += num_tokens


def _replica_stats(handle: Any) -> list[dict[str, Any]]:
    return list(handle.broadcast("stats").results())


def _wait_for_router_stats(handle: Any, num_replicas: int, timeout_s: float = 30.0) -> None:
    """Bounded wait until the KV-headroom router in this process holds a report from every
    replica (else its first choices would be power-of-two for lack of stats). Reads Serve
    internals (router/serve_internals.py); a no-op for the default router."""
    from router.serve_internals import request_router_of

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        router = request_router_of(handle)
        view = getattr(router, "routing_view", None)
        if view is None:
            return
        v = view()
        if len(v) >= num_replicas and all("timestamp" in r["stats"] for r in v.values()):
            return
        time.sleep(0.05)


async def _replay(handle: Any, workload: list[TimedRequest], result: RunResult) -> None:
    start = time.monotonic()
    await asyncio.gather(*(_one(handle, t, start, result) for t in workload))
    result.wall_s = time.monotonic() - start


def run_one(spec: BenchSpec, router: str, workload: list[TimedRequest], repeat: int) -> RunResult:
    from ray import serve

    from cluster.app import worker_options
    from worker.replica import WorkerReplica
    from worker.api import GenerateRequest, SamplingParams

    config = _config(spec, router)
    app_name = f"bench-router-{router}-{repeat}"  # a fresh deployment per run: no warm caches
    deployment = serve.deployment(WorkerReplica, name="worker").options(**worker_options(config))
    handle = serve.run(deployment.bind(config.engine_config()), name=app_name, route_prefix=None)
    try:
        # Warm up every replica (first-step costs) outside the measurement.
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
        streams = [
            handle.options(stream=True).generate.remote(GenerateRequest(f"warm-{i}", [5, 6, 7, 8] * 4, warm))
            for i in range(4 * spec.num_replicas)
        ]
        for stream in streams:
            for _ in stream:
                pass
        _wait_for_router_stats(handle, spec.num_replicas)
        before = _replica_stats(handle)
        result = RunResult(router)
        asyncio.run(_replay(handle, workload, result))
        after = _replica_stats(handle)
        by_id_before = {s.get("replica_id", i): s for i, s in enumerate(before)}
        for i, s in enumerate(after):
            b = by_id_before.get(s.get("replica_id", i), {})
            preempt = int(s.get("num_preemptions", 0)) - int(b.get("num_preemptions", 0))
            hits = int(s.get("prefix_cache_hits", 0)) - int(b.get("prefix_cache_hits", 0))
            result.num_preemptions += preempt
            result.prefix_cache_hits += hits
            result.per_replica.append(
                {"replica": s.get("replica_id", i), "preemptions": preempt, "prefix_hits": hits,
                 "generated": int(s.get("num_generated_tokens", 0)) - int(b.get("num_generated_tokens", 0))}
            )
        return result
    finally:
        serve.delete(app_name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = BenchSpec()
    for name, value in defaults.__dict__.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    spec = BenchSpec(**{k: getattr(args, k) for k in defaults.__dict__})

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from worker.default_model import default_model_path

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model_dir = default_model_path()
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        model_cfg = json.load(f)
    special = frozenset(int(model_cfg[k]) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in model_cfg)
    workload = make_bench_workload(spec, int(model_cfg["vocab_size"]), special)
    num_out = sum(t.request.max_tokens for t in workload)
    print(
        f"workload: {len(workload)} requests over {workload[-1].arrival_s:.1f}s (Poisson {spec.rate}/s, seed {spec.seed}), "
        f"{spec.num_prefixes} shared prefixes x {spec.prefix_len} tokens, prompts "
        f"{min(len(t.request.prompt_token_ids) for t in workload)}-{max(len(t.request.prompt_token_ids) for t in workload)} "
        f"tokens, {num_out} output tokens; {spec.num_replicas} replicas x {spec.num_blocks} KV blocks"
    )

    from cluster.local_ray import start_local_ray  # a new cluster, on loopback

    start_local_ray(
        num_cpus=2 + 2 * spec.num_replicas,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": repo_root, "RAY_AUTH_MODE": "disabled"}},
    )
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=_free_port()))
    runs: list[dict[str, RunResult]] = []
    try:
        for repeat in range(spec.repeats):
            pair: dict[str, RunResult] = {}
            for router in run_order(repeat):
                print(f"repeat {repeat + 1}/{spec.repeats}: router={router} ...", flush=True)
                pair[router] = run_one(spec, router, workload, repeat)
            runs.append(pair)
    finally:
        serve.shutdown()
        ray.shutdown()
    for line in report(runs):
        print(line)
    return 0


def report(runs: list[dict[str, RunResult]]) -> list[str]:
    lines = [f"{'repeat':>6} {'router':<12} {'ttft_p50_ms':>11} {'ttft_p99_ms':>11} {'mean_ms':>8} {'out_tok/s':>9} "
             f"{'preempt':>7} {'prefix_hit_tok':>14} {'errors':>6}"]
    for repeat, pair in enumerate(runs):
        for router in run_order(repeat):  # in the order they ran
            r = pair[router]
            mean = statistics.mean(r.ttft_s) * 1000 if r.ttft_s else math.nan
            lines.append(
                f"{repeat + 1:>6} {router:<12} {r.pct(0.5) * 1000:>11.1f} {r.pct(0.99) * 1000:>11.1f} {mean:>8.1f} "
                f"{r.tokens_per_s:>9.1f} {r.num_preemptions:>7} {r.prefix_cache_hits:>14} {r.num_errors:>6}"
            )
            for rep in r.per_replica:
                lines.append(f"{'':>6}     replica {rep['replica']}: generated {rep['generated']} tokens, "
                             f"{rep['preemptions']} preemptions, {rep['prefix_hits']} prefix-cache hit tokens")
    for router in ROUTERS:
        p50 = spread([pair[router].pct(0.5) * 1000 for pair in runs])
        p99 = spread([pair[router].pct(0.99) * 1000 for pair in runs])
        tput = spread([pair[router].tokens_per_s for pair in runs])
        lines.append(f"{router}: over {len(runs)} runs, median (min-max): TTFT p50 {p50[0]:.1f} ({p50[1]:.1f}-{p50[2]:.1f}) ms, "
                     f"p99 {p99[0]:.1f} ({p99[1]:.1f}-{p99[2]:.1f}) ms, {tput[0]:.1f} ({tput[1]:.1f}-{tput[2]:.1f}) tok/s")
    for repeat, pair in enumerate(runs):
        ttft, tput = pair_ratios(pair["kv_headroom"], pair["pow2"])
        lines.append(f"repeat {repeat + 1}: ttft_p99_ratio={ttft:.3f} throughput_ratio={tput:.3f}")
    lines.append(result_line(runs))
    return lines


if __name__ == "__main__":
    sys.exit(main())
