"""KV-headroom routing vs Serve's default router, side by side on one seeded workload.

    python -m benchmarks.router [--num-requests 96] [--rate 8] [--seed 0] ...

Starts a local Ray + Serve, deploys 2 real-engine worker replicas (the default model,
worker.replica.WorkerReplica, options from cluster/app.py's `worker_options`) once with
the KV-headroom router and once with Serve's default power-of-two router, and replays the
same workload against each through a DeploymentHandle from this process (the role the
ingress plays in the real app; the router runs here).

The workload is built to make routing matter on a small machine:
  * small KV pools (--num-blocks per replica), so a replica can run out of blocks and
    preempt, which is what headroom routing is meant to avoid;
  * a few shared "system prompt" prefixes, so prefix affinity can save prefill and blocks;
  * prompt and output lengths from benchmarks.workload (long-tailed outputs), greedy with
    EOS ignored (every system produces exactly max_tokens per request);
  * open-loop Poisson arrivals at --rate requests/s (seeded).

Prints p50/p99 TTFT, output tokens/s, preemptions, prefix-cache hit tokens and errors for
both, and as the last line:

    RESULT ttft_p99_ratio=<default/headroom> throughput_ratio=<headroom/default> preemptions_headroom=<n> preemptions_default=<m>

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
            "routing": {
                "router": router,
                "stats_period_s": spec.stats_period_s,
                # cluster/app.py passes router_kwargs through; the period must match.
                "router_kwargs": {"stats_period_s": spec.stats_period_s} if router == "kv_headroom" else {},
            },
        }
    )


async def _one(handle: Any, timed: TimedRequest, start: float, result: RunResult) -> None:
    from worker.replica import GenerateRequest
    from worker.sampling_params import SamplingParams

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
    internals (handle -> router wrapper -> AsyncioRouter -> RequestRouter); a no-op for
    the default router."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            router = handle._router._asyncio_router.request_router
        except AttributeError:
            return
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


def run_one(spec: BenchSpec, router: str, workload: list[TimedRequest]) -> RunResult:
    from ray import serve

    from cluster.app import worker_options
    from worker.replica import GenerateRequest, WorkerReplica
    from worker.sampling_params import SamplingParams

    config = _config(spec, router)
    app_name = f"bench-router-{router}"
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
    results: dict[str, RunResult] = {}
    try:
        for router in ROUTERS:
            print(f"running with router={router} ...", flush=True)
            results[router] = run_one(spec, router, workload)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"{'router':<12} {'ttft_p50_ms':>11} {'ttft_p99_ms':>11} {'out_tok/s':>9} {'preempt':>7} {'prefix_hit_tok':>14} {'errors':>6}")
    for router, r in results.items():
        print(
            f"{router:<12} {r.pct(0.5) * 1000:>11.1f} {r.pct(0.99) * 1000:>11.1f} {r.tokens_per_s:>9.1f} "
            f"{r.num_preemptions:>7} {r.prefix_cache_hits:>14} {r.num_errors:>6}"
        )
        for rep in r.per_replica:
            print(f"    replica {rep['replica']}: generated {rep['generated']} tokens, "
                  f"{rep['preemptions']} preemptions, {rep['prefix_hits']} prefix-cache hit tokens")
    head, default = results["kv_headroom"], results["pow2"]
    ttft_ratio = default.pct(0.99) / head.pct(0.99) if head.pct(0.99) > 0 else math.nan
    tput_ratio = head.tokens_per_s / default.tokens_per_s if default.tokens_per_s > 0 else math.nan
    if head.ttft_s and default.ttft_s:
        print(f"mean ttft: headroom {statistics.mean(head.ttft_s) * 1000:.1f} ms, default {statistics.mean(default.ttft_s) * 1000:.1f} ms")
    print(
        f"RESULT ttft_p99_ratio={ttft_ratio:.3f} throughput_ratio={tput_ratio:.3f} "
        f"preemptions_headroom={head.num_preemptions} preemptions_default={default.num_preemptions}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
