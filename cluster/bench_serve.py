"""`kvserve bench serve`: a load generator against a running kvserve's OpenAI HTTP API,
in the style of `vllm bench serve`.

    kvserve bench serve --num-prompts 200 --request-rate 8 --input-len 256 --output-len 64
    kvserve bench serve --dataset shared-prefix --num-prefix-groups 4 --prefix-len 512 \\
        --suffix-len 64 --max-concurrency 16 --slo-ttft-ms 500 --slo-tpot-ms 50 --json out.json

Every request streams (SSE) with `ignore_eos: true` and `max_tokens`, so each produces
exactly its output length; token counts come from the `usage` chunk the server sends with
`stream_options.include_usage` (the prompt is text, and only the server's tokenizer
knows its real length). Per request: TTFT (send -> first content chunk), ITL (gaps
between content chunks), TPOT ((e2e - TTFT) / (output tokens - 1)) and e2e latency.

This file is the CLI only (registered in cluster/cli.py's SUBCOMMANDS); the library it
drives lives in cluster/bench/ (workload, one streamed request, a whole run, the report).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import asdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from cluster.bench.report import DEFAULT_PERCENTILES, format_summary, jsonable
from cluster.bench.stream import ENDPOINTS
from cluster.workload.text_prompts import DATASETS, BenchRequest, PromptCalibration, generate_workload
from cluster.listen_config import HTTPSection

if TYPE_CHECKING:
    from cluster.bench.run import BenchResult

# Where `kvserve serve` listens by default (the config schema's defaults).
DEFAULT_BASE_URL = f"http://{HTTPSection().host}:{HTTPSection().port}"


def register(subparsers: Any) -> None:
    """`kvserve bench ...` (registered in cluster/cli.py's SUBCOMMANDS)."""
    bench = subparsers.add_parser("bench", help="benchmarks against a running kvserve")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    parser = sub.add_parser(
        "serve",
        help="load-test the OpenAI HTTP API (vllm bench serve style)",
        description="Send a seeded synthetic workload to a running kvserve's OpenAI-compatible "
        "HTTP API (streaming, ignore_eos) and report throughput, TTFT, TPOT, ITL, e2e latency and goodput.",
    )
    add_bench_serve_args(parser)
    parser.set_defaults(func=run_bench_serve)


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return rate


def _json_object(value: str) -> dict[str, Any]:
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def _percentiles(value: str) -> list[float]:
    try:
        qs = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("comma-separated numbers, e.g. 50,90,99") from None
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise argparse.ArgumentTypeError("percentiles must be in [0, 100]")
    return qs


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the server (default {DEFAULT_BASE_URL}; a route prefix goes here)")
    parser.add_argument("--model", help="the served model name (default: the first from /v1/models)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="completions", help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"), help="sent as a bearer token (default $KVSERVE_API_KEY)")
    parser.add_argument("--dataset", choices=DATASETS, default="random")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    parser.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens (default 1024)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)] (default 0)")
    parser.add_argument("--num-prefix-groups", type=int, default=4, help="shared-prefix: distinct prefixes (default 4)")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens (default 512)")
    parser.add_argument("--suffix-len", type=int, default=128, help="shared-prefix: per-request suffix tokens (default 128)")
    parser.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrivals, req/s (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    parser.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True, help="generate exactly max_tokens (default on)")
    parser.add_argument("--extra-body", type=_json_object, help="JSON object merged into every request body")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the server's tokens per word first (a few 1-token requests) so that prompt lengths come out near the asked ones (default on)")
    parser.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    parser.add_argument("--percentiles", type=_percentiles, default=list(DEFAULT_PERCENTILES), help="default 50,90,99")
    parser.add_argument("--timeout", type=float, default=600.0, help="per read/connect timeout in seconds (default 600)")
    parser.add_argument("--json", metavar="FILE", help="write the summary, settings and per-request results as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_bench_serve(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(bench_serve(args))
    except KeyboardInterrupt:
        print("kvserve bench: interrupted", file=sys.stderr)
        return 130


async def bench_serve(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    # aiohttp, imported here to keep `kvserve --help` quick
    from cluster.bench.client import make_client
    from cluster.bench.run import Progress, run_benchmark
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("kvserve bench: --max-concurrency must be >= 1", file=err)
        return 2

    def note(message: str) -> None:
        print(message, file=err, flush=True)

    client = make_client(args.max_concurrency, args.timeout)
    try:
        served = await _served_model(client, args, note)
        if served is None:
            return 1
        model, max_model_len = served
        calibration = await _calibration(client, args, model, note)
        requests = _workload(args, calibration, max_model_len, note)
        mode = f"{args.request_rate:g} req/s" + (f" (burstiness {args.burstiness:g})" if args.burstiness != 1.0 else "")
        if args.max_concurrency:
            mode += f", at most {args.max_concurrency} in flight"
        note(f"kvserve bench: {len(requests)} {args.dataset} requests to {model!r} ({args.endpoint}), {mode}")
        result = await run_benchmark(
            requests,
            base_url=args.base_url,
            model=model,
            endpoint=args.endpoint,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            burstiness=args.burstiness,
            api_key=args.api_key,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            extra_body=args.extra_body,
            progress=Progress(len(requests), stream=err, enabled=not args.no_progress),
            client=client,
        )
    finally:
        await client.close()

    summary = result.summary(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, percentiles=args.percentiles)
    summary["dataset"] = args.dataset
    print(format_summary(summary), file=out, flush=True)
    if args.json:
        _write_json(args.json, args, summary, calibration, result)
        note(f"kvserve bench: wrote {args.json}")
    return 0 if summary["completed"] else 1


async def _served_model(client: Any, args: argparse.Namespace, note: Callable[[str], None]) -> tuple[str, Any] | None:
    """(the model to load, its max_model_len when /v1/models says it): --model, else the
    first served one. None, said through `note`, when there is none to load."""
    from cluster.bench.client import CLIENT_ERRORS  # aiohttp: not at `kvserve --help`
    from cluster.bench.probe import fetch_models

    model = args.model
    max_model_len = None
    try:
        models = await fetch_models(client, args.base_url, args.api_key)
    except (*CLIENT_ERRORS, ValueError) as e:
        if model is None:
            note(f"kvserve bench: cannot list models at {args.base_url}: {type(e).__name__}: {e}")
            return None
        models = []
    if model is None:
        if not models:
            note(f"kvserve bench: {args.base_url} serves no model")
            return None
        model = models[0]["id"]
    for card in models:
        if card.get("id") == model:
            max_model_len = card.get("max_model_len")
    return model, max_model_len


async def _calibration(client: Any, args: argparse.Namespace, model: str, note: Callable[[str], None]) -> PromptCalibration:
    """The server's tokens per word (--calibrate), else 1; a failed probe falls back to 1."""
    from cluster.bench.client import CLIENT_ERRORS  # aiohttp: not at `kvserve --help`
    from cluster.bench.probe import calibrate_prompt_tokens

    if not args.calibrate:
        return PromptCalibration()
    try:
        calibration = await calibrate_prompt_tokens(client, args.base_url, model, args.endpoint, args.api_key)
    except (*CLIENT_ERRORS, ValueError, KeyError) as e:
        reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        note(f"kvserve bench: calibration failed ({reason}); assuming 1 token per word")
        return PromptCalibration()
    note(
        f"kvserve bench: calibrated prompts on the server: {calibration.tokens_per_word:.2f} tokens/word"
        f" + {calibration.overhead_tokens:.0f} tokens overhead"
    )
    return calibration


def _workload(args: argparse.Namespace, calibration: PromptCalibration, max_model_len: Any,
              note: Callable[[str], None]) -> list[BenchRequest]:
    """The seeded requests the arguments describe; a warning when one may pass max_model_len."""
    requests = generate_workload(
        args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        calibration=calibration,
    )
    if max_model_len and requests:
        longest = max(r.prompt_len + r.max_tokens for r in requests)
        if longest > int(max_model_len):
            note(f"kvserve bench: warning: up to {longest} tokens per request; the server's max_model_len is {max_model_len}")
    return requests


def _write_json(path: str, args: argparse.Namespace, summary: dict[str, Any], calibration: PromptCalibration,
                result: BenchResult) -> None:
    """The summary, the settings (never the API key), the calibration and every request."""
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
    document = {
        "summary": summary,
        "settings": settings,
        "calibration": asdict(calibration),
        "requests": [r.to_dict() for r in result.requests],
    }
    with open(path, "w") as f:
        json.dump(jsonable(document), f, indent=1, allow_nan=False)
        f.write("\n")
