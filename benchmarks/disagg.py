"""Mixed pool vs prefill/decode disaggregated pools, side by side on one seeded workload.

    python -m benchmarks.disagg [--quick] [--num-decode-streams 12] [--long-prompt-len 1536] ...

Starts a local Ray + Serve and deploys two kvserve apps (cluster.app.build_app) on the
embedded default model with the same engine settings and the same number of worker
replicas: "mixed" (2 worker replicas, each prefilling and decoding) and "disagg" (1 prefill
+ 1 decode replica, KV handed over between them). The mixed pool is deployed once per
chunked-prefill token budget (--mixed-budgets, default 256,512,2048: sides "mixed256",
"mixed512", "mixed2048"), since a small budget is the standard answer to the interference
disaggregation targets; the disaggregated pools keep --max-num-batched-tokens (2048). Both are driven over streaming HTTP
(the `kvserve bench serve` client, cluster/bench/) with the workload of
cluster/workload/disagg.py: a steady population of decode-heavy streams while long
prompts arrive periodically. The order of the sides rotates by one each round so that
drift in the machine's load hits every side alike.

Reports, per side: TTFT p50/p99 over the long prompts, ITL p50/p99 over the decode-heavy
streams' gaps inside the interference window (and over the whole run), decode
throughput and errors; last line:

    RESULT itl_p99_ratio=<mixed/disagg> ttft_p99_ratio=<mixed/disagg> best_mixed_budget=<b>
           itl_p99_ratio_<b>=... ttft_p99_ratio_<b>=...   (one pair per mixed budget)

(> 1: the disaggregated pools did better). The first two ratios compare with the mixed
budget that gave the lowest ITL p99 (the mixed pool at its best for the metric
disaggregation targets); every budget's pair follows. A benchmark, not a test: nothing here asserts
on timing. On a shared 2-core CPU box four engine replicas, two ingresses, the HTTP proxy
and this client compete for two cores: the numbers say little about GPUs.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.disagg_metrics import gaps_in_window, interference_window, ratio
from cluster.bench.probe import calibrate_prompt_tokens, fetch_models
from cluster.bench.client import CLIENT_ERRORS, make_client
from cluster.bench.stream import RequestResult, completions_url, request_body, send_request
from cluster.percentile import percentile
from cluster.workload.disagg import QUICK, DisaggSpec, decode_stream_requests, long_arrivals, long_requests, round_seed
from cluster.workload.text_prompts import BenchRequest, PromptCalibration
from cluster.serve_env import controller_options, job_runtime_env

DISAGG = "disagg"
CAVEAT = (
    "caveat: measured on a shared CPU box (2 cores for every side's 2 engine replicas and ingress, the proxy "
    "and the client; the sides run one at a time) with a tiny model; prefill/decode interference on a GPU differs in size and kind, "
    "so these numbers say little about GPUs."
)


@dataclass
class SideResult:
    side: str
    decode: list[RequestResult] = field(default_factory=list)
    long: list[RequestResult] = field(default_factory=list)
    itl_window_s: list[float] = field(default_factory=list)  # decode gaps inside the windows
    duration_s: float = 0.0

    @property
    def errors(self) -> int:
        return sum(not r.success for r in self.decode + self.long)

    @property
    def long_ttft_s(self) -> list[float]:
        return [r.ttft_s for r in self.long if r.success and r.ttft_s is not None]

    @property
    def itl_all_s(self) -> list[float]:
        return [gap for r in self.decode if r.success for gap in r.itl_s]

    @property
    def decode_tokens_per_s(self) -> float:
        tokens = sum(r.output_tokens for r in self.decode if r.success)
        return tokens / self.duration_s if self.duration_s > 0 else math.nan


# -- configuration -----------------------------------------------------------------------------
def make_spec(overrides: dict[str, Any], quick: bool) -> DisaggSpec:
    """The defaults, then --quick's sizes, then every flag the user gave (not None)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return DisaggSpec(**{**(QUICK if quick else {}), **given})


def mixed_side(budget: int) -> str:
    return f"mixed{budget}"


def sides(spec: DisaggSpec) -> tuple[str, ...]:
    """The mixed pool at each token budget, then the disaggregated pools."""
    if not spec.mixed_budgets or len(set(spec.mixed_budgets)) != len(spec.mixed_budgets):
        raise ValueError(f"mixed_budgets must be distinct and non-empty, got {spec.mixed_budgets}")
    return (*(mixed_side(b) for b in spec.mixed_budgets), DISAGG)


def side_configs(spec: DisaggSpec) -> dict[str, dict[str, Any]]:
    """KVServeConfig dicts of the apps: one model, one engine section but for the token
    budget, two worker replicas each (mixed: 2 doing both; disagg: 1 prefill + 1 decode)."""

    def common(budget: int) -> dict[str, Any]:
        engine = {
            "device": "cpu",
            "dtype": "float32",
            "num_threads": 1,
            "max_num_batched_tokens": budget,
            "max_num_seqs": spec.max_num_seqs,
            "max_model_len": spec.max_model_len,
        }
        # No API keys, whatever $KVSERVE_API_KEYS holds in this shell: a private loopback cluster.
        return {"engine": engine, "ingress": {"num_cpus": 0.5, "api_keys_env": None}, "routing": {"stats_period_s": 0.5}}

    pool = {"num_replicas": 1, "num_cpus": 1}
    configs = {
        mixed_side(b): {**common(b), "app_name": f"bench-disagg-mixed-{b}", "route_prefix": f"/mixed{b}",
                        "workers": {"num_replicas": 2, "num_cpus": 1}}
        for b in spec.mixed_budgets
    }
    configs[DISAGG] = {**common(spec.max_num_batched_tokens), "app_name": "bench-disagg-pd", "route_prefix": "/pd",
                       "disaggregation": {"prefill": pool, "decode": pool}}
    return configs


def side_order(round_index: int, all_sides: tuple[str, ...]) -> tuple[str, ...]:
    """The sides rotated by one per round: over len(all_sides) rounds each side takes every
    position once, so drift in the machine's load hits every side alike."""
    k = round_index % len(all_sides)
    return all_sides[k:] + all_sides[:k]


# -- one round against one app ------------------------------------------------------------------
async def run_round(client: Any, base_url: str, model: str, spec: DisaggSpec, seed: int,
                    calibration: PromptCalibration, result: SideResult) -> None:
    url = completions_url(base_url, "completions")
    loop = asyncio.get_running_loop()
    start, loop_start = time.perf_counter(), loop.time()
    stop = asyncio.Event()
    decode: list[RequestResult] = []

    async def at(offset_s: float) -> None:
        delay = loop_start + offset_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the open-loop arrival schedule, not synchronisation

    async def slot(index: int) -> None:
        await at(index * spec.stream_stagger_s)
        for request in decode_stream_requests(spec, seed, index, calibration):
            if stop.is_set():
                return
            body = request_body(request, model, "completions")
            decode.append(await send_request(client, url, body, request, "completions", start))

    async def long_prompt(request: BenchRequest, offset_s: float) -> RequestResult:
        await at(offset_s)
        return await send_request(client, url, request_body(request, model, "completions"), request, "completions", start)

    slots = [asyncio.create_task(slot(i)) for i in range(spec.num_decode_streams)]
    pairs = zip(long_requests(spec, seed, calibration), long_arrivals(spec, seed))
    longs = list(await asyncio.gather(*(long_prompt(r, t) for r, t in pairs)))
    stop.set()  # the slots send nothing new; their streams in flight finish
    await asyncio.gather(*slots)
    duration = time.perf_counter() - start
    window = interference_window(longs) or (0.0, duration)
    result.itl_window_s += gaps_in_window(decode, *window)
    result.decode += decode
    result.long += longs
    result.duration_s += duration


async def warm_up(client: Any, base_url: str, model: str, spec: DisaggSpec, calibration: PromptCalibration) -> int:
    """First-step costs (long prefill shapes, KV export/import) outside the measurement:
    two long prompts and a short stream per decode slot, all at once. Returns failures."""
    url = completions_url(base_url, "completions")
    short = dataclasses.replace(spec, decode_output_len=8)
    requests = long_requests(dataclasses.replace(spec, num_long_prompts=2, long_output_len=4), -1, calibration)
    requests += [next(decode_stream_requests(short, -1, i, calibration)) for i in range(spec.num_decode_streams)]
    start = time.perf_counter()
    results = await asyncio.gather(*(
        send_request(client, url, request_body(r, model, "completions"), r, "completions", start) for r in requests
    ))
    return sum(not r.success for r in results)


async def wait_until_serving(client: Any, base_url: str, timeout_s: float = 120.0) -> str:
    """The served model name, once the app answers /v1/models (bounded poll: the proxy
    learns new routes a little after serve.run returns)."""
    deadline = time.monotonic() + timeout_s
    last_error: str = "no model listed"
    while True:
        try:
            models = await fetch_models(client, base_url)
            if models:
                return str(models[0]["id"])
        except (*CLIENT_ERRORS, ValueError) as e:
            last_error = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url} not serving after {timeout_s:.0f} s ({last_error})")
        await asyncio.sleep(0.5)  # a bounded poll for readiness


async def run_all(spec: DisaggSpec, base_urls: dict[str, str], log: Callable[[str], None]) -> dict[str, SideResult]:
    client = make_client(timeout_s=600.0)
    try:
        models = {side: await wait_until_serving(client, url) for side, url in base_urls.items()}
        # One calibration for every side (one tokenizer), so that all get the same prompts.
        calibration = await calibrate_prompt_tokens(client, base_urls[DISAGG], models[DISAGG])
        log(f"calibrated: {calibration.tokens_per_word:.2f} tokens/word + {calibration.overhead_tokens:.0f} overhead")
        all_sides = sides(spec)
        for side in all_sides:
            failed = await warm_up(client, base_urls[side], models[side], spec, calibration)
            log(f"warmed up {side}" + (f" ({failed} warm-up requests FAILED)" if failed else ""))
        results = {side: SideResult(side) for side in all_sides}
        for r in range(spec.num_rounds):
            for side in side_order(r, all_sides):
                log(f"round {r + 1}/{spec.num_rounds}: {side} ...")
                await run_round(client, base_urls[side], models[side], spec, round_seed(spec, r), calibration, results[side])
        return results
    finally:
        await client.close()


# -- the report ---------------------------------------------------------------------------------
def format_report(spec: DisaggSpec, results: dict[str, SideResult], wall_s: float) -> list[str]:
    header = (f"{'side':<10} {'ttft_p50_ms':>11} {'ttft_p99_ms':>11} {'itl_p50_ms':>10} {'itl_p99_ms':>10} "
              f"{'itl_p99_all':>11} {'decode_tok/s':>12} {'long':>5} {'decode':>6} {'gaps':>6} {'errors':>6}")
    lines = [
        f"ttft: over the long prompts (~{spec.long_prompt_len} tokens in, {spec.long_output_len} out); "
        f"itl: over the decode-heavy streams (~{spec.decode_prompt_len} in, ~{spec.decode_output_len} out, "
        f"{spec.num_decode_streams} at a time), gaps ending between the first long prompt sent and the last "
        "answered in each round; itl_p99_all: those streams' gaps over the whole run",
        f"mixed<N>: the mixed pool at chunked-prefill token budget N; disagg: prefill + decode pools at "
        f"budget {spec.max_num_batched_tokens}",
        header,
    ]
    for side in sides(spec):
        s = results[side]
        ttft50, ttft99, itl50, itl99, itl99_all = (1000.0 * percentile(values, q) for values, q in (
            (s.long_ttft_s, 50), (s.long_ttft_s, 99), (s.itl_window_s, 50), (s.itl_window_s, 99), (s.itl_all_s, 99)))
        lines.append(
            f"{side:<10} {ttft50:>11.1f} {ttft99:>11.1f} {itl50:>10.1f} "
            f"{itl99:>10.1f} {itl99_all:>11.1f} {s.decode_tokens_per_s:>12.1f} "
            f"{len(s.long):>5} {len(s.decode):>6} {len(s.itl_window_s):>6} {s.errors:>6}"
        )
    lines.append("errors: " + " ".join(f"{side}={results[side].errors}" for side in sides(spec)))
    lines.append(f"wall time: {wall_s:.0f} s (cluster start, deployment, warm-up, {spec.num_rounds} round(s) per side)")
    lines.append(CAVEAT)
    lines.append(result_line(spec, results))
    return lines


def _ratios(mixed: SideResult, disagg: SideResult) -> tuple[float, float]:
    """(ITL p99, TTFT p99) of mixed over disagg."""
    itl = ratio(percentile(mixed.itl_window_s, 99), percentile(disagg.itl_window_s, 99))
    ttft = ratio(percentile(mixed.long_ttft_s, 99), percentile(disagg.long_ttft_s, 99))
    return itl, ttft


def best_mixed_budget(spec: DisaggSpec, results: dict[str, SideResult]) -> int | None:
    """The budget whose mixed pool had the lowest ITL p99 in the window (None: no data)."""
    measured = {b: percentile(results[mixed_side(b)].itl_window_s, 99) for b in spec.mixed_budgets}
    finite = {b: v for b, v in measured.items() if math.isfinite(v)}
    return min(finite, key=lambda b: (finite[b], b)) if finite else None


def result_line(spec: DisaggSpec, results: dict[str, SideResult]) -> str:
    disagg = results[DISAGG]
    best = best_mixed_budget(spec, results)
    itl, ttft = _ratios(results[mixed_side(best)], disagg) if best is not None else (math.nan, math.nan)
    parts = [f"RESULT itl_p99_ratio={itl:.3f} ttft_p99_ratio={ttft:.3f} best_mixed_budget={best}"]
    for b in spec.mixed_budgets:
        itl_b, ttft_b = _ratios(results[mixed_side(b)], disagg)
        parts.append(f"itl_p99_ratio_{b}={itl_b:.3f} ttft_p99_ratio_{b}={ttft_b:.3f}")
    return " ".join(parts)


# -- the local cluster --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_local_cluster(spec: DisaggSpec, log: Callable[[str], None]) -> dict[str, SideResult]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private loopback cluster
    import ray
    from ray import serve
    from ray.serve.api import RunTarget
    from ray.serve.config import HTTPOptions

    from cluster.app import build_app
    from cluster.config import KVServeConfig

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Logical CPUs: every app's 2 workers + 0.5 ingress, and the proxy, fit; the cores are shared.
    from cluster.local_ray import start_local_ray  # a new cluster, on loopback

    start_local_ray(num_cpus=math.ceil(2.5 * len(sides(spec))) + 2, include_dashboard=False, log_to_driver=False,
                    runtime_env=job_runtime_env({"PYTHONPATH": repo_root, "RAY_AUTH_MODE": "disabled"}))
    port = _free_port()
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port), controller_options=controller_options())
        configs = {side: KVServeConfig.from_dict(data) for side, data in side_configs(spec).items()}
        log(f"deploying {', '.join(configs)} ...")
        # Both apps at once: their replicas start side by side (start-up dominates a quick run).
        serve.run_many([RunTarget(build_app(c), name=c.app_name, route_prefix=c.route_prefix) for c in configs.values()])
        log("deployed")
        base_urls = {side: f"http://127.0.0.1:{port}{c.route_prefix}" for side, c in configs.items()}
        return asyncio.run(run_all(spec, base_urls, log))
    finally:
        serve.shutdown()
        ray.shutdown()


def parse_args(argv: list[str] | None) -> tuple[DisaggSpec, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a shorter run: {QUICK}")
    for f in dataclasses.fields(DisaggSpec):
        default = getattr(DisaggSpec(), f.name)
        kind: Any = type(default)
        if isinstance(default, tuple):  # --mixed-budgets 256,512
            kind = lambda text: tuple(int(x) for x in text.split(",") if x.strip())  # noqa: E731
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None, help=f"default {default}")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(DisaggSpec)}
    return make_spec(overrides, args.quick), args


def main(argv: list[str] | None = None) -> int:
    spec, _ = parse_args(argv)
    began = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - began:6.1f}s] {message}", file=sys.stderr, flush=True)

    log(f"spec: {spec}")
    results = run_on_local_cluster(spec, log)
    for line in format_report(spec, results, time.monotonic() - began):
        print(line, flush=True)  # the last one is the RESULT line
    return 0 if all(r.errors == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
