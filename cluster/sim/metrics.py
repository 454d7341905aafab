"""What a simulation measured: per-request records, the summary figures, JSON and a plot.

Definitions (every time is virtual, in seconds):
  TTFT        first token time - arrival time (the arrival at the ingress; router
              queueing, replica queueing, prefill and, when disaggregated, the prefill
              replica's first token — the client sees it before the KV transfer).
  ITL         the gap between consecutive tokens of one request, over every gap of
              every request (a disaggregated request's second token includes the transfer).
  E2E         finish time - arrival time.
  TPOT        a request's mean ITL: (finish - first token) / (output tokens - 1); 0 for one token.
  duration    last finish - first arrival.
  output tokens/s   all output tokens / duration.
  goodput     requests/s that finished with TTFT <= slo_ttft_s AND TPOT <= slo_itl_s
              (DistServe's per-request SLO attainment), / duration. `goodput_fraction` is
              the share of all requests that did (rejected and failed ones count as missed).
  prefix-cache hit rate   prompt tokens served from the prefix cache / prompt tokens,
              over the measured requests that got a first token (as each one's first
              output reported it: the engine's own count at its admission).
  warm-up     requests a workload marks `warmup` (SimRequest.warmup: e.g. one per b2b
              group, so the caches start in the state a long-running cluster would be in)
              are served like any other and load the replicas, but no figure counts them:
              they are not in `records`, their tokens add no ITL, they never end a run early.
  load imbalance   max / mean of per-replica busy time (virtual time spent in steps), over
              every replica that was ever up (with autoscaling, short-lived ones lower the mean).
"""
from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.percentile import percentile
from cluster.sim.replica import SimReplica
from worker.api import RequestOutput

PERCENTILES = (50, 90, 99)


def late_requests_proving_p99_miss(num_requests: int) -> int:
    """How many requests over the TTFT SLO make the run's TTFT p99 exceed it whatever the
    others do. The linear percentile (cluster/percentile.py) puts p99 between the sorted
    values at floor(i) and floor(i) + 1, i = 0.99 (n - 1); once the value at floor(i) is
    late, so is p99."""
    return num_requests - math.floor(0.99 * (num_requests - 1))


class RequestRecord:
    __slots__ = (
        "arrival_s",
        "dispatch_s",
        "error",
        "finish_reason",
        "finish_s",
        "first_token_s",
        "ingress",
        "last_token_s",
        "max_tokens",
        "num_cached_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "replica_keys",
        "request_id",
        "token_times",
        "warmup",
    )

    def __init__(self, request_id: str, arrival_s: float, num_prompt_tokens: int, max_tokens: int,
                 keep_token_times: bool, warmup: bool = False) -> None:
        self.request_id = request_id
        self.warmup = warmup
        self.arrival_s = arrival_s
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.dispatch_s: float | None = None  # first sent to a replica (after any router queueing)
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.last_token_s: float | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.replica_keys: list[int] = []  # every replica that served it (prefill, decode)
        self.ingress = 0  # the ingress router it came through
        self.token_times: list[float] | None = [] if keep_token_times else None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None:
            return None
        n = self.num_output_tokens - 1
        return (self.finish_s - self.first_token_s) / n if n > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class Tracker:
    """Receives every output the replicas deliver and keeps the records."""

    def __init__(self, keep_token_times: bool = False, slo_ttft_s: float = math.inf) -> None:
        self.records: dict[str, RequestRecord] = {}  # measured requests only
        self.num_warmup = 0
        self.keep_token_times = keep_token_times
        self.itl = array("f")  # every inter-token gap (float32: 4 bytes a token)
        self.num_done = 0
        self.slo_ttft_s = slo_ttft_s
        self.num_late = 0  # requests whose first token came after slo_ttft_s
        # Called with (request id, now) as each request finishes (closed-loop turns).
        self.on_finish: Callable[[str, float], None] | None = None

    def add(self, request_id: str, arrival_s: float, num_prompt_tokens: int, max_tokens: int,
            warmup: bool = False) -> RequestRecord:
        rec = RequestRecord(request_id, arrival_s, num_prompt_tokens, max_tokens, self.keep_token_times and not warmup,
                            warmup)
        if warmup:
            self.num_warmup += 1
        else:
            self.records[request_id] = rec
        return rec

    def on_tokens(self, rec: RequestRecord, out: RequestOutput, now: float) -> None:
        n = len(out.new_token_ids)
        if n == 0:
            return
        if rec.first_token_s is None:
            rec.first_token_s = now
            rec.num_cached_tokens = out.num_cached_tokens
            if now - rec.arrival_s > self.slo_ttft_s and not rec.warmup:
                self.num_late += 1
        elif not rec.warmup:
            self.itl.append(now - rec.last_token_s)  # type: ignore[operator]
        rec.last_token_s = now
        rec.num_output_tokens += n
        if rec.token_times is not None:
            rec.token_times.extend([now] * n)

    def finish(self, rec: RequestRecord, now: float, reason: str | None, error: str | None = None) -> None:
        if rec.finish_s is not None:
            return
        rec.finish_s = now
        rec.finish_reason = reason
        rec.error = error
        self.num_done += 1
        if self.on_finish is not None:
            self.on_finish(rec.request_id, now)


def _percentiles(values: Any) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    out = {f"p{p}": percentile(arr, p) for p in PERCENTILES}
    out["mean"] = float(arr.mean()) if arr.size else float("nan")
    return out


@dataclass
class SimResult:
    config: Any  # run.SimConfig
    records: list[RequestRecord]
    replicas: list[SimReplica]
    itl: array
    num_events: int
    router_stats: list[dict[str, Any]] = field(default_factory=list)
    replica_count: list[tuple[float, int]] = field(default_factory=list)  # (time, live replicas)
    # SimConfig.stop_at_slo_miss ended the run once its TTFT p99 was sure to miss the SLO:
    # the figures cover what happened until then (the verdict is the full run's).
    stopped_at_slo_miss: bool = False

    def ok_records(self) -> list[RequestRecord]:
        """Finished without an error (every one that was not rejected, unless the run stopped early)."""
        return [r for r in self.records if r.error is None and r.first_token_s is not None and r.finish_s is not None]

    def summary(self) -> dict[str, Any]:
        cfg = self.config
        ok = self.ok_records()
        start = min((r.arrival_s for r in self.records), default=0.0)
        end = max((r.finish_s for r in self.records if r.finish_s is not None), default=start)
        duration = end - start
        num_output = sum(r.num_output_tokens for r in ok)
        slo_ttft, slo_itl = cfg.slo_ttft_ms / 1000.0, cfg.slo_itl_ms / 1000.0
        num_good = sum(1 for r in ok if r.ttft_s <= slo_ttft and r.tpot_s <= slo_itl)  # type: ignore[operator]
        started = [r for r in self.records if r.first_token_s is not None]
        prompt_tokens = sum(r.num_prompt_tokens for r in started)
        cached_tokens = sum(r.num_cached_tokens for r in started)
        busy = [r.busy_s for r in self.replicas if r.ready_at is not None]  # cancelled starts never served
        mean_busy = sum(busy) / len(busy) if busy else 0.0
        return {
            "num_requests": len(self.records),
            "num_finished": len(ok),
            "num_rejected": sum(1 for r in self.records if r.error is not None),
            "rejection_example": next((r.error for r in self.records if r.error is not None), None),
            "duration_s": duration,
            # TTFT over every request that had its first token (a run stopped at the SLO miss
            # leaves late ones unfinished: they count here).
            "ttft_s": _percentiles([r.ttft_s for r in self.records if r.error is None and r.first_token_s is not None]),
            "itl_s": _percentiles(self.itl),
            "tpot_s": _percentiles([r.tpot_s for r in ok]),
            "e2e_s": _percentiles([r.finish_s - r.arrival_s for r in ok]),  # type: ignore[operator]
            "output_tokens": num_output,
            "output_tokens_per_s": num_output / duration if duration > 0 else 0.0,
            "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
            "slo_ttft_ms": cfg.slo_ttft_ms,
            "slo_itl_ms": cfg.slo_itl_ms,
            "goodput_rps": num_good / duration if duration > 0 else 0.0,
            "goodput_fraction": num_good / len(self.records) if self.records else 0.0,
            "num_preemptions": sum(r.engine.scheduler.num_preemptions for r in self.replicas),
            "num_tier_loaded_blocks": sum(r.tiers.num_loaded_blocks for r in self.replicas if r.tiers is not None),
            "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            "load_imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
            "num_replicas_created": len(self.replicas),
            "max_live_replicas": max((n for _, n in self.replica_count), default=len(self.replicas)),
            "num_router_queued": sum(s["num_queued_total"] for s in self.router_stats),
            "num_events": self.num_events,
            "stopped_at_slo_miss": self.stopped_at_slo_miss,
            # LoRA adapters (cluster/sim/lora.py): writes into a device slot, and reads from
            # storage into host memory, over every replica.
            "lora_slot_loads": sum(r.engine.lora.slots.num_loads for r in self.replicas if r.engine.lora),
            "lora_cold_loads": sum(r.engine.lora.registry.num_host_loads for r in self.replicas if r.engine.lora),
            "routers": self.router_stats,
            "replicas": [{"key": r.key, "role": r.role, "busy_s": r.busy_s, "num_steps": r.num_steps,
                          "num_preemptions": r.engine.scheduler.num_preemptions} for r in self.replicas],
        }

    def timelines(self) -> dict[str, Any]:
        """Per-replica samples at each stats report, and live replicas over time."""
        return {
            "replicas": [{"key": r.key, "role": r.role, "time_s": r.timeline.times,
                          "num_ongoing": r.timeline.num_ongoing, "num_waiting": r.timeline.num_waiting,
                          "num_running": r.timeline.num_running, "kv_usage": r.timeline.kv_usage}
                         for r in self.replicas],
            "live_replicas": [list(x) for x in self.replica_count],
        }

    def to_json(self, indent: int | None = 2, timelines: bool = False) -> str:
        out = self.summary()
        if timelines:
            out["timelines"] = self.timelines()
        return json.dumps(out, indent=indent, sort_keys=True)

    def plot(self, path: str) -> None:
        """Per-replica queue depth (requests at the replica, Serve's view) and KV usage over
        time, sampled at each stats report; live replicas too when autoscaling."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise SystemExit("the plot needs matplotlib: pip install matplotlib") from None
        rows = 3 if self.config.autoscale is not None else 2
        fig, axes = plt.subplots(rows, 1, figsize=(11, 3.2 * rows), sharex=True)
        for r in self.replicas:
            tl = r.timeline
            label = f"{r.role} {r.key}"
            axes[0].plot(tl.times, tl.num_ongoing, linewidth=0.7, label=label)
            axes[1].plot(tl.times, tl.kv_usage, linewidth=0.7, label=label)
        axes[0].set_ylabel("queue depth\n(requests at replica)")
        axes[1].set_ylabel("KV usage")
        axes[1].set_ylim(0, 1.02)
        if rows == 3:
            times, counts = zip(*self.replica_count)
            end = max((tl.times[-1] for tl in (r.timeline for r in self.replicas) if tl.times), default=times[-1])
            axes[2].step(list(times) + [end], list(counts) + [counts[-1]], where="post")
            axes[2].set_ylabel("live replicas")
        axes[-1].set_xlabel("virtual time (s)")
        if len(self.replicas) <= 16:
            axes[0].legend(fontsize=6, ncol=4, loc="upper right")
        s = self.summary()
        axes[0].set_title(f"{self.config.router}, {len(self.replicas)} replicas: TTFT p99 {s['ttft_s']['p99']:.3f} s, "
                          f"{s['output_tokens_per_s']:.0f} tok/s, goodput {s['goodput_rps']:.2f} req/s", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
