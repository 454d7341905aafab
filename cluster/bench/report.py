"""The summary of a benchmark run: distributions in ms, the aggregate
metrics (throughput, goodput, TTFT / TPOT / ITL / e2e), a vLLM-style text table, and
strict-JSON conversion."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from cluster.bench.stream import RequestResult
from cluster.percentile import percentile

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def _pkey(q: float) -> str:
    return f"p{q:g}".replace(".", "_")


def distribution_ms(values_s: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """mean / std / max and the percentiles (keys "p50", "p99", "p99_9") in ms."""
    xs = [v * 1000.0 for v in values_s]
    keys = ["mean", "std", "max", *(_pkey(q) for q in percentiles)]
    if not xs:
        return {k: None for k in keys}
    mean = sum(xs) / len(xs)
    out: dict[str, float | None] = {
        "mean": mean,
        "std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)),
        "max": max(xs),
    }
    for q in percentiles:
        out[_pkey(q)] = percentile(xs, q)
    return out


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """Aggregate metrics of one run (plain JSON-able dict). Only successful requests count
    in tokens and latencies. Goodput: successful requests per second with TTFT <=
    slo_ttft_ms and TPOT <= slo_tpot_ms (an SLO not given is met; a one-token output has
    no TPOT and meets that SLO); None when neither SLO is given."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    errors = Counter(r.error or "unknown" for r in failed)
    error_examples: dict[str, str] = {}
    for r in failed:
        if r.error_detail and (r.error or "unknown") not in error_examples:
            error_examples[r.error or "unknown"] = r.error_detail
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)

    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = 0
        for r in ok:
            ttft_ok = slo_ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1000.0 <= slo_ttft_ms)
            tpot = r.tpot_s
            tpot_ok = slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms
            good += ttft_ok and tpot_ok

    return {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "good_requests": good,
        "goodput": per_s(good) if good is not None else None,
        # What the workload asked for vs what the server counted (the prompt is text).
        "mean_prompt_len_requested": (sum(r.prompt_len for r in ok) / len(ok)) if ok else None,
        "mean_prompt_tokens": (
            sum(r.prompt_tokens for r in ok if r.prompt_tokens is not None) / n
            if (n := sum(r.prompt_tokens is not None for r in ok))
            else None
        ),
        "output_len_mismatches": sum(r.output_tokens != r.max_tokens for r in ok),
        "usage_missing": sum(r.usage_missing for r in ok),
        "ttft_ms": distribution_ms((r.ttft_s for r in ok if r.ttft_s is not None), percentiles),
        "tpot_ms": distribution_ms((t for r in ok if (t := r.tpot_s) is not None), percentiles),
        "itl_ms": distribution_ms((x for r in ok for x in r.itl_s), percentiles),
        "e2e_ms": distribution_ms((r.e2e_s for r in ok if r.e2e_s is not None), percentiles),
        "errors": dict(errors.most_common()),
        "error_examples": error_examples,
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """vLLM-style text table of a summarize() dict."""
    width = 50
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{label:<40}{_fmt(value, digits):>10}")

    def section(name: str) -> None:
        lines.append(f"{name}".center(width, "-"))

    for key, label in (("model", "Model:"), ("endpoint", "Endpoint:")):
        if key in summary:
            row(label, summary[key])
    if "request_rate" in summary:
        row("Request rate (req/s):", summary["request_rate"])
        row("Max concurrency:", summary.get("max_concurrency") or "none")
        row("Peak concurrency:", summary.get("peak_concurrency"))
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    if summary.get("cached_prompt_tokens") is not None:
        row("Cached prompt tokens:", summary["cached_prompt_tokens"])
    row("Mean prompt tokens (asked / served):", f"{_fmt(summary['mean_prompt_len_requested'], 1)} / {_fmt(summary['mean_prompt_tokens'], 1)}")
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    if summary.get("goodput") is not None:
        slos = []
        if summary.get("slo_ttft_ms") is not None:
            slos.append(f"TTFT<={summary['slo_ttft_ms']:g}ms")
        if summary.get("slo_tpot_ms") is not None:
            slos.append(f"TPOT<={summary['slo_tpot_ms']:g}ms")
        row(f"Goodput (req/s, {' '.join(slos)}):", summary["goodput"])
        row("Requests meeting the SLOs:", summary["good_requests"])
    for key, name, label in (
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-token Latency", "ITL"),
        ("e2e_ms", "End-to-end Latency", "E2E"),
    ):
        section(name)
        for stat, value in summary[key].items():
            if stat == "std":
                continue
            stat_label = "Mean" if stat == "mean" else "Max" if stat == "max" else stat.upper().replace("_", ".")
            row(f"{stat_label} {label} (ms):", value)
    if summary.get("output_len_mismatches"):
        lines.append(f"warning: {summary['output_len_mismatches']} request(s) produced another number of tokens than max_tokens")
    if summary.get("usage_missing"):
        lines.append(f"warning: {summary['usage_missing']} response(s) without usage: tokens counted as chunks")
    if summary["errors"]:
        section("Errors")
        for reason, count in summary["errors"].items():
            row(f"{reason}:", count)
            example = summary.get("error_examples", {}).get(reason)
            if example:
                lines.append(f"  e.g. {example[:120]}")
    lines.append("=" * width)
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    """`value` with non-finite floats as strings ("inf"), so that the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
