"""Many tenants under overload: priority bands and fair shares on a REAL Serve cluster of
simulated-device replicas.

    python -m benchmarks.tenants [--quick]

The cluster (cluster/app.py's build_app, as `kvserve serve` deploys it): the HTTP proxy,
one ingress replica (admission control on), --num-replicas worker replicas with
engine.device sim:h200 and --max-num-seqs running sequences each (the real scheduler, KV manager and prefix cache; the llama-3-8b
shape's step times from the H200 cost model, slept x the time dilation). Six API keys in
three priority bands (ingress.key_priorities): premium-1/2 (band 0), standard-1/2 (band 5),
batch-1 and batch-flood (band 10). Workload: ShareGPT-like lengths (cluster/workload/sim_kinds.py),
Poisson arrivals per key, sent as token ids over HTTP streaming with each key's
Authorization header, at the arrival times x dilation.

Two phases on the same deployment:
1. alone: the premium keys' requests only, at their own rate;
2. overload: every key at once, the offered rate 2x the cluster's capacity (the discrete-
   event simulator's burst capacity, the same engine code), batch-flood sending half of it;
   the premium keys replay exactly the requests of phase 1.
Then, side by side (unless --no-baseline), the overload phase again on a redeployed app
whose engines give worse bands' prompts the whole token budget
(engine.worse_band_prefill_tokens 0, worker/scheduling/band_prefill.py): the alone phase is one band,
which that limit never touches, so it serves both.

Figures (modelled time: real seconds / dilation):
- premium_ttft_p99_ratio: p99 TTFT of the premium keys' requests under overload / alone
  (a request that failed or was shed counts as an infinite TTFT);
- jain_index: Jain's index, over the two standard-band keys (equal demand, one band), of
  their goodput (requests finished within the SLO per second);
- lost: requests with neither a completion nor a 429/503 answer;
- goodput_rps, tokens_per_s: all keys' requests finished within the SLO, and output tokens,
  per modelled second of the overload phase; *_vs_unlimited: the same over the baseline's.

    RESULT premium_ttft_p99_ratio=<..> jain_index=<..> lost=<n> goodput_rps=<..> tokens_per_s=<..>
           [unlimited_premium_ttft_p99_ratio=<..> goodput_vs_unlimited=<..> tokens_vs_unlimited=<..>]

Numbers from a shared 2-core box are noisy (the dispatch path is real and not dilated);
this is a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from dataclasses import dataclass, fields, replace
from typing import Any

from benchmarks import serve_cluster
from cluster.percentile import percentile

APP_NAME = "bench-tenants"
MODEL = "sim"
KEYS = {  # name -> (priority band, share of the overload rate)
    "premium-1": (0, 0.1), "premium-2": (0, 0.1),
    "standard-1": (5, 0.1), "standard-2": (5, 0.1),
    "batch-1": (10, 0.1), "batch-flood": (10, 0.5),
}
PREMIUM = ("premium-1", "premium-2")
MAX_LEN = 2048  # each of a request's prompt and output: both fit max_model_len 4096 together
SAME_BAND = ("standard-1", "standard-2")


@dataclass(frozen=True)
class BenchSpec:
    num_requests: int = 240  # overload phase, all keys
    load: float = 2.0  # offered rate / modelled capacity
    seed: int = 0
    input_mean: float = 512.0
    output_mean: float = 64.0
    num_replicas: int = 2
    # Running sequences per replica: small, so that the cluster's capacity is a number of
    # slots (overload then queues and shows in TTFT, as on a KV-bound GPU) on this box.
    max_num_seqs: int = 8
    # engine.max_step_time_s in modelled ms (0: unset): bounds the steps a better band's
    # request may arrive behind (a worse band's 2048-token chunk beside decodes: ~52 ms).
    max_step_time_ms: float = 0.0
    # engine.worse_band_prefill_tokens (-1: the engine's default).
    worse_band_prefill_tokens: int = -1
    baseline: bool = True  # the overload phase again with worse bands' prompts unlimited
    time_dilation: float = 10.0
    stats_period_s: float = 1.0
    slo_ttft_ms: float = 2000.0  # modelled
    slo_itl_ms: float = 100.0
    admission_queue_size: int = 32
    admission_max_wait_s: float = 60.0  # real seconds
    quick: bool = False
    trace: bool = False  # OpenTelemetry spans of every request: where each band's TTFT goes


def key_id(name: str) -> str:
    from router.frontend.auth import hash_key, key_id_of

    return key_id_of(hash_key(f"kvserve-bench-{name}"))


def app_config(spec: BenchSpec, otlp_endpoint: str | None = None) -> Any:
    from cluster.config import KVServeConfig

    return KVServeConfig.from_dict({
        "app_name": APP_NAME, "route_prefix": f"/{APP_NAME}",
        "model": {"served_model_name": MODEL},
        "engine": {"device": "sim:h200", "model_shape": "llama-3-8b", "time_dilation": spec.time_dilation,
                   "max_model_len": 4096, "max_num_seqs": spec.max_num_seqs,
                   **({"max_step_time_s": spec.max_step_time_ms / 1000} if spec.max_step_time_ms else {}),
                   **({"worse_band_prefill_tokens": spec.worse_band_prefill_tokens}
                      if spec.worse_band_prefill_tokens >= 0 else {})},
        "workers": {"num_replicas": spec.num_replicas, "num_cpus": 0.1},
        "ingress": {"num_replicas": 1, "num_cpus": 0.5, "admission_queue_size": spec.admission_queue_size,
                    "admission_max_wait_s": spec.admission_max_wait_s,
                    "key_priorities": {key_id(name): band for name, (band, _) in KEYS.items()}},
        "routing": {"router": "headroom", "stats_period_s": spec.stats_period_s},
        **({"observability": {"otlp_endpoint": otlp_endpoint, "otlp_protocol": "http/protobuf"}} if otlp_endpoint else {}),
    })


def modelled_capacity_rps(spec: BenchSpec) -> float:
    """Requests/s the cluster completes with every request waiting at once (the simulator)."""
    from cluster.sim.run import simulate
    from cluster.sim.setup import SimConfig
    from cluster.workload.sim_kinds import make_workload

    d = spec.time_dilation
    config = SimConfig(shape="llama-3-8b", profile="h200", num_replicas=spec.num_replicas, router="headroom",
                       stats_period_s=spec.stats_period_s / d, report_lag_s=0.1 / d, max_model_len=4096,
                       max_num_seqs=spec.max_num_seqs, seed=spec.seed)
    burst = make_workload("sharegpt", spec.num_requests, spec.num_requests / 1e-3, spec.seed,
                          input_mean=spec.input_mean, output_mean=spec.output_mean, max_len=MAX_LEN)
    return spec.num_requests / simulate(config, burst).summary()["duration_s"]


def key_workloads(spec: BenchSpec, rate: float) -> dict[str, list[Any]]:
    """Each key's requests (modelled arrivals) at its share of `rate`."""
    from cluster.workload.sim_kinds import make_workload

    out = {}
    for i, (name, (_, share)) in enumerate(KEYS.items()):
        n = max(1, round(spec.num_requests * share))
        out[name] = make_workload("sharegpt", n, rate * share, spec.seed + 101 * i,
                                  input_mean=spec.input_mean, output_mean=spec.output_mean, max_len=MAX_LEN)
    return out


@dataclass
class Outcome:
    key: str
    ttft_s: float  # modelled; inf when it failed or was shed
    good: bool
    status: int | None
    finished: bool
    end_s: float  # real, from the phase start
    error: str | None = None
    output_tokens: int = 0  # why it failed (cluster/bench's short reason and the server's message)


async def drive(url: str, workloads: dict[str, list[Any]], dilation: float, slo_s: tuple[float, float] = (2.0, 0.1),
                cache_salt: str | None = None) -> list[Outcome]:
    """Every key's requests at arrival x dilation, each with its key; one Outcome each.
    `cache_salt`: the phase's own prefix-cache partition, so that a phase replaying another's
    prompts does not find their KV cached (each phase prefills as if first)."""
    from cluster.bench.client import make_client
    from cluster.bench.stream import send_request
    from cluster.workload.text_prompts import BenchRequest

    client = make_client(None, 3600.0)
    loop = asyncio.get_running_loop()
    start_perf, start = time.perf_counter(), loop.time()
    schedule = sorted((r.arrival_s, name, r) for name, rs in workloads.items() for r in rs)

    async def one(i: int, name: str, r: Any) -> tuple[str, Any]:
        bench = BenchRequest(index=i, prompt=list(r.prompt_token_ids), prompt_len=len(r.prompt_token_ids),  # type: ignore[arg-type]
                             max_tokens=r.max_tokens)
        body = {"model": MODEL, "prompt": list(r.prompt_token_ids), "max_tokens": r.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0,
                **({"cache_salt": cache_salt} if cache_salt else {})}
        headers = {"Authorization": f"Bearer kvserve-bench-{name}"}
        return name, await send_request(client, url, body, bench, "completions", start_perf, headers=headers)

    tasks = []
    try:
        for i, (arrival, name, r) in enumerate(schedule):
            delay = start + arrival * dilation - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the open-loop arrival schedule
            tasks.append(asyncio.create_task(one(i, name, r)))
        done = await asyncio.gather(*tasks)
    finally:
        await client.close()
    return [outcome(name, r, dilation, *slo_s) for name, r in done]


def outcome(name: str, r: Any, dilation: float, slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.1) -> Outcome:
    if not r.success or r.ttft_s is None:
        return Outcome(name, math.inf, False, r.status, False, r.start_s + (r.e2e_s or 0.0),
                       f"{r.error}: {(r.error_detail or '')[:160]}")
    ttft, tpot = r.ttft_s / dilation, (r.tpot_s or 0.0) / dilation
    return Outcome(name, ttft, ttft <= slo_ttft_s and tpot <= slo_tpot_s, r.status, True, r.start_s + (r.e2e_s or 0.0),
                   output_tokens=getattr(r, "output_tokens", 0))


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1 = equal shares."""
    if not values or not any(values):
        return math.nan
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


@dataclass(frozen=True)
class Figures:
    """One overload phase's figures against the alone phase."""

    p99_alone: float
    p99_over: float
    ratio: float
    standard_goodput: list[float]
    lost: int
    goodput_rps: float
    tokens_per_s: float


def figures(alone: list[Outcome], overload: list[Outcome], dilation: float) -> Figures:
    p99_alone = percentile([o.ttft_s for o in alone], 99, method="nearest_rank")
    p99_over = percentile([o.ttft_s for o in overload if o.key in PREMIUM], 99, method="nearest_rank")
    duration = max(o.end_s for o in overload) / dilation
    return Figures(
        p99_alone, p99_over, p99_over / p99_alone if p99_alone > 0 else math.nan,
        [sum(o.good for o in overload if o.key == name) / duration for name in SAME_BAND],
        sum(1 for o in alone + overload if not o.finished and o.status not in (429, 503)),
        sum(o.good for o in overload) / duration, sum(o.output_tokens for o in overload) / duration)


def report(alone: list[Outcome], overload: list[Outcome], dilation: float,
           baseline: list[Outcome] | None = None) -> list[str]:
    lines = [f"{'phase':<9} {'key':<12} {'sent':>4} {'done':>4} {'good':>4} {'429':>4} {'503':>4} {'other':>5} "
             f"{'ttft_p50_ms':>11} {'ttft_p99_ms':>11}"]
    phases = (("alone", alone), ("overload", overload), *((("unlimited", baseline),) if baseline else ()))
    for phase, outcomes in phases:
        for name in KEYS:
            mine = [o for o in outcomes if o.key == name]
            if not mine:
                continue
            ttft = [o.ttft_s for o in mine]
            other = sum(1 for o in mine if not o.finished and o.status not in (429, 503))
            p50, p99 = (1000 * percentile(ttft, q, method="nearest_rank") for q in (50, 99))
            lines.append(f"{phase:<9} {name:<12} {len(mine):>4} {sum(o.finished for o in mine):>4} "
                         f"{sum(o.good for o in mine):>4} {sum(o.status == 429 for o in mine):>4} "
                         f"{sum(o.status == 503 for o in mine):>4} {other:>5} {p50:>11.1f} {p99:>11.1f}")
    for o in alone + overload + (baseline or []):
        if not o.finished and o.status not in (429, 503):
            lines.append(f"lost: {o.key}: status {o.status}, {o.error}")
    f = figures(alone, overload, dilation)
    lines.append(f"premium TTFT p99: alone {1000 * f.p99_alone:.1f} ms, under overload {1000 * f.p99_over:.1f} ms (modelled); "
                 f"standard-band goodput {', '.join(f'{g:.2f}' for g in f.standard_goodput)} req/s; "
                 f"all keys: goodput {f.goodput_rps:.2f} req/s, {f.tokens_per_s:.0f} output tokens/s")
    result = (f"RESULT premium_ttft_p99_ratio={f.ratio:.3f} jain_index={jain(f.standard_goodput):.3f} lost={f.lost} "
              f"goodput_rps={f.goodput_rps:.2f} tokens_per_s={f.tokens_per_s:.0f}")
    if baseline:
        b = figures(alone, baseline, dilation)
        lines.append(f"unlimited worse-band prompts: premium TTFT p99 under overload {1000 * b.p99_over:.1f} ms; "
                     f"all keys: goodput {b.goodput_rps:.2f} req/s, {b.tokens_per_s:.0f} output tokens/s")
        result += (f" unlimited_premium_ttft_p99_ratio={b.ratio:.3f} goodput_vs_unlimited={f.goodput_rps / b.goodput_rps:.3f}"
                   f" tokens_vs_unlimited={f.tokens_per_s / b.tokens_per_s:.3f}")
    return lines + [result]


PHASES = ("hold", "dispatch", "queue", "prefill", "traced")  # traced: the four together


def trace_breakdown(spans: list[Any], start_ns: int, end_ns: int, dilation: float) -> list[str]:
    """Where each band's TTFT went (modelled ms), from the spans of the requests that arrived
    in [start_ns, end_ns): hold (admission at the ingress: request -> engine request),
    dispatch (engine request -> the replica's call), queue (the engine's waiting queue),
    prefill (first admission -> first token), traced (the four together: the TTFT from the
    ingress's arrival; the client's TTFT adds the HTTP proxy and the stream's way back);
    and preemptions."""
    by_trace: dict[str, dict[str, Any]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, {})[s.name] = s
    rows: dict[int, list[tuple[float, ...]]] = {}
    for t in by_trace.values():
        req, gen, rep = t.get("kvserve.request"), t.get("kvserve.generate"), t.get("kvserve.replica")
        queue, prefill = t.get("kvserve.engine.queue"), t.get("kvserve.engine.prefill")
        if None in (req, gen, rep, queue, prefill) or not start_ns <= req.start_ns < end_ns:
            continue
        ms = 1e-6 / dilation  # real ns -> modelled ms
        phases = ((gen.start_ns - req.start_ns) * ms, (rep.start_ns - gen.start_ns) * ms,
                  (queue.end_ns - queue.start_ns) * ms, (prefill.end_ns - prefill.start_ns) * ms)
        rows.setdefault(int(gen.attributes.get("kvserve.priority", 0)), []).append(
            (*phases, sum(phases), float(rep.attributes.get("kvserve.num_preemptions", 0))))
    lines = [f"{'band':>4} {'n':>4} " + " ".join(f"{p + '_p50':>12} {p + '_p99':>12}" for p in PHASES)
             + f" {'preempted':>9}  (modelled ms)"]
    for band in sorted(rows):
        r = rows[band]
        columns = [[x[i] for x in r] for i in range(len(PHASES))]
        cols = " ".join(f"{percentile(c, 50, method='nearest_rank'):>12.1f} {percentile(c, 99, method='nearest_rank'):>12.1f}"
                        for c in columns)
        lines.append(f"{band:>4} {len(r):>4} {cols} {sum(x[-1] > 0 for x in r):>9}")
    worst = sorted(rows.get(min(rows), []) if rows else [], key=lambda x: -x[4])[:5]
    for x in worst:
        lines.append("best band, slowest: " + " ".join(f"{p}={v:.1f}" for p, v in zip(PHASES, x)) + f" preemptions={x[-1]:g}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = BenchSpec()
    for f in fields(BenchSpec):
        if f.name == "quick":
            p.add_argument("--quick", action="store_true", help="120 requests")
            continue
        if f.name == "trace":
            p.add_argument("--trace", action="store_true", help="per-band TTFT breakdown from the requests' spans")
            continue
        if f.name == "baseline":
            p.add_argument("--no-baseline", dest="baseline", action="store_false",
                           help="skip the overload phase with worse bands' prompts unlimited")
            continue
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name))
    args = p.parse_args(argv)
    spec = BenchSpec(**{f.name: getattr(args, f.name) for f in fields(BenchSpec)})
    if spec.quick:
        spec = replace(spec, num_requests=120)

    capacity = modelled_capacity_rps(spec)
    rate = spec.load * capacity
    workloads = key_workloads(spec, rate)
    print(f"workload: sharegpt-like (input mean {spec.input_mean:g}, output mean {spec.output_mean:g}), "
          f"{sum(len(w) for w in workloads.values())} requests under overload at {rate:.1f} req/s modelled "
          f"({rate / spec.time_dilation:.2f} req/s real) = {spec.load:g} x the modelled capacity ({capacity:.1f} req/s); "
          f"keys (band, share): {KEYS}; {spec.num_replicas} sim:h200 replicas (llama-3-8b), time dilation "
          f"{spec.time_dilation:g}; admission queue {spec.admission_queue_size}, max wait {spec.admission_max_wait_s:g} s real; "
          f"SLO TTFT {spec.slo_ttft_ms:g} ms, TPOT {spec.slo_itl_ms:g} ms (modelled)", flush=True)

    os.environ["KVSERVE_API_KEYS"] = ",".join(f"kvserve-bench-{name}" for name in KEYS)  # the replicas inherit it
    from ray import serve

    from cluster.app import build_app

    receiver = None
    if spec.trace:
        from tests.integration.otlp_receiver import OTLPReceiver

        receiver = OTLPReceiver()
    port = serve_cluster.start({"KVSERVE_API_KEYS": os.environ["KVSERVE_API_KEYS"]}, throughput_mode=False)
    try:
        t = time.perf_counter()
        serve.run(build_app(app_config(spec, receiver.endpoint if receiver else None)), name=APP_NAME, route_prefix=f"/{APP_NAME}")
        url = f"http://127.0.0.1:{port}/{APP_NAME}/v1/completions"
        warm = {name: [replace(r, arrival_s=0.0, max_tokens=2) for r in rs[:1]] for name, rs in workloads.items()}
        asyncio.run(drive(url, warm, 1.0))
        time.sleep(2 * spec.stats_period_s)  # a benchmark's settling time: fresh routing stats
        print(f"app up and warm in {time.perf_counter() - t:.0f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
        t = time.perf_counter()
        slo = (spec.slo_ttft_ms / 1000, spec.slo_itl_ms / 1000)
        alone = asyncio.run(drive(url, {name: workloads[name] for name in PREMIUM}, spec.time_dilation, slo, "alone"))
        print(f"alone: {time.perf_counter() - t:.0f} s real; load average {os.getloadavg()[0]:.1f}", flush=True)
        time.sleep(2 * spec.stats_period_s)
        t, overload_ns = time.perf_counter(), time.time_ns()
        overload = asyncio.run(drive(url, workloads, spec.time_dilation, slo, "overload"))
        print(f"overload: {time.perf_counter() - t:.0f} s real; load average {os.getloadavg()[0]:.1f}", flush=True)
        overload_end_ns = time.time_ns()
        if receiver is not None:
            time.sleep(8.0)  # the replicas' span exporters send in batches, every few seconds
            spans = receiver.snapshot()
            for phase, (a, b) in (("alone", (0, overload_ns)), ("overload", (overload_ns, overload_end_ns))):
                print(f"trace, {phase}:")
                for line in trace_breakdown(spans, a, b, spec.time_dilation):
                    print("  " + line)
        baseline = None
        if spec.baseline:  # the same overload on engines that never limit worse bands' prompts
            unlimited = replace(spec, worse_band_prefill_tokens=0)
            serve.run(build_app(app_config(unlimited, receiver.endpoint if receiver else None)), name=APP_NAME,
                      route_prefix=f"/{APP_NAME}")
            asyncio.run(drive(url, warm, 1.0))
            time.sleep(2 * spec.stats_period_s)
            t = time.perf_counter()
            baseline = asyncio.run(drive(url, workloads, spec.time_dilation, slo, "unlimited"))
            print(f"overload, worse bands unlimited: {time.perf_counter() - t:.0f} s real; "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        serve_cluster.stop()
        if receiver is not None:
            receiver.close()
    for line in report(alone, overload, spec.time_dilation, baseline):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
